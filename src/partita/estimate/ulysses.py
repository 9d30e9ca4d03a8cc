"""One rank's forward under Ulysses sequence parallelism, for tracing its activations.

[Note: a rank's activations under Ulysses]
With ``sequence_parallel_size`` = sp, each rank of a sequence group runs the whole model on its
slice of S/sp tokens, all heads, except inside attention: there an all-to-all trades the slice
for whole sequences of h/sp heads (``partita.parallel.ulysses``, [Note: Ulysses attention]).
So what scales with the sequence splits in two:

- everything position-wise (embeddings, norms, the projections, the MLP, the logits and the
  loss, the query/key/value and the attention output, which the all-to-alls only reshape:
  b x S x h x d / sp elements on either side) is what the model saves at S/sp tokens;
- the attention core's own tensors (eager attention's score and probability matrices, b x h x
  S x S, and SDPA's math path, which is what tracing on fake tensors sees) hold h/sp heads of the
  whole sequence: S^2/sp per rank, not (S/sp)^2. A fused kernel (flash or memory-efficient
  SDPA, what GPUs run) keeps no scores: counted as `fused_attention` (``--attention fused``),
  attention's memory is position-wise too.

Rather than add those up by formula, the rank is traced: the model runs at S/sp tokens with its
attention function replaced by `_RankAttention`, which turns query, key and value into the
shapes the all-to-all gives (``[b, h/sp, S, d]``, key/value heads repeated as Ulysses repeats
them), runs the model's own attention on them, and turns the output back. The all-to-alls are
autograd functions that save nothing (as partita's do), so what is counted is what the real
rank saves. The attention mask is dropped, as partita's Ulysses drops it (the core is causal by
itself). Not modelled: the all-to-all's send/receive buffers (transient, one layer's q, k, v at
a time). Sequence-tiled MLP and loss are ``tiled.py``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from partita.estimate.units import EstimateError

__all__ = [
    "ATTENTION",
    "all_to_all_bytes",
    "check_sequence_parallel",
    "fused_attention",
    "rank_attention",
]

_KEY = "partita_estimate_ulysses"
"""The attention implementation name the traced model is switched to while tracing."""


def check_sequence_parallel(config: Any, sp: int, world: int | None = None) -> None:
    """Refuses a ``sequence_parallel_size`` the model or the ranks cannot split, naming the
    key and the sizes: sp must divide `world` and the query heads, and the key/value heads
    must divide by sp or divide it (Ulysses then repeats them)."""
    if sp < 1:
        raise EstimateError(f"sequence_parallel_size {sp} must be >= 1")
    if world is not None and world % sp:
        raise EstimateError(
            f"sequence_parallel_size {sp} does not divide the {world} ranks "
            "(sequence groups are sp consecutive ranks)"
        )
    if config is None or sp == 1:
        return
    heads, kv = _heads(config)
    from partita.parallel.ulysses import check_heads

    try:
        check_heads(heads, kv, sp)
    except ValueError as error:
        raise EstimateError(f"sequence_parallel_size {sp}: {error}") from None


def all_to_all_bytes(config: Any, micro_batch: int, seq_len: int, sp: int, dtype_bytes: int) -> int:
    """Bytes of one forward's Ulysses all-to-alls on one rank, every layer, as partita's
    counters record them (each rank's whole ``[b, h, S/sp, d]`` block; (sp - 1)/sp of it
    crosses a link): query, key, value and the output per layer, key/value with their heads
    repeated to sp when fewer ([Note: Ulysses attention]). Backward sends as much again."""
    if sp == 1:
        return 0
    heads, kv = _heads(config)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not layers or not hidden:
        raise EstimateError(
            f"{type(config).__name__} names neither num_hidden_layers nor hidden_size"
        )
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_sent = kv if kv % sp == 0 else sp  # fewer than sp: repeated to sp (check_heads)
    per_token = (2 * heads + 2 * kv_sent) * head_dim * dtype_bytes
    return int(layers) * per_token * micro_batch * seq_len // sp


def _heads(config: Any) -> tuple[int, int]:
    """(query heads, key/value heads) of a Hugging Face config."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not heads:
        raise EstimateError(
            f"sequence_parallel_size needs the model's head count; {type(config).__name__} "
            "has no num_attention_heads"
        )
    kv = getattr(config, "num_key_value_heads", None) or heads
    return int(heads), int(kv)


class _FakeAllToAll(torch.autograd.Function):
    """An all-to-all's shapes and memory, without its values: a new tensor of `shape`; its
    backward a new tensor of the input's. Saves nothing for backward, as partita's does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.shape_in = x.shape
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.new_empty(ctx.shape_in), None


class _FusedAttention(torch.autograd.Function):
    """A fused attention kernel's memory (flash or memory-efficient SDPA, flash-attn): it
    saves its inputs, its output and a float32 log-sum-exp per query row, never the
    ``[b, h, S, S]`` scores; grouped key/value heads are read as they are (not repeated)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, s, _ = q.shape
        # [b, h, s, d] over [b, s, h, d] memory, as the kernels return it: the caller's
        # transpose back is then contiguous already, one storage with what is saved here.
        out = q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)
        lse = q.new_empty((b, h, s), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return grad.new_empty(q.shape), grad.new_empty(k.shape), grad.new_empty(v.shape)


def fused_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: Any, *args: Any, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """An attention function (Transformers' signature) with `_FusedAttention`'s memory,
    returning ``[b, s, h, d]`` as Transformers' SDPA function does."""
    return _FusedAttention.apply(query, key, value).transpose(1, 2).contiguous(), None


class _RankAttention:
    """The attention function of one Ulysses rank ([Note: a rank's activations under Ulysses]):
    ``[b, h, S/sp, d]`` query, key, value in, ``[b, S/sp, h, d]`` output out, the model's own
    attention (`core`, or its module's ``eager_attention_forward``) run on h/sp heads of S."""

    def __init__(self, sp: int, core: Any) -> None:
        self.sp = sp
        self.core = core

    def __call__(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: Any, *args: Any, **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:  # fmt: skip
        from partita.parallel.ulysses import check_heads

        sp = self.sp
        core = self.core or sys.modules[type(module).__module__].eager_attention_forward
        if sp == 1:  # no all-to-all: the core alone
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        b, h, s, _ = query.shape
        repeat = check_heads(h, key.shape[1], sp)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        q, k, v = (
            _FakeAllToAll.apply(t, (b, t.shape[1] // sp, s * sp, t.shape[3]))
            for t in (query, key, value)
        )
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            kwargs.pop("position_ids", None)
            out, weights = core(module, q, k, v, None, *args, **kwargs)  # [b, S, h/sp, d]
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        return _FakeAllToAll.apply(out, (b, s, h, out.shape[-1])), weights


ATTENTION = ("traced", "fused")
"""How attention's memory is counted: "traced", what the model's own attention function saves
on fake tensors (eager: the scores; SDPA: its math path, which also keeps the scores, as the
fused kernels are not chosen on fake tensors); "fused", a fused kernel's (`fused_attention`:
what flash or memory-efficient SDPA keep on GPUs, and CPU's fused SDPA)."""


@contextmanager
def rank_attention(model: torch.nn.Module, sp: int, attention: str = "traced") -> Iterator[None]:
    """While open, `model` (a Hugging Face model using Transformers' attention interface) runs
    as one rank of a Ulysses group of `sp`: its attention sees h/sp heads of sp times the
    tokens it is given, and counts its memory as `attention` says (`ATTENTION`). sp 1 with
    "traced" changes nothing."""
    if attention not in ATTENTION:
        raise EstimateError(f"attention {attention!r} must be one of {', '.join(ATTENTION)}")
    if sp == 1 and attention == "traced":
        yield
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config: Any = model.config
    given = config._attn_implementation_internal
    impl = given or "eager"
    core = None if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
    if attention == "fused":
        core = fused_attention
    ALL_ATTENTION_FUNCTIONS[_KEY] = _RankAttention(sp, core)
    ALL_MASK_ATTENTION_FUNCTIONS[_KEY] = ALL_MASK_ATTENTION_FUNCTIONS[impl]
    config._attn_implementation_internal = _KEY
    try:
        yield
    finally:
        config._attn_implementation_internal = given
        del ALL_ATTENTION_FUNCTIONS[_KEY]
        del ALL_MASK_ATTENTION_FUNCTIONS[_KEY]
