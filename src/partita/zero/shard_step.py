"""The optimizer step shared by the sharded stages (1, 2 and 3).

Each rank holds fp32 master shards with their gradient shards. The global gradient norm is the
square root of the sum over ranks of each rank's sum of squares (one scalar all-reduce, so
every rank reaches the same overflow and clipping decision).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from partita import comm
from partita.offload.copy_back import CopyBack
from partita.optim.cpu_adam import CPUAdam, CPUAdamW, Slice, copy_after_step
from partita.zero.strategy import StepOutcome

COPY_SLICE_NUMEL = 1 << 22
"""Most elements stepped before their copy back starts (16 MiB of fp32 masters): sub-groups
(``sub_group_size``, 1e9 by default as in DeepSpeed) are cut into slices of at most this size,
so copying one slice to the device overlaps stepping the next even with the default."""


def global_norm(
    norms: Sequence[torch.Tensor], group: comm.ProcessGroup | None, comm_device: torch.device
) -> tuple[torch.Tensor, float]:
    """The global norm from this rank's per-tensor norms: one scalar all-reduce of the sum of
    squares. Returns it as a tensor (for clipping) and as a float (inf/nan: overflow)."""
    # The sum of squares is taken where the shards live (the CPU under offload; both places
    # under partial offload) and reduced where the backend can reach (NCCL needs a device
    # tensor).
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in norms:
        by_device.setdefault(n.device, []).append(n)
    parts = [torch.stack(ns).square().sum().to(comm_device) for ns in by_device.values()]
    sq = (
        torch.stack(parts).sum()
        if len(parts) > 1
        else (parts[0] if parts else torch.zeros((), device=comm_device))
    )
    comm.all_reduce(sq, group=group, tag="norm")
    norm = sq.sqrt()
    return norm, float(norm)


@record_function("partita::step")
def sharded_step(
    masters: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    clip: float,
    loss_scale: float,
    group: comm.ProcessGroup | None,
    comm_device: torch.device,
    run: Callable[[], None] | None = None,
) -> StepOutcome:
    """Unscale, global norm, overflow check, clip and step (the caller refreshes weights);
    ``run`` replaces ``optimizer.step()`` (e.g. `step_with_copy_back`). A ``partita::step``
    range in a torch profiler trace."""
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
    if run is None:
        optimizer.step()
    else:
        run()
    return StepOutcome(applied=True, grad_norm=norm_value)


def slice_plan(
    masters: Sequence[torch.Tensor],
    targets: Sequence[Sequence[tuple[int, torch.Tensor]]],
    max_numel: int,
) -> tuple[list[list[Slice]], list[list[torch.Tensor]]]:
    """Sub-groups of at most ``max_numel`` elements (cut at multiples of 16, where the update
    of a tile equals that of the whole) over each master, and the weights each slice goes to.

    ``targets[i]`` lists (offset in master i, weights view) pairs covering master i; a slice
    never spans two views. Returns the plan for `CPUAdamW.step_slices` and the `CopyBack`
    targets, sub-group by sub-group."""
    step = max(16, max_numel // 16 * 16)
    plan: list[list[Slice]] = []
    dsts: list[list[torch.Tensor]] = []
    for master, pieces in zip(masters, targets, strict=True):
        n = master.numel()
        if n == 0:
            continue
        spans = sorted((offset, offset + view.numel()) for offset, view in pieces)
        if [a for a, _ in spans] != [0] + [b for _, b in spans[:-1]] or spans[-1][1] != n:
            raise ValueError(f"slice_plan: targets {spans} do not cover the master's {n} elements")
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            plan.append([])
            dsts.append([])
            for offset, view in pieces:
                a, b = max(lo, offset), min(hi, offset + view.numel())
                if a < b:
                    plan[-1].append(Slice(master, a, b))
                    dsts[-1].append(view[a - offset : b - offset])
    return plan, dsts


def step_with_copy_back(
    optimizer: torch.optim.Optimizer, plan: Sequence[Sequence[Slice]], sink: CopyBack
) -> None:
    """Steps every master and writes the plan's slices into the sink's targets, each
    sub-group's copy overlapping the next one's step where the optimizer can step in slices
    (partita's CPU Adam); otherwise a whole step, then the copies."""
    sink.begin()
    if isinstance(optimizer, CPUAdamW | CPUAdam):
        optimizer.step_slices(plan, sink)
    else:
        optimizer.step()
        copy_after_step(plan, sink)
    sink.finish()


@dataclass(frozen=True)
class HostStep:
    """`step_with_copy_back` bound to a strategy's optimizer, plan and sink: the ``run`` of
    `sharded_step` for masters in host memory."""

    optimizer: torch.optim.Optimizer
    plan: list[list[Slice]]
    sink: CopyBack

    def __call__(self) -> None:
        step_with_copy_back(self.optimizer, self.plan, self.sink)


def host_step(
    optimizer: torch.optim.Optimizer,
    masters: Sequence[torch.Tensor],
    targets: Sequence[Sequence[tuple[int, torch.Tensor]]],
    sub_group_size: int,
) -> HostStep:
    """The `HostStep` writing ``masters`` into ``targets`` (see `slice_plan`) in slices of at
    most ``sub_group_size`` and `COPY_SLICE_NUMEL` elements."""
    plan, dsts = slice_plan(masters, targets, min(sub_group_size, COPY_SLICE_NUMEL))
    return HostStep(optimizer, plan, CopyBack(dsts))
