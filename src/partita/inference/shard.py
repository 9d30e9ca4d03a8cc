"""Applying a `ShardPlan` to a module: slices in, all-reduce hooks on, head counts set.

The module is changed in place: each planned parameter is replaced by this rank's slice (as a
new ``nn.Parameter`` without gradient), each row-parallel module gets a forward hook that sums
its output over the tensor-parallel group, and each attention module gets this rank's head
counts. Parameters come either from the module's own full tensors (`shard_module`) or from a
reader that returns slices (`partita.inference.load`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partita.comm import all_reduce
from partita.comm.process_group import ProcessGroup
from partita.inference.plan import ShardPlan, Slice

__all__ = ["install_plan", "set_parameter", "shard_module", "take_slice"]

TAG = "tp"
"""The tag tensor-parallel all-reduces are counted under in `partita.comm.COUNTERS`."""


def take_slice(full: torch.Tensor, spec: Slice | None) -> torch.Tensor:
    """This rank's part of `full` (a new tensor; `full` is not kept)."""
    if spec is None:
        return full.clone()
    if spec.zero:
        return torch.zeros_like(full)
    parts = [full.narrow(spec.dim, a, b - a) for a, b in spec.ranges]
    return torch.cat(parts, dim=spec.dim) if len(parts) > 1 else parts[0].clone()


def set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replaces parameter `name` of `model` by `value` (inference: no gradient)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if not isinstance(value, nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
    setattr(module, leaf, value)


def _reduce_hook(group: ProcessGroup | None) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"{type(module).__name__}: a row-parallel module must return a tensor, got "
                f"{type(output).__name__}"
            )
        all_reduce(output, group=group, tag=TAG)
        return output

    return hook


def install_plan(model: nn.Module, plan: ShardPlan, group: ProcessGroup | None) -> None:
    """Hooks and attributes of `plan` on `model` (its parameters must already be sliced)."""
    if plan.tp_size == 1:
        return
    for name in plan.reduce:
        model.get_submodule(name).register_forward_hook(_reduce_hook(group))
    for name, values in plan.attrs.items():
        module = model.get_submodule(name)
        for attr, value in values.items():
            setattr(module, attr, value)


def shard_module(
    model: nn.Module, plan: ShardPlan, group: ProcessGroup | None, dtype: torch.dtype
) -> None:
    """Splits a model that holds full weights on every rank (DeepSpeed's way): each planned
    parameter becomes this rank's slice, cast to `dtype`; the rest is cast in place."""
    for name, param in list(model.named_parameters()):
        spec = plan.slices.get(name)
        if spec is not None:
            set_parameter(model, name, take_slice(param.detach(), spec).to(dtype))
    model.to(dtype)
    model.requires_grad_(False)
    install_plan(model, plan, group)
