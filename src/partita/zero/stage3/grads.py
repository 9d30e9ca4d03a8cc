"""Gradient reduce-scatter for ZeRO-3 units.

As soon as a parameter's gradient is accumulated it is copied into its unit's transient flat
gradient buffer and ``.grad`` is freed. When the unit's backward is over (`reduce`), each
trainable segment is reduce-scattered asynchronously; finished reductions (`retire`) add this
rank's chunk into the fp32 master gradient (made, zeroed, by the first one after a step: [Note:
released gradients]). At most `max_in_flight` reductions, and at most
`max_in_flight_numel` gradient elements (``reduce_bucket_size``; one segment always may), are
alive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from partita import comm
from partita.offload.host_adds import HostAdds
from partita.zero.buffer_pool import BufferPool
from partita.zero.grad_buckets import ReduceScaling
from partita.zero.released_grads import ensure_grad
from partita.zero.stage3.identity import REDUCE
from partita.zero.stage3.qgz import NodeGroups, quantized_reduce_scatter
from partita.zero.stage3.unit import ShardedUnit, trace

MAX_IN_FLIGHT = 4
"""Unit reduce-scatters alive at once by default (`UnitGradReducer.max_in_flight`); the
estimator's stage-3 moments count with it (`partita.estimate.stage3_moments`)."""
POOL_KEEP = 2
"""Freed unit gradient buffers the reducer's pool keeps for the next units."""


@dataclass
class _Pending:
    unit: ShardedUnit
    seg: int
    output: torch.Tensor
    handle: comm.Work | None
    release: torch.Tensor | None = None
    """The unit's gradient buffer, returned to the pool when this (its last) reduction ends."""
    numel: int = 0
    """Gradient elements this reduction reads (its segment, padded)."""
    ticket: int | None = None
    """The divergence check's ticket of the unit's reduce-scatter (None: verify all)."""


@dataclass
class UnitGradReducer:
    """Owns the transient gradient buffers and the reduce-scatters of all units."""

    scaling: ReduceScaling
    reduce_dtype: torch.dtype
    max_in_flight: int = MAX_IN_FLIGHT
    max_in_flight_numel: int | None = None
    """``reduce_bucket_size``: gradient elements in flight at once (at least one segment)."""
    sink: Callable[[ShardedUnit, int, torch.Tensor], None] | None = None
    """Where a finished reduction goes instead of ``master.grad.add_`` (NVMe-swapped grads)."""
    quantized: NodeGroups | None = None
    """qgZ: reduce in two quantized hops over these groups instead of one reduce-scatter over
    `group` ([Note: quantized gradient reduce-scatter])."""
    replicas: comm.ProcessGroup | None = None
    """Hybrid sharding: the ranks holding the same shard as this one, over which each reduced
    chunk is summed before it is scaled ([Note: hybrid sharding] in `partita.comm.dims`; None:
    no replicas)."""
    _in_flight: list[_Pending] = field(default_factory=list, init=False)
    _pool: BufferPool = field(default_factory=lambda: BufferPool(keep=POOL_KEEP), init=False)
    _host_adds: HostAdds = field(default_factory=HostAdds, init=False)
    """Adds into host-memory master gradients (optimizer offload), applied as copies land."""
    _in_flight_numel: int = field(default=0, init=False)
    peak_in_flight_numel: int = field(default=0, init=False)
    """Most gradient elements in flight in reduce-scatters at once."""

    @property
    def peak_buffer_bytes(self) -> int:
        """Most bytes of gradient buffers alive at once."""
        return self._pool.peak_bytes

    @property
    def held_buffer_bytes(self) -> int:
        """Bytes of gradient buffers now, lent out or free in the pool (none between steps)."""
        return self._pool.held_bytes

    def drop_free(self) -> None:
        """Lets go of the pool's free gradient buffers (after a step: [Note: released
        gradients])."""
        self._pool.drop_free()

    def accumulate(self, unit: ShardedUnit, index: int, grad: torch.Tensor) -> None:
        """Adds parameter `index`'s gradient into the unit's flat gradient buffer (the first
        gradient of a parameter is copied: the buffer is not zeroed up front, see `_fill_holes`)."""
        if unit.grad_buffer is None:
            unit.grad_buffer = self._pool.acquire(
                unit.layout.padded_numel, grad.dtype, grad.device, zero=False
            )
            unit.grad_written = set()
        written = unit.grad_written
        off = unit.layout.offsets[index]
        region = unit.grad_buffer[off : off + grad.numel()]
        if index in written:
            region.add_(grad.reshape(-1))
        else:
            region.copy_(grad.reshape(-1))
            written.add(index)

    def grad_region(self, unit: ShardedUnit, index: int, like: torch.Tensor) -> torch.Tensor:
        """Parameter `index`'s gradient in the unit's buffer as a view shaped like `like`
        (zeroed first when no gradient was written to it), for sums over other groups."""
        if unit.grad_buffer is None:
            unit.grad_buffer = self._pool.acquire(
                unit.layout.padded_numel, like.dtype, like.device, zero=False
            )
            unit.grad_written = set()
        off = unit.layout.offsets[index]
        region = unit.grad_buffer[off : off + like.numel()]
        if index not in unit.grad_written:
            region.zero_()
            unit.grad_written.add(index)
        return region.view_as(like)

    def _fill_holes(self, unit: ShardedUnit, buffer: torch.Tensor) -> None:
        """Zeroes what no gradient was written to: parameters without one this backward, and
        the layout's padding. Cheaper than zeroing the whole buffer before every backward."""
        written, unit.grad_written = unit.grad_written, set()
        spans = sorted(
            (unit.layout.offsets[i], unit.layout.offsets[i] + unit.layout.numels[i])
            for i in written
        )
        pos = 0
        for start, end in spans:
            if start > pos:
                buffer[pos:start].zero_()
            pos = max(pos, end)
        if pos < buffer.numel():
            buffer[pos:].zero_()

    def reduce(self, unit: ShardedUnit) -> None:
        """Starts the reduce-scatter of every trainable segment of `unit`."""
        if not unit.masters:
            return
        with trace("reduce_scatter", unit.name):
            self._launch(unit)

    def _launch(self, unit: ShardedUnit) -> None:
        ticket = None
        if unit.divergence is not None:  # same unit on every rank: [Note: rank divergence]
            ticket = unit.divergence.check(REDUCE, unit.index)
        if unit.grad_buffer is None:  # no gradient reached it: reduce zeros (collectives must pair)
            unit.grad_buffer = self._pool.acquire(
                unit.layout.padded_numel, unit.flat_shard.dtype, unit.flat_full.device
            )
        else:
            self._fill_holes(unit, unit.grad_buffer)
        buffer = unit.grad_buffer
        unit.grad_buffer = None
        launched: list[_Pending] = []
        for idx in unit.masters:
            seg = unit.layout.segments[idx]
            if seg.padded_numel == 0:
                continue
            while self._in_flight and self._full(seg.padded_numel):
                self._retire(self._in_flight.pop(0))
            data = buffer[seg.flat_start : seg.flat_end]
            if data.dtype != self.reduce_dtype or self.scaling.before != 1.0:
                data = data.to(self.reduce_dtype, copy=True).mul_(self.scaling.before)
            out = torch.empty(seg.chunk_numel, dtype=self.reduce_dtype, device=data.device)
            handle = self._start(out, data, unit.process_group, key=(id(unit), idx))
            launched.append(_Pending(unit, idx, out, handle, numel=seg.padded_numel, ticket=ticket))
            self._in_flight.append(launched[-1])
            self._in_flight_numel += seg.padded_numel
            self.peak_in_flight_numel = max(self.peak_in_flight_numel, self._in_flight_numel)
        if launched:
            launched[-1].release = buffer
        else:
            self._pool.release(buffer)

    def pass_reduce(self, unit: ShardedUnit) -> list[comm.Work]:
        """Issues the collectives of `unit`'s reduce-scatter with zeros, changing no state: a
        rank that leaves the divergence check's window issues those its peers expect ([Note:
        identity windows]). Returns the handles to wait for."""
        works: list[comm.Work] = []
        for idx in unit.masters:
            seg = unit.layout.segments[idx]
            if seg.padded_numel == 0:
                continue
            device = unit.flat_full.device
            data = torch.zeros(seg.padded_numel, dtype=self.reduce_dtype, device=device)
            out = torch.empty(seg.chunk_numel, dtype=self.reduce_dtype, device=device)
            handle = self._start(out, data, unit.process_group)
            if self.replicas is not None:  # its peers' retire sums across the replicas next
                if handle is not None:
                    handle.wait()
                handle = comm.all_reduce(out, group=self.replicas, async_op=True, tag="grad")
            if handle is not None:
                works.append(handle)
        return works

    def _start(
        self,
        out: torch.Tensor,
        data: torch.Tensor,
        group: comm.ProcessGroup | None,
        key: tuple[int, int] | None = None,
    ) -> Any:
        """Starts reducing `data` into this rank's chunk `out` over the unit's `group` (an
        expert unit's is its expert-data-parallel group): one reduce-scatter, or qgZ's two
        quantized hops, whose error feedback keeps its residual under `key` (the unit's
        identity and segment; None for a pass with zeros, which must leave no state)."""
        if self.quantized is not None:
            return quantized_reduce_scatter(out, data, self.quantized, key)
        return comm.reduce_scatter(out, data, group=group, async_op=True, tag="grad")

    def step_skipped(self) -> None:
        """A step was skipped (overflow): qgZ's error feedback drops its residuals, which came
        from the discarded gradients ([Note: qgZ error feedback])."""
        if self.quantized is not None and self.quantized.feedback is not None:
            self.quantized.feedback.clear()

    def _full(self, numel: int) -> bool:
        """Whether a reduction of `numel` more elements must wait for the oldest one."""
        if len(self._in_flight) >= self.max_in_flight:
            return True
        limit = self.max_in_flight_numel
        return limit is not None and self._in_flight_numel + numel > limit

    def _retire(self, pending: _Pending) -> None:
        self._in_flight_numel -= pending.numel
        if pending.unit.divergence is not None:  # see [Note: asynchronous identities]
            pending.unit.divergence.flush(pending.ticket)
        if pending.handle is not None:
            pending.handle.wait()
        out = pending.output
        if self.replicas is not None:
            # Each replica reduced its own shard group's gradients: the sum across replicas
            # makes the sum over every data-parallel rank, scaled below by its size.
            comm.all_reduce(out, group=self.replicas, tag="grad")
        if self.scaling.after != 1.0:
            out.mul_(self.scaling.after)
        if self.sink is not None:
            self.sink(pending.unit, pending.seg, out)
        else:
            grad = ensure_grad(pending.unit.masters[pending.seg])
            self._host_adds.add(grad, out)  # a host copy under offload
        if pending.release is not None:
            self._pool.release(pending.release)

    def finish(self) -> None:
        """Waits for every reduction and adds the results into the master gradients."""
        if self._in_flight:
            with trace("finish_reduce_scatter"):
                while self._in_flight:
                    self._retire(self._in_flight.pop(0))
        self._host_adds.drain()
