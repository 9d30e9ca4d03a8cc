"""Gradient norm, overflow detection and scaling over lists of tensors (foreach kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradStats:
    """Squared L2 norm of a set of gradients, as a 0-dim fp32 tensor (no host sync yet)."""

    sq_norm: torch.Tensor


def grad_stats(grads: list[torch.Tensor]) -> GradStats:
    """Sum of squares of `grads` in fp32 (float64 for float64 gradients); inf/nan anywhere
    makes it non-finite.

    Squares are summed rather than norms combined, so shards on different ranks can add their
    partial sums with one all-reduce and reach the same total as one process would.
    """
    if not grads:
        return GradStats(torch.zeros((), dtype=torch.float32))
    norms = torch._foreach_norm(grads, 2.0)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    stacked = torch.stack([n.to(dtype) for n in norms])
    return GradStats(torch.sum(stacked * stacked))


def scale_grads_(grads: list[torch.Tensor], factor: float) -> None:
    """Multiplies every gradient in place (a no-op for factor 1.0)."""
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)
