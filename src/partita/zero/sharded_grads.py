"""Bucketed gradient reduce-scatter for ZeRO stages 1 and 2.

[Note: reduction units]
Each optimizer parameter group has a `FlatLayout` whose segments are gradient buckets in
readiness order (reverse registration order within the group). A *unit* is one segment: when
every gradient in it is ready, one reduce-scatter sums it over ranks and leaves each rank its
equal chunk, which is added into the rank's fp32 gradient shard. Units launch strictly in a fixed
order (by when their last gradient is expected), the same on every rank, so collectives pair up
even if gradients arrive in another order; a complete unit waits for its predecessors.

Stage 1 keeps full gradients in a persistent flat buffer (``.grad`` are views into it, as in
stage 0) and reduces only during the boundary backward. Stage 2 copies each gradient into its
unit's transient buffer as soon as it is ready and frees ``.grad``; at most `max_in_flight`
units are alive at once, so full gradients never exist beyond that working set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from partita import comm
from partita.partition import FlatLayout, Segment
from partita.zero.buffer_pool import BufferPool
from partita.zero.grad_buckets import ReduceScaling


@dataclass
class Unit:
    """One segment of one group's layout, reduced with one reduce-scatter."""

    group: int
    segment: Segment
    params: list[torch.nn.Parameter]
    offsets: list[int]
    views: list[torch.Tensor] = field(default_factory=list)
    """Stage 1: each parameter's gradient view into the persistent flat buffer (set-up once)."""
    """Offset of each parameter inside the segment."""
    pending: int = 0
    buffer: torch.Tensor | None = None
    adopted: bool = False
    """True when `buffer` is a parameter's own gradient taken over without a copy (stage 2, a
    unit of one parameter that fills its segment): it is dropped after the reduction instead of
    going back to the pool."""
    sent: torch.Tensor | None = None
    """What the reduce-scatter reads: the buffer itself or a converted copy of it."""
    output: torch.Tensor | None = None
    handle: comm.Work | None = None


@dataclass
class ShardedGradients:
    """Owns gradient buffers and reduce-scatters for the groups of a ZeRO-1/2 strategy."""

    layouts: list[FlatLayout]
    params: list[list[torch.nn.Parameter]]
    shard_grads: list[torch.Tensor]
    persistent: bool
    """True for stage 1 (full gradients kept until the boundary), False for stage 2."""
    scaling: ReduceScaling
    reduce_dtype: torch.dtype
    rank: int
    max_in_flight: int = 2
    group: comm.ProcessGroup | None = None
    units: list[Unit] = field(init=False, default_factory=list)
    flat_grads: list[torch.Tensor | None] = field(init=False, default_factory=list)
    armed: bool = field(init=False, default=False)
    peak_transient_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._unit_of: dict[torch.nn.Parameter, tuple[Unit, int]] = {}
        self._build_units()
        self._next = 0
        self._in_flight: list[Unit] = []
        self._pool = BufferPool(keep=self.max_in_flight + 1)
        hooks = [
            p.register_post_accumulate_grad_hook(self._on_ready) for g in self.params for p in g
        ]
        self._hooks = hooks

    def _build_units(self) -> None:
        order = {p: i for i, p in enumerate(reversed([p for g in self.params for p in g]))}
        for gi, (layout, params) in enumerate(zip(self.layouts, self.params, strict=True)):
            device, dtype = params[0].device, params[0].dtype
            flat = (
                torch.zeros(layout.padded_numel, dtype=dtype, device=device)
                if self.persistent
                else None
            )
            self.flat_grads.append(flat)
            for seg in layout.segments:
                members = [params[i] for i in seg.indices]
                offsets = [off - seg.flat_start for off in seg.offsets]
                unit = Unit(gi, seg, members, offsets)
                self.units.append(unit)
                for j, p in enumerate(members):
                    self._unit_of[p] = (unit, j)
                    if flat is not None:
                        start = seg.offsets[j]
                        unit.views.append(flat[start : start + p.numel()].view_as(p))
                        p.grad = unit.views[-1]
        # Expected completion order: when a unit's last gradient should arrive in backward.
        self.units.sort(key=lambda u: max((order[p] for p in u.params), default=-1))

    @property
    def persistent_bytes(self) -> int:
        """Bytes of stage 1's full gradient buffers (0 for stage 2)."""
        return sum(f.numel() * f.element_size() for f in self.flat_grads if f is not None)

    def begin_backward(self, armed: bool) -> None:
        """Arms the reduction for the coming backward."""
        self.armed = armed
        self._next = 0
        for u in self.units:
            u.pending = len(u.params)

    def _on_ready(self, p: torch.Tensor) -> None:
        unit, j = self._unit_of[p]  # type: ignore[index]
        if self.persistent:
            self._keep_view(p, unit, j)
        elif p.grad is not None:
            if unit.buffer is None and self._can_adopt(unit, p.grad):
                # A gradient that fills its whole segment is reduced from its own storage, as
                # DeepSpeed reduces gradients larger than a bucket: copying it would hold two
                # of the largest gradient (a vocabulary embedding) at once.
                unit.buffer, unit.adopted = p.grad.detach().view(-1), True
            else:
                if unit.buffer is None:
                    unit.buffer = self._new_buffer(unit, p.grad.dtype)
                off = unit.offsets[j]
                unit.buffer[off : off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        if not self.armed:
            return
        unit.pending -= 1
        if unit.pending == 0:
            self._launch_ready()

    @staticmethod
    def _keep_view(p: torch.Tensor, unit: Unit, j: int) -> None:
        """Reinstates the gradient view if something replaced ``.grad`` (e.g. zero_grad)."""
        view = unit.views[j]
        if p.grad is None or p.grad.data_ptr() != view.data_ptr():
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    @staticmethod
    def _can_adopt(unit: Unit, grad: torch.Tensor) -> bool:
        """Whether `grad` can serve as `unit`'s buffer as it is: the unit's only parameter, the
        segment's whole length (no padding), contiguous. (A copied buffer would take the
        gradient's dtype too.)"""
        return (
            len(unit.params) == 1
            and grad.is_contiguous()
            and grad.numel() == unit.segment.padded_numel
        )

    def _new_buffer(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        buf = self._pool.acquire(unit.segment.padded_numel, dtype, unit.params[0].device)
        self.peak_transient_bytes = self._pool.peak_bytes
        return buf

    def _launch_ready(self) -> None:
        while self._next < len(self.units) and self.units[self._next].pending == 0:
            self._launch(self.units[self._next])
            self._next += 1

    def _launch(self, unit: Unit) -> None:
        seg = unit.segment
        if seg.padded_numel == 0:
            return
        while len(self._in_flight) >= self.max_in_flight:
            self._retire(self._in_flight.pop(0))
        if self.persistent:
            flat = self.flat_grads[unit.group]
            assert flat is not None
            data = flat[seg.flat_start : seg.flat_end]
        else:
            if unit.buffer is None:  # no gradient arrived (unused parameters): reduce zeros
                unit.buffer = self._new_buffer(unit, unit.params[0].dtype)
            data = unit.buffer
        if data.dtype != self.reduce_dtype or self.scaling.before != 1.0:
            data = data.to(self.reduce_dtype, copy=True).mul_(self.scaling.before)
        unit.sent = data
        unit.output = torch.empty(seg.chunk_numel, dtype=self.reduce_dtype, device=data.device)
        unit.handle = comm.reduce_scatter(
            unit.output, data, group=self.group, async_op=True, tag="grad"
        )
        self._in_flight.append(unit)

    def _retire(self, unit: Unit) -> None:
        if unit.handle is not None:
            unit.handle.wait()
        out = unit.output
        assert out is not None
        if self.scaling.after != 1.0:
            out.mul_(self.scaling.after)
        seg = unit.segment
        dst = self.shard_grads[unit.group][seg.shard_offset : seg.shard_offset + seg.chunk_numel]
        dst.add_(out.to(dst.device, non_blocking=True))  # a host copy under optimizer offload
        if unit.buffer is not None and not unit.adopted:
            self._pool.release(unit.buffer)
        unit.buffer = unit.sent = unit.output = unit.handle = None
        unit.adopted = False

    def end_backward(self) -> None:
        """Launches units that did not complete (in order) and retires all reductions."""
        if not self.armed:
            return
        for unit in self.units[self._next :]:
            unit.pending = 0
        self._launch_ready()
        while self._in_flight:
            self._retire(self._in_flight.pop(0))
        self.armed = False

    def zero_(self) -> None:
        """Zeroes full (stage 1) and sharded gradients."""
        for flat in self.flat_grads:
            if flat is not None:
                flat.zero_()
        for g in self.shard_grads:
            g.zero_()
        for unit in self.units:
            for j, p in enumerate(unit.params):
                if self.persistent:
                    self._keep_view(p, unit, j)
                else:
                    p.grad = None

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
