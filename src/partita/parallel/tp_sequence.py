"""Sequence parallelism between tensor-parallel blocks (Megatron's ``sequence_parallel``).

[Note: sequence-parallel norms]
Under plain tensor parallelism every tensor rank holds the whole residual stream between the
blocks: the norms, the residual adds, the dropouts there run tp times on the same numbers and
their activations sit tp times in memory. With ``tensor_parallel.sequence_parallel`` each tensor
rank keeps 1/tp of the sequence there instead, and the block boundaries change collective:

- the stream is cut by sequence at the input of the first decoder layer (forward: this rank's
  slice, no communication; backward: the slices' gradients all-gathered);
- a block (the module holding a row-parallel linear: an attention, an MLP) gathers its input
  along the sequence (all-gather forward; backward, the column-parallel linears' partial input
  gradients reduce-scattered, which replaces plain tensor parallelism's all-reduce, so those
  linears skip their own copy);
- its row-parallel linear reduce-scatters its partial sums along the sequence instead of
  all-reducing them (backward: an all-gather of the output gradient); the replicated bias is
  added to this rank's slice;
- the final norm's output is gathered whole for the head (backward: this rank's slice of the
  gradient, which the head made equal on every tensor rank).

An all-gather and a reduce-scatter move what one all-reduce moves, so the bytes per block are
plain tensor parallelism's, while the stream's activations shrink by tp. The replicated
parameters used on a sequence slice (the norms' weights, the row-parallel biases) get only this
slice's share of their gradient: a gradient hook sums it over the tensor group before it is
accumulated, so every tensor rank holds the whole gradient as before (and the norm counts it
once). Dropout on a slice (after a row-parallel linear) keeps this rank's rows of the one-process
mask ([Note: dropout under tensor parallelism]); a dropout module elsewhere in the decoder
layers would draw the same rows on every slice and is refused. The sequence length must divide
by tp (refused by value at the first layer otherwise: pad the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita.comm import all_gather, all_reduce, reduce_scatter
from partita.comm.process_group import ProcessGroup

TAG = "tp"
"""Counted with the other tensor-parallel collectives (`partita.parallel.tensor.TAG`)."""
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
"""Names of the norm after the decoder layers, on the module holding the layer list."""
KEY = "tensor_parallel.sequence_parallel"


@dataclass(frozen=True)
class SequencePlan:
    """Where the stream is cut and joined: the decoder layer list, the blocks (each holding
    row-parallel linears), the final norm."""

    layers: str
    blocks: tuple[str, ...]
    norm: str


def plan_sequence_parallel(model: nn.Module, styles: dict[str, str]) -> SequencePlan:
    """The `SequencePlan` of `model` split by `styles` (linear name -> tensor-parallel style);
    reads the module tree only. Raises ValueError naming what does not fit."""
    name = type(model).__name__
    rows = [n for n, s in styles.items() if s == "rowwise"]
    columns = [n for n, s in styles.items() if s in ("colwise", "fused_qkv")]
    blocks = tuple(sorted({n.rpartition(".")[0] for n in rows}))
    for block in blocks:
        if not any(c.startswith(block + ".") for c in columns):
            raise ValueError(f"{KEY}: {name}.{block} holds a row-parallel linear but no "
                             "column-parallel one to gather its input for")  # fmt: skip
    lists = {_layer_list(model, block) for block in blocks}
    if len(lists) != 1 or None in lists:
        raise ValueError(
            f"{KEY}: {name}'s tensor-parallel blocks ({', '.join(blocks) or 'none'}) are not "
            "all inside one list of decoder layers"
        )
    layers = lists.pop()
    assert layers is not None
    owner = layers.rpartition(".")[0]
    holder = model.get_submodule(owner) if owner else model
    norm = next((n for n in FINAL_NORMS if isinstance(getattr(holder, n, None), nn.Module)), None)
    if norm is None:
        raise ValueError(f"{KEY}: {name} has no final norm after {layers} (looked for "
                         f"{', '.join(FINAL_NORMS)})")  # fmt: skip
    for sub, module in model.get_submodule(layers).named_modules():
        full = f"{layers}.{sub}"
        inside = any(full == b or full.startswith(b + ".") for b in blocks)
        if isinstance(module, nn.Dropout) and module.p > 0 and not inside:
            raise ValueError(
                f"{KEY}: {name}.{full} is a dropout (p={module.p}) on the sequence-split "
                "stream outside the tensor-parallel blocks; partita cannot slice its mask"
            )
    return SequencePlan(layers, blocks, f"{owner}.{norm}" if owner else norm)


def _layer_list(model: nn.Module, block: str) -> str | None:
    """The name of the `nn.ModuleList` whose element holds `block` (None: none does)."""
    parts = block.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            owner = ".".join(parts[:i])
            if isinstance(model.get_submodule(owner), nn.ModuleList):
                return owner
    return None


# --- the collectives along the sequence (dim 1) --------------------------------------------------


def _gather(x: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
    """(B, n, ...) slices of every rank -> (B, size * n, ...), in rank order."""
    local = x.contiguous()
    out = local.new_empty((size, *local.shape))
    all_gather(out, local, group=group, tag=TAG)
    return out.movedim(0, 1).reshape(local.shape[0], size * local.shape[1], *local.shape[2:])


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup | None, size: int) -> torch.Tensor:
    """(B, S, ...) partial sums -> this rank's (B, S / size, ...) slice of their sum."""
    b, s = x.shape[0], x.shape[1]
    chunks = x.reshape(b, size, s // size, *x.shape[2:]).movedim(1, 0).contiguous()
    out = x.new_empty((b, s // size, *x.shape[2:]))
    reduce_scatter(out, chunks, group=group, tag=TAG)
    return out


def _slice(x: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    n = x.shape[1] // size
    return x.narrow(1, rank * n, n).contiguous()


class _Cut(torch.autograd.Function):
    """This rank's sequence slice; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _slice(x, size, rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.group, ctx.size), None, None, None


class _Join(torch.autograd.Function):
    """The whole sequence from the slices; backward reduce-scatters (`partial`: each rank
    holds a part of the gradient) or keeps this rank's slice (the gradient is whole already)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, size: int, rank: int, partial: bool
    ) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rank, ctx.partial = group, size, rank, partial
        return _gather(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.partial:
            out = _reduce_scatter(grad, ctx.group, ctx.size)
        else:
            out = _slice(grad, ctx.size, ctx.rank)
        return out, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Partial sums -> this rank's slice of the sum; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _reduce_scatter(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.size), None, None


def reduce_scatter_sequence(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """A row-parallel linear's partial output -> this rank's sequence slice of the sum."""
    return _ReduceScatter.apply(x, group, size)


# --- installing it ---------------------------------------------------------------------------------


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, bool]:
    """The hidden states a module was called with, and whether they came positionally."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], True
    return kwargs["hidden_states"], False


def _replace_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], value: torch.Tensor, positional: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if positional:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def install_sequence_parallel(
    model: nn.Module, plan: SequencePlan, group: ProcessGroup | None, size: int, rank: int
) -> None:
    """Cuts and joins the stream as [Note: sequence-parallel norms] says: hooks on the first
    decoder layer, the blocks and the final norm; the blocks' linears switched; gradient hooks
    on the replicated parameters used on slices."""
    from partita.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    layers = model.get_submodule(plan.layers)
    assert isinstance(layers, nn.ModuleList)

    def cut(module: nn.Module, args: Any, kwargs: Any) -> Any:
        hidden, positional = _hidden(args, kwargs)
        if hidden.shape[1] % size:
            raise ValueError(
                f"{KEY}: sequence length {hidden.shape[1]} does not divide by "
                f"tensor_parallel.autotp_size {size}; pad the batch to a multiple of {size}"
            )
        return _replace_hidden(args, kwargs, _Cut.apply(hidden, group, size, rank), positional)

    def join(module: nn.Module, args: Any, kwargs: Any) -> Any:
        hidden, positional = _hidden(args, kwargs)
        whole = _Join.apply(hidden, group, size, rank, True)
        return _replace_hidden(args, kwargs, whole, positional)

    layers[0].register_forward_pre_hook(cut, with_kwargs=True)
    for name in plan.blocks:
        block = model.get_submodule(name)
        block.register_forward_pre_hook(join, with_kwargs=True)
        for linear in block.modules():
            if isinstance(linear, RowParallelLinear):
                linear.sequence_parallel = True
            elif isinstance(linear, ColumnParallelLinear):
                linear.gathered_input = True
    model.get_submodule(plan.norm).register_forward_hook(
        lambda module, args, out: _Join.apply(out, group, size, rank, False)
    )
    sliced = [*layers.parameters(), *model.get_submodule(plan.norm).parameters()]
    for param in {id(p): p for p in sliced}.values():
        if param.requires_grad and not getattr(param, "tensor_model_parallel", False):
            param.register_hook(_sum_over(group))


def _sum_over(group: ProcessGroup | None) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(total, group=group, tag=TAG)
        return total

    return hook
