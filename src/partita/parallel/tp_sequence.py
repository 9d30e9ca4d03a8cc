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
slice's share of their gradient: it is summed over the tensor group before it is accumulated,
one flat all-reduce per decoder layer and one for the final norm ([Note: batched sums of the
sliced parameters' gradients]), so every tensor rank holds the whole gradient as before (and
the norm counts it once). Dropout on a slice (after a row-parallel linear) keeps this rank's
rows of the one-process mask ([Note: dropout under tensor parallelism]); a dropout module
elsewhere in the decoder layers would draw the same rows on every slice and is refused. The
sequence length must divide by tp (refused by value at the first layer otherwise: pad the
batch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
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
    decoder layer, the blocks and the final norm; the blocks' linears switched; the replicated
    parameters used on slices summed over the tensor group in one all-reduce per decoder layer
    and one for the final norm ([Note: batched sums of the sliced parameters' gradients])."""
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
    norm = model.get_submodule(plan.norm)
    norm.register_forward_hook(lambda module, args, out: _Join.apply(out, group, size, rank, False))
    wrapped: set[int] = set()
    for owner in [*layers, norm]:
        _install_bucket(owner, group, wrapped)


# --- the replicated parameters' gradients, summed per bucket --------------------------------------

# [Note: batched sums of the sliced parameters' gradients]
# Each tensor rank computes a replicated parameter's gradient from its own sequence slice, so the
# whole gradient is their sum over the tensor group, needed before the gradient is accumulated:
# ZeRO (every stage) takes each gradient as it is accumulated (post-accumulate hooks), copies it
# into its buckets or unit buffers and reduces those over the data-parallel ranks during the
# backward. One all-reduce per parameter (a tensor hook each) paid a collective's latency for
# every norm weight and bias (Llama 2 a layer, GPT-2 6). Instead, a bucket is a module (an
# "owner": each decoder layer, and the final norm) and the sliced parameters inside it:
#
# - the first module holding such a parameter (a norm, a row-parallel linear's bias) to run in
#   an owner's forward passes its input through `_BucketSum` with all the bucket's parameters,
#   which hands back one stand-in ("token") per parameter; the owner's forward pre-hook
#   forgets the last call's tokens;
# - each such module runs its forward with its parameters replaced by `_Use(parameter,
#   token)`: the same tensor forward, whose backward hands the gradient to the token;
# - `_BucketSum`'s backward runs once the gradients of all its outputs are whole, i.e. after
#   every use inside the owner: it concatenates the tokens' gradients, all-reduces them once
#   over the tensor group, and returns each parameter's slice of the sum, which autograd
#   accumulates as the parameter's gradient: once per parameter and backward, as ZeRO 0-2
#   count arrivals per bucket.
#
# Being made inside the owner's forward, `_BucketSum` is inside ZeRO-3's `_PostBackward` on the
# owner's inputs (whose backward, the unit's reduction, needs the gradients the sum hands out)
# and inside a layer's activation checkpoint (reentrant: made and summed within the
# recomputation's backward; non-reentrant: the recomputation reuses the forward's tokens, its
# graph is never run).
#
# Why a bucket per decoder layer and not one per backward: ZeRO-3 reduces (and frees) each
# layer's unit when that layer's backward is over; one bucket for the model would hold every
# unit's reduction, and its whole gradient buffer, until the end of backward. Why each
# micro-batch and not once at the gradient accumulation boundary (valid by linearity): the
# accumulated gradients live in ZeRO's buffers by then, and at stages 1-3 ZeRO reduces them
# during the boundary's backward; summing there would need ZeRO to hold those buckets or units
# back (as a pipeline's tied weights are, `hold_gradients`), at stage 3 a whole unit's gradient
# per layer over every micro-batch. A module holding such a parameter whose input has no tensor
# sums that gradient alone (`_SumNow`), as before.


@dataclass
class _Bucket:
    """An owner's sliced parameters, as (module, name), read at each forward."""

    group: ProcessGroup | None
    slots: list[tuple[nn.Module, str]]
    tokens: dict[int, torch.Tensor] | None = field(default=None)
    """id(parameter) -> its token, from the first use in the owner's current forward (None
    before it, and once summed)."""
    serial: int = 0
    """Counts the `_BucketSum`s made: the one whose tokens are current clears them."""

    def live(self) -> list[torch.Tensor]:
        """The bucket's parameters that take a gradient now, each once, in a fixed order (the
        same on every tensor rank: the flat all-reduce's layout)."""
        params = (m._parameters.get(n) for m, n in self.slots)
        live = {id(p): p for p in params if p is not None and p.requires_grad}
        return list(live.values())

    def forget(self, *_: Any) -> None:
        """The owner's forward pre-hook: a new call makes new tokens."""
        self.tokens = None


def _sliced(param: torch.Tensor) -> bool:
    """A parameter every tensor rank holds whole (not split by `partita.parallel.tensor`)."""
    return param.requires_grad and not getattr(param, "tensor_model_parallel", False)


def _install_bucket(owner: nn.Module, group: ProcessGroup | None, wrapped: set[int]) -> None:
    """Makes `owner` and the sliced parameters of the modules inside it one bucket, summed over
    `group` in one all-reduce per backward ([Note: batched sums of the sliced parameters'
    gradients]). A module already in an earlier bucket (`wrapped`: ids) stays there; a tied
    parameter held by modules of two buckets is summed in each for the uses there (the sums
    add up: autograd accumulates both)."""
    bucket = _Bucket(group, [])
    for module in owner.modules():
        names = [n for n, p in module.named_parameters(recurse=False) if _sliced(p)]
        if names and id(module) not in wrapped:
            wrapped.add(id(module))
            bucket.slots.extend((module, n) for n in names)
            module.forward = functools.partial(_use_forward, bucket, module, names, module.forward)
    if bucket.slots:
        owner.register_forward_pre_hook(bucket.forget)


def _use_forward(
    bucket: _Bucket,
    module: nn.Module,
    names: list[str],
    inner: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """`module`'s forward with its sliced parameters routed to the bucket's tokens (made here
    when this is the owner's first such module to run)."""
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    if bucket.tokens is None:
        args, kwargs = _open(bucket, args, kwargs)
    slots = module._parameters
    kept = {n: slots[n] for n in names}
    tokens = bucket.tokens or {}
    try:
        for n, p in kept.items():
            if p is None or not p.requires_grad:
                continue
            token = tokens.get(id(p))
            use = _Use.apply(p, token) if token is not None else _SumNow.apply(p, bucket.group)
            slots[n] = use  # a plain tensor, for this forward only
        return inner(*args, **kwargs)
    finally:
        slots.update(kept)


def _open(
    bucket: _Bucket, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Passes the first tensor among `args` and `kwargs` through a new `_BucketSum` and makes
    its tokens the bucket's (none without a tensor or a live parameter)."""
    params = bucket.live()
    key = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
    name = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if not params:
        return args, kwargs
    if key is not None:
        x, *tokens = _BucketSum.apply(args[key], bucket, *params)
        args = (*args[:key], x, *args[key + 1 :])
    elif name is not None:
        x, *tokens = _BucketSum.apply(kwargs[name], bucket, *params)
        kwargs = {**kwargs, name: x}
    else:
        return args, kwargs
    bucket.tokens = {id(p): t for p, t in zip(params, tokens, strict=True)}
    return args, kwargs


class _BucketSum(torch.autograd.Function):
    """The input unchanged, and a token per parameter; backward sums the tokens' gradients
    over the tensor group in one flat all-reduce (per dtype) and returns them as the
    parameters' gradients (zeros for one unused in this forward, as on every tensor rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bucket: _Bucket, *params: torch.Tensor) -> Any:
        bucket.serial += 1
        ctx.bucket, ctx.serial = bucket, bucket.serial
        # Tokens carry a shape for autograd; their values are never read (one element each).
        tokens = [
            torch.empty_strided(p.shape, (0,) * p.dim(), dtype=p.dtype, device=p.device)
            for p in params
        ]
        return (x, *tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *grads: torch.Tensor) -> Any:
        if ctx.bucket.serial == ctx.serial:  # consumed: a later use must make new tokens
            ctx.bucket.tokens = None
        return (grad, None, *_sum_flat(list(grads), ctx.bucket.group))


def _sum_flat(grads: list[torch.Tensor], group: ProcessGroup | None) -> list[torch.Tensor]:
    """`grads` summed over `group`, one all-reduce per dtype present."""
    out = list(grads)
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, g in enumerate(grads):
        kinds.setdefault((g.dtype, g.device), []).append(i)
    for where in kinds.values():
        flat = torch.cat([grads[i].reshape(-1) for i in where])
        all_reduce(flat, group=group, tag=TAG)
        for i, part in zip(where, flat.split([grads[i].numel() for i in where]), strict=True):
            out[i] = part.view_as(grads[i])
    return out


class _Use(torch.autograd.Function):
    """The parameter itself; its gradient goes to the bucket's token (summed there)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return param

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class _SumNow(torch.autograd.Function):
    """The parameter itself; backward sums its gradient over the group alone (a use outside
    its owner's forward)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return param

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(total, group=ctx.group, tag=TAG)
        return total, None
