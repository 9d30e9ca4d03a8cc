"""``deepspeed.utils``: the logger, the ``safe_get_*`` / ``safe_set_*`` accessors and
``set_z3_leaf_modules``."""

from __future__ import annotations

import logging
from typing import Any

import torch

from partita import comm
from partita.compat.deepspeed._missing import missing_attribute
from partita.utils import *  # noqa: F403  (the safe_get_* / safe_set_* accessors)
from partita.utils import __all__ as _accessors
from partita.zero.stage3.leaves import class_names, is_leaf

logger = logging.getLogger("partita")


def is_initialized() -> bool:
    """Whether the process group exists."""
    return comm.is_initialized()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Logs `message` on the given ranks (all when None or containing -1)."""
    rank = comm.get_rank() if comm.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: list[Any], raise_if_not_found: bool = True
) -> list[Any]:
    """Declares the modules of `leaf_module_classes` (classes, class names or qualified names)
    conditional and returns them, as DeepSpeed does: under ZeRO-3 each is gathered with its
    parent module on every rank, whether or not a rank runs it (see [Note: conditional
    modules] in `partita.zero.stage3.leaves`). The flag is DeepSpeed's ``_z3_leaf`` attribute
    on each instance; call it before ``initialize``. A class that matches nothing is an error
    naming it."""
    return _flag(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: list[Any], raise_if_not_found: bool = True
) -> list[Any]:
    """Undoes `set_z3_leaf_modules` for those classes."""
    return _flag(model, leaf_module_classes, False, raise_if_not_found)


def _flag(
    model: torch.nn.Module, classes: list[Any], value: bool, raise_if_not_found: bool
) -> list[Any]:
    wanted = {c if isinstance(c, str) else c.__name__ for c in classes}
    found = []
    for m in model.modules():
        if class_names(m) & wanted:
            m._z3_leaf = value  # type: ignore[assignment]
            found.append(m)
    if not found and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules: no module of class {sorted(wanted)} in the model")
    return found


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module,
    module_names: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Sets the leaf flag of the modules named `module_names` (names of
    ``model.named_modules()``); returns them and the names that matched nothing (an error
    naming them with `raise_if_not_found`)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in the model")
    for m in found:
        m._z3_leaf = flag
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module,
    module_name_suffixes: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Sets the leaf flag of every module whose ``named_modules()`` name ends with one of
    `module_name_suffixes` (at a dot or whole); returns them and the suffixes that matched
    nothing (an error naming them with `raise_if_not_found`)."""
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for n, m in model.named_modules() if n == suffix or n.endswith("." + suffix)]
        if not hits:
            missing.append(suffix)
        found.update((id(m), m) for m in hits)
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_suffix: no module name ends with {missing} in the model"
        )
    for m in found.values():
        m._z3_leaf = flag  # type: ignore[assignment]
    return list(found.values()), missing


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether `model` (a parameter) is flagged as a leaf's (DeepSpeed sets ``ds_z3_leaf_module``
    on parameters; partita flags modules only, so a parameter never is)."""
    return bool(getattr(model, "ds_z3_leaf_module", False))


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Sets or clears the leaf flag of one module instance."""
    model._z3_leaf = flag  # type: ignore[assignment]


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules of `model` declared by `set_z3_leaf_modules`."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether `model` is a declared leaf."""
    return is_leaf(model)


def __getattr__(name: str) -> Any:
    if name == "RepeatingLoader":  # imported lazily: the pipeline engine pulls in more
        from partita.parallel.pipe_engine import RepeatingLoader

        return RepeatingLoader
    feature = "sequence parallelism" if name == "groups" else None
    raise missing_attribute("deepspeed.utils", name, feature)


__all__ = [
    *_accessors,
    "get_z3_leaf_modules",
    "is_initialized",
    "log_dist",
    "logger",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
