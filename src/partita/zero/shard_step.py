"""The optimizer step shared by the sharded stages (1, 2 and 3).

Each rank holds fp32 master shards with their gradient shards. The global gradient norm is the
square root of the sum over ranks of each rank's sum of squares (one scalar all-reduce, so
every rank reaches the same overflow and clipping decision).

[Note: norms over tensor ranks]
With tensor parallelism (an mpu whose model is split over tensor ranks, see
`partita.comm.ParallelDims`) a data-parallel group holds only one tensor rank's slices, so its
sum of squares is part of the model's: it is all-reduced over the data-parallel group, then
over the tensor-parallel group (DeepSpeed's ``clip_grad_norm_`` does the same over its
``mpu.get_model_parallel_group()``). Parameters that every tensor rank holds whole (LayerNorms,
the bias after a row-parallel layer: those without a true ``tensor_model_parallel`` or
``model_parallel`` attribute) have the same gradient on every tensor rank and count once, on
tensor rank 0, as DeepSpeed counts them. Elsewhere their squares are multiplied by zero rather
than left out, so that an inf or nan among them still reaches the sum (inf * 0 is nan) and
every rank of every tensor and data group skips the step. `TensorParallelNorm` carries the
group and which elements of each stepped tensor are replicated; without tensor parallelism it
is None and the norm is computed exactly as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from partita import comm
from partita.offload.copy_back import CopyBack
from partita.optim.cpu_adam import CPUAdam, CPUAdamW, Slice, copy_after_step
from partita.zero.state_access import StateLayout
from partita.zero.strategy import StepOutcome

COPY_SLICE_NUMEL = 1 << 22
"""Most elements stepped before their copy back starts (16 MiB of fp32 masters): sub-groups
(``sub_group_size``, 1e9 by default as in DeepSpeed) are cut into slices of at most this size,
so copying one slice to the device overlaps stepping the next even with the default."""


@dataclass(frozen=True, eq=False)
class TensorParallelNorm:
    """What the global gradient norm needs besides the data-parallel group when the model is
    split over tensor-parallel ranks ([Note: norms over tensor ranks])."""

    group: comm.ProcessGroup | None
    """The tensor-parallel group (None: every rank)."""
    counts_replicated: bool
    """True on tensor rank 0, the one rank whose replicated parameters' squares count."""
    replicated: tuple[torch.Tensor, ...]
    """The module's parameters that every tensor rank holds whole."""
    runs: Mapping[torch.Tensor, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """Made by `bind`: per tensor the optimizer steps, the (offset, length) runs of its
    flattened elements that belong to replicated parameters, ascending."""

    def bind(self, layout: StateLayout) -> TensorParallelNorm:
        """This norm with the runs of a strategy's state layout (where each parameter's
        elements sit in the tensors it steps); built once, with the strategy."""
        runs: dict[torch.Tensor, list[tuple[int, int]]] = {}
        for p in self.replicated:
            slot = layout.slot(p)
            if slot is not None and slot.stepped is not None:
                runs.setdefault(slot.stepped, []).extend((at, n) for _, at, n in slot.ranges)
        return dataclasses.replace(self, runs={t: tuple(sorted(r)) for t, r in runs.items()})

    def cut(
        self, stepped: torch.Tensor, grad: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`grad` (the gradient of `stepped`) as 1-D views: the elements of tensor-parallel
        parameters (and padding), then those of replicated parameters."""
        flat = grad.reshape(-1)
        split: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        at = 0
        for start, length in self.runs.get(stepped, ()):
            if start > at:
                split.append(flat[at:start])
            replicated.append(flat[start : start + length])
            at = start + length
        if at < flat.numel():
            split.append(flat[at:])
        return split, replicated

    def split(
        self, stepped: Iterable[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`cut` of every tensor's ``.grad`` (those with one), concatenated."""
        split: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        for t in stepped:
            if t.grad is not None:
                a, b = self.cut(t, t.grad)
                split += a
                replicated += b
        return split, replicated

    def squares(self, split: torch.Tensor, replicated: torch.Tensor) -> torch.Tensor:
        """This rank's share of the model's sum of squares, from those of its split and its
        replicated elements (see the Note for the product with zero)."""
        return split + replicated * (1.0 if self.counts_replicated else 0.0)


def tensor_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm (one fused kernel); none for none."""
    return list(torch._foreach_norm(tensors, 2.0)) if tensors else []


def sum_of_squares(norms: Sequence[torch.Tensor], comm_device: torch.device) -> torch.Tensor:
    """The sum of the squares of `norms`, on `comm_device` (zero for none)."""
    # The sum of squares is taken where the shards live (the CPU under offload; both places
    # under partial offload) and reduced where the backend can reach (NCCL needs a device
    # tensor).
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in norms:
        by_device.setdefault(n.device, []).append(n)
    parts = [torch.stack(ns).square().sum().to(comm_device) for ns in by_device.values()]
    return (
        torch.stack(parts).sum()
        if len(parts) > 1
        else (parts[0] if parts else torch.zeros((), device=comm_device))
    )


def global_norm(
    norms: Sequence[torch.Tensor],
    group: comm.ProcessGroup | None,
    comm_device: torch.device,
    tensor: TensorParallelNorm | None = None,
    replicated: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, float]:
    """The global norm from this rank's per-tensor norms: one scalar all-reduce of the sum of
    squares over the data-parallel `group`. With `tensor`, `norms` are those of the split
    elements and `replicated` those of the replicated ones, and a second all-reduce runs over
    the tensor group ([Note: norms over tensor ranks]). Returns the norm as a tensor (for
    clipping) and as a float (inf/nan: overflow)."""
    sq = sum_of_squares(norms, comm_device)
    if tensor is not None:
        sq = tensor.squares(sq, sum_of_squares(replicated, comm_device))
    comm.all_reduce(sq, group=group, tag="norm")
    if tensor is not None:
        comm.all_reduce(sq, group=tensor.group, tag="norm")
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
    tensor: TensorParallelNorm | None = None,
) -> StepOutcome:
    """Unscale, global norm (also over the tensor ranks with `tensor`), overflow check, clip
    and step (the caller refreshes weights); ``run`` replaces ``optimizer.step()`` (e.g.
    `step_with_copy_back`). A ``partita::step`` range in a torch profiler trace."""
    grads: list[torch.Tensor] = [m.grad for m in masters if m.grad is not None]
    if loss_scale != 1.0 and grads:
        torch._foreach_mul_(grads, 1.0 / loss_scale)
    if tensor is None:
        norm, norm_value = global_norm(tensor_norms(grads), group, comm_device)
    else:
        split, replicated = tensor.split(masters)
        norm, norm_value = global_norm(
            tensor_norms(split), group, comm_device, tensor, tensor_norms(replicated)
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
