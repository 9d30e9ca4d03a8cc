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

from partita.comm import all_gather, all_reduce
from partita.comm.process_group import ProcessGroup
from partita.inference.plan import RankSlice, ShardPlan

__all__ = ["install_plan", "set_parameter", "shard_module", "take_slice"]

TAG = "tp"
"""The tag tensor-parallel all-reduces are counted under in `partita.comm.COUNTERS`."""


def take_slice(full: torch.Tensor, spec: RankSlice | None) -> torch.Tensor:
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


def _vocab_embedding_hooks(
    module: nn.Embedding, plan: ShardPlan, group: ProcessGroup | None
) -> None:
    """Looks up the ids this rank holds, zeroes the rest, sums over the group (see
    [Note: vocabulary-parallel])."""
    start, stop = plan.vocab_range
    outside: list[torch.Tensor] = []

    def pre(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args:
            raise TypeError("a vocabulary-parallel embedding takes the ids positionally")
        ids = args[0]
        miss = (ids < start) | (ids >= stop)
        outside.append(miss)
        return ((ids - start).masked_fill(miss, 0), *args[1:])

    def post(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.masked_fill(outside.pop().unsqueeze(-1), 0)
        all_reduce(output, group=group, tag=TAG)
        return output

    module.padding_idx = None  # only steers gradients; may lie outside the shard
    module.num_embeddings = stop - start
    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _vocab_head_hook(plan: ShardPlan, group: ProcessGroup | None) -> Callable[..., Any]:
    """Assembles the vocabulary's logits from each rank's columns (padded to equal width)."""

    def hook(module: nn.Module, args: Any, local: torch.Tensor) -> torch.Tensor:
        pad = plan.vocab_chunk - local.shape[-1]
        if pad:
            local = torch.nn.functional.pad(local, (0, pad))
        local = local.contiguous()
        gathered = local.new_empty((plan.tp_size, *local.shape))
        all_gather(gathered, local, group=group, tag=TAG)
        full = gathered.movedim(0, -2).reshape(*local.shape[:-1], -1)
        return full[..., : plan.vocab_size]

    return hook


def _alibi_hook(heads: tuple[int, int, int]) -> Callable[..., Any]:
    """Keeps this rank's heads of the ALiBi bias ((batch x heads, 1, keys) or (batch, heads,
    1, keys)) and of a 4-D attention mask with one row per head (the model builds both for
    all heads)."""
    start, stop, total = heads

    def pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        alibi = kwargs.get("alibi")
        if isinstance(alibi, torch.Tensor) and alibi.dim() == 4:  # (batch, heads, 1, keys)
            kwargs["alibi"] = alibi[:, start:stop]
        elif isinstance(alibi, torch.Tensor):  # (batch x heads, 1, keys)
            per_head = alibi.view(-1, total, *alibi.shape[1:])[:, start:stop]
            kwargs["alibi"] = per_head.reshape(-1, *alibi.shape[1:])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == total:
            kwargs["attention_mask"] = mask[:, start:stop]
        return args, kwargs

    return pre


def install_plan(model: nn.Module, plan: ShardPlan, group: ProcessGroup | None) -> None:
    """Hooks and attributes of `plan` on `model` (its parameters must already be sliced)."""
    if plan.tp_size == 1:
        return
    for name, kind in plan.vocab.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Embedding) and kind == "embedding":
            _vocab_embedding_hooks(module, plan, group)
        elif isinstance(module, nn.Linear) and kind == "head":
            module.out_features = plan.vocab_range[1] - plan.vocab_range[0]
            module.register_forward_hook(_vocab_head_hook(plan, group))
    for name in plan.reduce:
        model.get_submodule(name).register_forward_hook(_reduce_hook(group))
    for name, values in plan.attrs.items():
        module = model.get_submodule(name)
        for attr, value in values.items():
            setattr(module, attr, value)
    for name, heads in plan.head_ranges.items():
        hook = _alibi_hook(heads)
        model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True)


def shard_module(
    model: nn.Module, plan: ShardPlan, group: ProcessGroup | None, dtype: torch.dtype
) -> None:
    """Splits a model that holds full weights on every rank (DeepSpeed's way): each planned
    parameter becomes this rank's slice, cast to `dtype`; the rest is cast in place."""
    tied: dict[int, list[str]] = {}  # a tied head must keep sharing the embedding's slice
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    for names in tied.values():
        spec = plan.slices.get(names[0])
        if spec is not None:
            full = model.get_parameter(names[0]).detach()
            value = nn.Parameter(take_slice(full, spec).to(dtype), requires_grad=False)
            for name in names:
                set_parameter(model, name, value)
    model.to(dtype)
    model.requires_grad_(False)
    install_plan(model, plan, group)
