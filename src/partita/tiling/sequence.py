"""Sequence-tiled compute (ALST): run a position-wise computation over slices of the sequence so
that only one slice's intermediate activations are alive at a time.

- `TiledMLP`: an MLP over sequence shards; forward keeps only its input, backward recomputes
  one shard at a time.
- `sequence_tiled_compute` (`SequenceTiledCompute`): the same for any function of keyword
  tensors sharded on dimension 1, with an optional mean or sum of the outputs.
- `TiledFusedLogitsLoss`: the LM head and the loss over sequence shards; the whole logits tensor
  ``[tokens, vocab]`` never exists. Like `TiledMLP` it recomputes in backward, unlike DeepSpeed
  ([Note: the tiled loss recomputes in backward]).

[Note: parameter gradients of a tiled computation]
Each shard's backward gives a gradient to every parameter the function used. Handing the shards'
gradients one by one to ``.grad`` would run a parameter's post-accumulate hook once per shard,
and ZeRO's hooks (partita's, as DeepSpeed's) count a hook as "this parameter's gradient is
complete" and start its reduction. DeepSpeed answers with a flag on each parameter
(``ds_grad_is_ready``) set from the caller's `compute_params`; partita needs neither: each shard's
gradients are taken with `torch.autograd.grad` for the shard's input and for every leaf tensor
that requires a gradient in the shard's graph (found by walking it: no list to forget), summed
here across shards, and handed to autograd once, in the backward pass, by one
`torch.autograd.backward` on those leaves. Every hook then runs once with the full gradient, as
after an untiled backward (tested with partita's ZeRO 0, 2 and 3), and with gradient
accumulation intact (``.grad`` is added to, never replaced). `compute_params` is accepted for
DeepSpeed's signature and not needed. The price: the summed gradients of the function's
parameters live until the end of the tiled backward (a parameter-sized buffer each, what
``.grad`` holds anyway after an untiled backward).

Inputs other than the one that is sharded for gradients must not be non-leaf tensors that need a
gradient: their gradient would have to flow into the caller's graph, which a tiled computation
does not return (DeepSpeed returns None for them); that is refused by name rather than dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "sequence_tiled_compute",
    "shard_bounds",
]


def shard_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each non-empty shard of `length` items cut into `shards` pieces of
    ``ceil(length / shards)`` (the last shorter): `torch.chunk`'s cut, so fewer than `shards`
    pieces when the steps run out early (10 items in 4 shards: 3, 3, 3, 1; 5 in 4: 2, 2, 1)."""
    count = None if isinstance(shards, bool) else getattr(shards, "__index__", None)
    if count is None or count() < 1:
        raise ValueError(f"tiled compute: shards={shards!r}, expected an int of at least 1")
    shards = count()
    if length == 0:
        return [(0, 0)]
    step = math.ceil(length / shards)
    return [(a, min(a + step, length)) for a in range(0, length, step)]


# --- parameter gradients ([Note: parameter gradients of a tiled computation]) ----------------


def graph_leaves(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (those with an ``AccumulateGrad`` node) that `roots`' graph reaches, in
    a fixed order (depth-first from the roots), each once."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack: list[Any] = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.setdefault(id(variable), variable)
            continue
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return list(leaves.values())


class LeafGrads:
    """Gradients of leaf tensors summed across shards, handed to autograd once (`deliver`)."""

    def __init__(self) -> None:
        self._grads: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}

    def add(self, leaf: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Adds `grad` to `leaf`'s sum (in place once the sum is a buffer of ours: the first
        gradient may alias a tensor autograd handed back, so it is not written to)."""
        if grad is None:
            return
        held = self._grads.get(id(leaf))
        if held is None:
            self._grads[id(leaf)] = (leaf, grad, False)
        elif held[2]:
            held[1].add_(grad)
        else:
            self._grads[id(leaf)] = (leaf, held[1] + grad, True)

    def tensors(self) -> list[torch.Tensor]:
        """The summed gradients, in the order the leaves were first seen."""
        return [g for _, g, _ in self._grads.values()]

    def deliver(self, scale: torch.Tensor | None = None) -> None:
        """Accumulates each sum (times `scale`) into its leaf's ``.grad`` through autograd, so
        post-accumulate hooks run once per leaf; forgets the sums."""
        if not self._grads:
            return
        leaves = [leaf for leaf, _, _ in self._grads.values()]
        grads = self.tensors() if scale is None else [g * scale for g in self.tensors()]
        self._grads.clear()
        torch.autograd.backward(leaves, grads)


def shard_backward(
    output: torch.Tensor,
    grad_output: torch.Tensor,
    grad_input: torch.Tensor | None,
    sums: LeafGrads,
) -> torch.Tensor | None:
    """Backward of one shard's `output`: returns the gradient of `grad_input` (a leaf made for
    this shard, or None) and adds every other leaf's gradient to `sums`."""
    if output.grad_fn is None:
        return None if grad_input is None else torch.zeros_like(grad_input)
    leaves = [t for t in graph_leaves([output]) if t is not grad_input and t.requires_grad]
    inputs = ([grad_input] if grad_input is not None else []) + leaves
    if not inputs:
        return None
    grads = torch.autograd.grad(output, inputs, grad_output, allow_unused=True)
    for leaf, grad in zip(leaves, grads[len(inputs) - len(leaves) :], strict=True):
        sums.add(leaf, grad)
    if grad_input is None:
        return None
    return torch.zeros_like(grad_input) if grads[0] is None else grads[0]


def shard_leaf(x: torch.Tensor, index: tuple[Any, ...], requires_grad: bool) -> torch.Tensor:
    """A contiguous copy of ``x[index]`` that is a leaf of its own, needing a gradient when
    `requires_grad`: the shard's graph starts here and never reaches the caller's."""
    return x[index].detach().contiguous().requires_grad_(requires_grad)


def check_passed_tensor(where: str, value: Any) -> None:
    """Refuses a non-leaf tensor that needs a gradient where none is returned (see the module
    docstring); leaves get theirs through `LeafGrads`."""
    if isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is not None:
        raise ValueError(
            f"tiled compute: {where} needs a gradient and is computed from other tensors; a "
            "tiled computation returns a gradient only for its sharded input (pass it as that "
            "input, or detach it)"
        )


# --- TiledMLP ------------------------------------------------------------------------------


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, module, x, shards, compute_params)``: ``fn(module, x)`` computed
    over `shards` slices of `x`'s second-to-last dimension (the sequence; ``[..., seq, hidden]``)
    and concatenated. `fn` must treat each position on its own (an MLP does), so the result
    equals ``fn(module, x)`` up to the rounding of smaller matrix products.

    Memory: forward runs the shards without a graph and keeps only `x`; backward recomputes one
    shard at a time with its graph, so the intermediate activations alive at once are one
    shard's (an MLP of width ``I`` on ``S`` tokens keeps ``S / shards`` tokens' ``I``-wide
    intermediates instead of ``S``). `fn` runs twice per step (three times under activation
    checkpointing). Parameter gradients: [Note: parameter gradients of a tiled computation];
    `compute_params` may be None."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        module: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Any = None,
    ) -> torch.Tensor:
        del compute_params  # see [Note: parameter gradients of a tiled computation]
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [..., seq, hidden], got shape {tuple(x.shape)}")
        bounds = shard_bounds(x.shape[-2], shards)
        ctx.fn, ctx.module, ctx.bounds = fn, module, bounds
        ctx.save_for_backward(x)
        outs = [fn(module, x[..., a:b, :]) for a, b in bounds]
        return torch.cat(outs, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        needs_x = bool(ctx.needs_input_grad[2])
        x_grad = torch.empty_like(x, memory_format=torch.contiguous_format) if needs_x else None
        sums = LeafGrads()
        for a, b in ctx.bounds:
            index = (..., slice(a, b), slice(None))
            x_shard = shard_leaf(x, index, needs_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, x_shard)
            g = shard_backward(out, grad_output[index], x_shard if needs_x else None, sums)
            if x_grad is not None:
                x_grad[index].copy_(g)  # type: ignore[arg-type]
            del out
        sums.deliver()
        return None, None, x_grad, None, None


# --- sequence_tiled_compute ------------------------------------------------------------------

_REDUCTIONS = (None, "mean", "sum")


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, Any],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Any = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """``fn(**shard, **kwargs_to_pass)`` over `shards` slices of dimension 1 (``[batch, seqlen,
    ...]``) of every tensor in `kwargs_to_shard`, recomputed shard by shard in backward like
    `TiledMLP`. The shards' outputs are concatenated along `output_unshard_dimension` (0:
    stacked, for one scalar per shard such as a loss), then reduced by `output_reduction`
    (None: the concatenation; ``"mean"`` or ``"sum"``: of all its elements, so with 0 the mean
    of the shards' values, which is the tokens' mean only when the shards are equal). The
    gradient is returned for ``kwargs_to_shard[grad_requiring_tensor_key]``; parameters and
    other leaf tensors `fn` uses get theirs as in [Note: parameter gradients of a tiled
    computation] (`compute_params` may be None). Shards past the end of the sequence (when
    ``ceil(seqlen / shards)`` steps run out early) are not run. Bad arguments raise ValueError
    naming them."""
    del compute_params  # see [Note: parameter gradients of a tiled computation]
    if output_reduction not in _REDUCTIONS:
        raise ValueError(
            f"sequence_tiled_compute: output_reduction={output_reduction!r}, expected one of "
            f"{_REDUCTIONS}"
        )
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"sequence_tiled_compute: grad_requiring_tensor_key={grad_requiring_tensor_key!r} "
            f"is not among kwargs_to_shard's keys {sorted(kwargs_to_shard)}"
        )
    for key, value in kwargs_to_shard.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"sequence_tiled_compute: kwargs_to_shard[{key!r}] must be a tensor "
                f"[batch, seqlen={seqlen}, ...], got {shape}"
            )
        if key != grad_requiring_tensor_key:
            check_passed_tensor(f"kwargs_to_shard[{key!r}]", value)
    for key, value in kwargs_to_pass.items():
        check_passed_tensor(f"kwargs_to_pass[{key!r}]", value)
    spec = _TiledSpec(
        fn, shard_bounds(seqlen, shards), list(kwargs_to_shard), list(kwargs_to_pass),
        grad_requiring_tensor_key, output_unshard_dimension,
    )  # fmt: skip
    output = SequenceTiledCompute.apply(spec, *kwargs_to_shard.values(), *kwargs_to_pass.values())
    if output_reduction == "mean":
        return output.mean()  # reductions outside the Function: autograd gets their exact grads
    if output_reduction == "sum":
        return output.sum()
    return output


class _TiledSpec:
    """What `SequenceTiledCompute` needs besides the tensors."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        bounds: list[tuple[int, int]],
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_key: str,
        out_dim: int,
    ) -> None:
        self.fn, self.bounds, self.out_dim = fn, bounds, out_dim
        self.keys_to_shard, self.keys_to_pass, self.grad_key = keys_to_shard, keys_to_pass, grad_key

    def call(self, shard: int, args: Sequence[Any], grad_leaf: torch.Tensor | None) -> Any:
        """`fn` on shard `shard` of `args` (the sharded values, then the passed ones); the
        gradient-requiring value is `grad_leaf` when given."""
        a, b = self.bounds[shard]
        n = len(self.keys_to_shard)
        kwargs = {k: v[:, a:b] for k, v in zip(self.keys_to_shard, args[:n], strict=True)}
        if grad_leaf is not None:
            kwargs[self.grad_key] = grad_leaf
        kwargs.update(zip(self.keys_to_pass, args[n:], strict=True))
        return self.fn(**kwargs)


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function under `sequence_tiled_compute` (which validates and reduces):
    ``apply(spec, *sharded_values, *passed_values)`` returns the shards' outputs
    concatenated (or stacked, for dimension 0)."""

    @staticmethod
    def forward(ctx: Any, spec: _TiledSpec, *args: Any) -> torch.Tensor:
        outs = [spec.call(i, args, None) for i in range(len(spec.bounds))]
        ctx.spec, ctx.args = spec, args
        ctx.grad_index = spec.keys_to_shard.index(spec.grad_key)
        ctx.out_sizes = [1 if spec.out_dim == 0 else o.shape[spec.out_dim] for o in outs]
        # The sharded input stays alive through ctx.args (it is the caller's tensor);
        # save_for_backward adds the version check that makes in-place changes to it an error.
        ctx.save_for_backward(args[ctx.grad_index])
        if spec.out_dim == 0:
            return torch.stack(outs, dim=0)
        return torch.cat(outs, dim=spec.out_dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        spec: _TiledSpec = ctx.spec
        (x,) = ctx.saved_tensors
        needs_x = bool(ctx.needs_input_grad[1 + ctx.grad_index])
        x_grad = torch.empty_like(x, memory_format=torch.contiguous_format) if needs_x else None
        sums, offset = LeafGrads(), 0
        for i, (a, b) in enumerate(spec.bounds):
            index = (slice(None), slice(a, b))
            leaf = shard_leaf(x, index, needs_x)
            with torch.enable_grad():
                out = spec.call(i, ctx.args, leaf)
            size = ctx.out_sizes[i]
            if spec.out_dim == 0:
                grad = grad_output[i]
            else:
                grad = grad_output.narrow(spec.out_dim, offset, size)
            offset += size
            g = shard_backward(out, grad, leaf if needs_x else None, sums)
            if x_grad is not None:
                x_grad[index].copy_(g)  # type: ignore[arg-type]
            del out
        sums.deliver()
        grads: list[Any] = [None] * len(ctx.args)
        grads[ctx.grad_index] = x_grad
        return (None, *grads)


# --- TiledFusedLogitsLoss --------------------------------------------------------------------


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params,
    output_reduction)``: ``fn(module, x_shard, y_shard[, mask_shard])`` (the LM head and the
    loss of a shard, a scalar) over `shards` slices of the flattened ``[batch * seq]`` tokens of
    `x` (``[batch, seq, hidden]``), `y` (``[batch, seq, ...]``) and `mask` (``[batch, seq]`` or
    None, then not passed), reduced by ``"mean"`` (of the shards' losses: the tokens' mean only
    when the shards hold equal counts of counted tokens; otherwise use ``"sum"`` and divide
    yourself) or ``"sum"``.

    Memory: one shard's logits exist at a time, in forward (no graph) and in backward (one
    shard's graph, freed before the next), and the whole ``[tokens, vocab]`` never does; what
    is kept between them is `x` (and `y`, `mask`).

    [Note: the tiled loss recomputes in backward]
    DeepSpeed runs each shard's backward inside forward and keeps the input's gradient, so the
    LM head runs once; its parameters' gradients then reach ``.grad`` during forward, with an
    incoming gradient of 1: gradient-accumulation division and fp16 loss scaling, which arrive
    as the incoming gradient of backward, never reach them (only the input's gradient is
    multiplied), and ZeRO-3's backward hooks fire outside backward. partita runs the head
    twice instead (forward without a graph, then shard by shard in backward, as `TiledMLP`):
    each gradient is the incoming gradient's and the parameters get theirs in the backward
    pass, once ([Note: parameter gradients of a tiled computation]). The cost is one more
    forward of the head per step. Bad shapes or reduction raise ValueError naming them."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        module: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Any = None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        del compute_params  # see [Note: parameter gradients of a tiled computation]
        _check_loss_inputs(x, y, mask, output_reduction)
        bounds = shard_bounds(x.shape[0] * x.shape[1], shards)
        ctx.fn, ctx.module, ctx.bounds = fn, module, bounds
        ctx.weight = 1.0 / len(bounds) if output_reduction == "mean" else 1.0
        ctx.save_for_backward(x, y, mask)
        rows, targets, masks = _token_rows(x, y, mask)
        losses = [_shard_loss(fn, module, rows, targets, masks, a, b) for a, b in bounds]
        stacked = torch.stack(losses)
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        x, y, mask = ctx.saved_tensors
        rows, targets, masks = _token_rows(x, y, mask)
        needs_x = bool(ctx.needs_input_grad[2])
        x_grad = torch.empty_like(rows) if needs_x else None
        sums = LeafGrads()
        for a, b in ctx.bounds:
            leaf = shard_leaf(rows, (slice(a, b),), needs_x)
            with torch.enable_grad():
                loss = _shard_loss(ctx.fn, ctx.module, leaf, targets, masks, a, b, whole=False)
            g = shard_backward(loss, grad_output * ctx.weight, leaf if needs_x else None, sums)
            if x_grad is not None:
                x_grad[a:b].copy_(g)  # type: ignore[arg-type]
            del loss
        sums.deliver()
        x_grad = None if x_grad is None else x_grad.view(x.shape)
        return None, None, x_grad, None, None, None, None, None


def _token_rows(
    x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`x`, `y`, `mask` with batch and sequence flattened into one token dimension."""
    masks = None if mask is None else mask.reshape(-1)
    return x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:]), masks


def _shard_loss(
    fn: Callable[..., torch.Tensor],
    module: Any,
    rows: torch.Tensor,
    targets: torch.Tensor,
    masks: torch.Tensor | None,
    a: int,
    b: int,
    whole: bool = True,
) -> torch.Tensor:
    """`fn` on tokens ``a:b`` (`rows` is all tokens when `whole`, else already the shard)."""
    x = rows[a:b] if whole else rows
    args = (module, x, targets[a:b]) + (() if masks is None else (masks[a:b],))
    loss = fn(*args)
    if loss.dim() != 0:
        raise ValueError(
            f"TiledFusedLogitsLoss: fn must return a scalar loss, got shape {tuple(loss.shape)}"
        )
    return loss


def _check_loss_inputs(
    x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, output_reduction: str
) -> None:
    if output_reduction not in ("mean", "sum"):
        raise ValueError(
            f"TiledFusedLogitsLoss: output_reduction={output_reduction!r}, expected 'mean' or 'sum'"
        )
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(
            "TiledFusedLogitsLoss: x and y must be at least [batch, seq], got shapes "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(
            f"TiledFusedLogitsLoss: x's [batch, seq] {tuple(x.shape[:2])} differs from y's "
            f"{tuple(y.shape[:2])}"
        )
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"TiledFusedLogitsLoss: mask must be [batch, seq] = {tuple(x.shape[:2])}, got "
            f"{tuple(mask.shape)}"
        )
