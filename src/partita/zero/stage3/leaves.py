"""Conditional (leaf) modules: gathered with their parent, whether or not a rank runs them.

[Note: conditional modules]
A module that runs on some ranks only (a vision tower on batches with images) would be gathered
by those ranks only, and the ranks' collectives would stop pairing ([Note: rank divergence]).
Declared, its parameters join its parent module's unit, which the parent's forward gathers on
every rank; a rank that skips the module leaves zeros in its gradients, which are
reduce-scattered with the rest, so the result is one process's over the global batch.
Modules inside a unit module (a transformer block: a Mixtral block's experts) are gathered
with it already, so declaring them changes nothing.

Declared through ``zero_optimization.leaf_module`` (DeepSpeed's ``classes``, ``names`` and
``name_suffixes``) or ``deepspeed.utils.set_z3_leaf_modules`` (a ``_z3_leaf`` flag on the
instance, DeepSpeed's attribute).
"""

from __future__ import annotations

from typing import Any

import torch


def is_leaf(module: torch.nn.Module) -> bool:
    """Whether `module` carries the ``_z3_leaf`` flag (`set_z3_leaf_modules`)."""
    return bool(getattr(module, "_z3_leaf", False))


def declared_leaves(model: torch.nn.Module, config: Any) -> list[torch.nn.Module]:
    """Modules of `model` declared conditional: flagged instances, then the config's
    ``classes`` (class name or qualified name; DeepSpeed's defaults name MoE blocks that need
    not exist), ``names`` and ``name_suffixes`` (each must match a module: a ValueError names
    the one that does not, before any collective)."""
    named = list(model.named_modules())
    found = [m for _, m in named if is_leaf(m)]
    if config is None:
        return found
    classes = set(config.classes)
    found += [m for _, m in named if class_names(m) & classes]
    by_name = dict(named)
    for name in config.names:
        if name not in by_name:
            raise ValueError(
                f"zero_optimization.leaf_module.names: no module named {name!r} in the model"
            )
        found.append(by_name[name])
    for suffix in config.name_suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            raise ValueError(
                f"zero_optimization.leaf_module.name_suffixes: no module name ends with {suffix!r}"
            )
        found += hits
    unique: dict[int, torch.nn.Module] = {id(m): m for m in found}
    return list(unique.values())


def class_names(module: torch.nn.Module) -> set[str]:
    """The names a declaration may give `module`'s class by: bare and qualified."""
    cls = type(module)
    return {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}


def leaf_groups(
    model: torch.nn.Module, leaves: list[torch.nn.Module]
) -> list[tuple[str, torch.nn.Module, list[torch.nn.Module]]]:
    """(parent name, parent, its declared children) for each parent of a declared module,
    outermost parents first (an inner leaf's parameters are taken by the outer one's unit)."""
    names = {id(m): n for n, m in model.named_modules()}
    groups: dict[str, list[torch.nn.Module]] = {}
    for leaf in leaves:
        name = names.get(id(leaf))
        if not name:  # the root itself, or not part of this model: nothing above to join
            continue
        groups.setdefault(name.rpartition(".")[0], []).append(leaf)
    ordered = sorted(groups, key=lambda n: (n.count(".") + bool(n), n))
    return [(n, model.get_submodule(n), groups[n]) for n in ordered]
