"""The optimizer step shared by the sharded stages (1, 2 and 3).

Each rank holds fp32 master shards with their gradient shards. The global gradient norm is the
square root of the sum over ranks of each rank's sum of squares (one scalar all-reduce, so
every rank reaches the same overflow and clipping decision).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from partita import comm
from partita.zero.strategy import StepOutcome


def global_norm(
    norms: Sequence[torch.Tensor], group: comm.ProcessGroup | None, comm_device: torch.device
) -> tuple[torch.Tensor, float]:
    """The global norm from this rank's per-tensor norms: one scalar all-reduce of the sum of
    squares. Returns it as a tensor (for clipping) and as a float (inf/nan: overflow)."""
    sq = torch.stack(list(norms)).square().sum() if norms else torch.zeros(())
    # The norm is computed where the shards live (the CPU under offload) and reduced where the
    # backend can reach (NCCL needs a device tensor).
    sq = sq.to(comm_device)
    comm.all_reduce(sq, group=group, tag="norm")
    norm = sq.sqrt()
    return norm, float(norm)


def sharded_step(
    masters: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    clip: float,
    loss_scale: float,
    group: comm.ProcessGroup | None,
    comm_device: torch.device,
) -> StepOutcome:
    """Unscale, global norm, overflow check, clip and step (the caller refreshes weights)."""
    grads: list[torch.Tensor] = [m.grad for m in masters if m.grad is not None]
    if loss_scale != 1.0 and grads:
        torch._foreach_mul_(grads, 1.0 / loss_scale)
    norm, norm_value = global_norm(
        list(torch._foreach_norm(grads, 2.0)) if grads else [], group, comm_device
    )
    if not math.isfinite(norm_value):
        return StepOutcome(applied=False, grad_norm=norm_value)
    if clip > 0.0:
        torch.nn.utils.clip_grads_with_norm_(list(masters), clip, norm.to(grads[0].device))
    optimizer.step()
    return StepOutcome(applied=True, grad_norm=norm_value)
