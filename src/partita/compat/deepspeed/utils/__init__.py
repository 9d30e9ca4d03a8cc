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

logger = logging.getLogger("partita")


def is_initialized() -> bool:
    """Whether the process group exists."""
    return comm.is_initialized()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Logs `message` on the given ranks (all when None or containing -1)."""
    rank = comm.get_rank() if comm.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


_LEAF_CLASSES: set[type] = set()


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any]) -> list[Any]:
    """Records modules of `leaf_module_classes` (classes or class names) as ZeRO-3 leaves and
    returns them, as DeepSpeed does; a class that matches nothing is an error naming it. partita's
    stage-3 units are whole transformer blocks, so an MoE block's experts are gathered together
    with their block already; the record is what `z3_leaf_module` answers."""
    wanted = {c if isinstance(c, str) else c.__name__ for c in leaf_module_classes}
    found = [m for m in model.modules() if type(m).__name__ in wanted]
    seen = {type(m).__name__ for m in found}
    missing = sorted(wanted - seen)
    if missing:
        raise ValueError(f"set_z3_leaf_modules: no module of class {missing} in the model")
    for m in found:
        _LEAF_CLASSES.add(type(m))
    return found


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules of `model` marked by `set_z3_leaf_modules`."""
    return [m for m in model.modules() if type(m) in _LEAF_CLASSES]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether `model` is a marked leaf."""
    return type(model) in _LEAF_CLASSES


def __getattr__(name: str) -> Any:
    feature = "sequence parallelism" if name == "groups" else None
    raise missing_attribute("deepspeed.utils", name, feature)


__all__ = [
    *_accessors,
    "get_z3_leaf_modules",
    "is_initialized",
    "log_dist",
    "logger",
    "set_z3_leaf_modules",
    "z3_leaf_module",
]
