"""What a sharded parameter holds while its full value is elsewhere."""

from __future__ import annotations

import torch


def nan_placeholder(
    param: torch.Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """A zero-memory tensor of `param`'s shape whose every element is NaN: reads outside a
    gather give NaN instead of plausible numbers, and in-place writes fail (every element
    aliases one memory location)."""
    value = torch.full((), float("nan"), dtype=dtype or param.dtype, device=device or param.device)
    return value.expand(param.shape)
