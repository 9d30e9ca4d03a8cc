"""Sequence-tiled MLP and loss (ALST, `partita.tiling`) in the activation trace.

[Note: tiled compute in the estimate]
With ``--tiled_mlp T`` every block's MLP runs as `partita.tiling.TiledMLP` over shards of at
most T tokens, and with ``--tiled_loss T`` the LM head and the loss run as
`partita.tiling.TiledFusedLogitsLoss` over shards of at most T tokens. The trace runs partita's
own functions, so what forward keeps is theirs: the MLP's input, the head's input and the
labels, not the MLP's intermediates or the logits. Their backward recomputes one shard at a
time. What it holds at once is its input's whole gradient (allocated before the first shard)
and one shard's saved tensors with the gradient and a temporary of their largest (the rule
`ActivationProfile.peak` applies to the whole forward), traced on one shard of T tokens, the
most a shard holds. That is `ActivationProfile.recompute`, the backward's transient when it is
larger than the loss's. The shard counts follow the rank's tokens (ceil(tokens / T)), so only
the input's gradient grows with the sequence; below T tokens the shard's part is an upper
bound. Not counted: the recompute's FLOPs in ``partita plan`` (the MLP's forward runs once
more per step, the head's too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from partita.estimate.activations import trace_activations
from partita.estimate.units import EstimateError

__all__ = ["Tiling", "shard_transient", "tiled_loss", "tiled_mlps"]


@dataclass(frozen=True)
class Tiling:
    """Which computations are tiled, and the most tokens one shard holds (None: not tiled)."""

    mlp_tokens: int | None = None
    loss_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("mlp_tokens", "loss_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EstimateError(f"tiled {name} {value} must be >= 1")

    @property
    def any(self) -> bool:
        """True when something is tiled."""
        return self.mlp_tokens is not None or self.loss_tokens is not None


def _mlps(blocks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    mlps = [getattr(b, "mlp", None) for b in blocks]
    if not blocks or any(m is None for m in mlps):
        raise EstimateError(
            "--tiled_mlp: the model's blocks have no 'mlp' module to tile "
            f"({type(blocks[0]).__name__ if blocks else 'no blocks'})"
        )
    return [m for m in mlps if m is not None]


def _plain(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(module).forward(module, x)


@contextmanager
def tiled_mlps(blocks: Sequence[torch.nn.Module], tokens: int) -> Iterator[None]:
    """While open, each block's ``mlp`` runs as `TiledMLP` over shards of at most `tokens`."""
    from partita.tiling import TiledMLP

    mlps = _mlps(blocks)

    def forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def tiled(x: torch.Tensor) -> torch.Tensor:
            shards = max(1, math.ceil(x.shape[-2] / tokens))
            return TiledMLP.apply(_plain, module, x, shards, None)

        return tiled

    for m in mlps:
        m.forward = forward(m)
    try:
        yield
    finally:
        for m in mlps:
            del m.forward


def _head_loss(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One shard's LM head and cross-entropy (the logits in float32, as Transformers' loss)."""
    return torch.nn.functional.cross_entropy(head(x).float(), y)


def tiled_loss(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """`model`'s loss on `ids` with the LM head and the loss as `TiledFusedLogitsLoss` over
    shards of at most `tokens` (the base model run as usual)."""
    from partita.tiling import TiledFusedLogitsLoss

    base, head = _parts(model)
    hidden = base(input_ids=ids).last_hidden_state
    shards = max(1, math.ceil(ids.numel() / tokens))
    return TiledFusedLogitsLoss.apply(_head_loss, head, hidden, ids, None, shards, None, "mean")


def _parts(model: torch.nn.Module) -> tuple[Any, torch.nn.Module]:
    base = getattr(model, "base_model", None)
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if base is None or base is model or head is None:
        raise EstimateError(
            f"--tiled_loss: {type(model).__name__} has no base model and LM head to tile"
        )
    return base, head


def shard_transient(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module],
    tiling: Tiling,
    micro_batch: int,
    local: int,
    hidden: int,
) -> int:
    """The most one tiled backward holds at once at `local` tokens per rank: its input's whole
    gradient (allocated before the first shard) and one shard's saved tensors with the gradient
    and a temporary of its largest; of the MLP (``[micro_batch, T, hidden]``) or of the head
    and loss (T token rows), whichever is larger; 0 when nothing is tiled."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    out = 0
    dtype = next(model.parameters()).dtype
    per_value = torch.empty((), dtype=dtype).element_size()
    whole = micro_batch * local * hidden * per_value
    if tiling.mlp_tokens is not None:
        mlp = _mlps(blocks)[0]
        shape = (micro_batch, tiling.mlp_tokens, hidden)

        def run_mlp(m: torch.nn.Module) -> Any:
            with FakeTensorMode(allow_non_fake_inputs=True):
                x = torch.zeros(shape, dtype=dtype, device="meta", requires_grad=True)
                return _plain(m, x)

        out = max(out, whole + trace_activations(mlp, run_mlp).peak(False))
    if tiling.loss_tokens is not None:
        _, head = _parts(model)
        rows, width = tiling.loss_tokens, getattr(head, "in_features", hidden)

        def run_loss(m: torch.nn.Module) -> Any:
            with FakeTensorMode(allow_non_fake_inputs=True):
                x = torch.zeros((rows, width), dtype=dtype, device="meta", requires_grad=True)
                y = torch.zeros((rows,), dtype=torch.long, device="meta")
                return _head_loss(m, x, y)

        whole = micro_batch * local * width * per_value
        out = max(out, whole + trace_activations(head, run_loss).peak(False))
    return out
