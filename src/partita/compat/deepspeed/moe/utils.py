"""``deepspeed.moe.utils``: telling expert parameters from dense ones, and splitting optimizer
parameter groups so that each holds one kind (what ZeRO 1-2 need: expert groups are sharded
over the expert-data-parallel group)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from partita.moe.layer import moe_layers

DEFAULT_MAX_GROUP_SIZE = 178956971
"""Largest expert parameter group, in elements, before it is cut (DeepSpeed's default)."""


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed marks as an expert's (``allreduce`` False)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """Whether `m` holds an MoE layer, and the first one's number of experts (0 without)."""
    layers = moe_layers(m)
    return (True, layers[0].num_experts) if layers else (False, 0)


def split_params_into_shared_and_expert_params(
    params: Iterable[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(dense, expert)`` parameters of `params`, each in the given order."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dense, expert)`` gradients (in each parameter's dtype) of the parameters that have
    one."""
    dense, expert = split_params_into_shared_and_expert_params(
        p for p in group if p.grad is not None
    )
    return [p.grad.to(p.dtype) for p in dense], [p.grad.to(p.dtype) for p in expert]  # type: ignore[union-attr]


def _cut(params: list[nn.Parameter], max_numel: int | float | None) -> list[list[nn.Parameter]]:
    """`params` in consecutive runs of at most `max_numel` elements (one run without a cap);
    a parameter larger than the cap gets a run of its own."""
    if max_numel is None:
        return [params]
    runs: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if runs[-1] and size + p.numel() > max_numel:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += p.numel()
    return [r for r in runs if r] or [[]]


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """`param_groups` with their expert parameters moved out: each group keeps its dense ones,
    and for each group and each expert group name a new group follows (same hyperparameters,
    ``name`` = the expert group name, ``moe`` True), cut at `max_group_size` elements. Groups
    need a ``name`` key, as in DeepSpeed."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list | tuple):
        groups = list(param_groups)
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    added: list[dict[str, Any]] = []
    for group in groups:
        params = list(group["params"])
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name in names:
            experts = [p for p in params if is_moe_param(p) and p.group_name == name]
            for run in _cut(experts, max_group_size):
                added.append({**group, "name": name, "moe": True, "params": run})
    return groups + added


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """True for a group `split_params_into_different_moe_groups_for_optimizer` made."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Expert-aware parameter groups from a list of parameters or of group dicts (groups
    already split are returned unchanged)."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, torch.Tensor | dict):
            raise TypeError(
                "param argument that would be given to the optimizer should be an iterable of "
                f"Tensors or dicts, but got {type(p)}"
            )
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]
