"""Tiled computation that trades recomputation or extra kernel launches for memory.

- `TiledLinear` / `TiledLinearReturnBias` (`partita.tiling.linear`): a linear layer stored as
  tiles, so that ZeRO-3 gathers one tile's weight at a time.
- `TiledMLP`, `sequence_tiled_compute`, `TiledFusedLogitsLoss` (`partita.tiling.sequence`):
  position-wise computation over slices of the sequence (ALST), so one slice's activations, or
  one slice's logits, are alive at a time.
"""

from partita.tiling.linear import TiledLinear, TiledLinearReturnBias
from partita.tiling.sequence import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledLinear",
    "TiledLinearReturnBias",
    "TiledMLP",
    "sequence_tiled_compute",
]
