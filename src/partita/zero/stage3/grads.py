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
from functools import partial
from typing import Any

import torch

from partita import comm
from partita.zero.reduction import GradReducer, ReduceScaling
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
    core: GradReducer = field(init=False)
    """The reductions in flight and the buffer pool (one reducer for every stage)."""

    def __post_init__(self) -> None:
        start = None
        if self.quantized is not None:
            groups = self.quantized

            def start(out: torch.Tensor, data: torch.Tensor, group: Any, key: Any) -> Any:
                del group  # qgZ's hops run over its node groups
                return quantized_reduce_scatter(out, data, groups, key)

        self.core = GradReducer(
            self.scaling, self.reduce_dtype, "reduce_scatter", self.max_in_flight,
            pool_keep=POOL_KEEP, max_in_flight_numel=self.max_in_flight_numel,
            replicas=self.replicas, start=start,
        )  # fmt: skip

    @property
    def peak_in_flight_numel(self) -> int:
        """Most gradient elements in flight in reduce-scatters at once."""
        return self.core.peak_in_flight_numel

    @property
    def peak_buffer_bytes(self) -> int:
        """Most bytes of gradient buffers alive at once."""
        return self.core.pool.peak_bytes

    @property
    def held_buffer_bytes(self) -> int:
        """Bytes of gradient buffers now, lent out or free in the pool (none between steps)."""
        return self.core.pool.held_bytes

    def drop_free(self) -> None:
        """Lets go of the pool's free gradient buffers (after a step: [Note: released
        gradients])."""
        self.core.pool.drop_free()

    def accumulate(self, unit: ShardedUnit, index: int, grad: torch.Tensor) -> None:
        """Adds parameter `index`'s gradient into the unit's flat gradient buffer (the first
        gradient of a parameter is copied: the buffer is not zeroed up front, see `_fill_holes`)."""
        if unit.grad_buffer is None:
            unit.grad_buffer = self.core.pool.acquire(
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
            unit.grad_buffer = self.core.pool.acquire(
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
            unit.grad_buffer = self.core.pool.acquire(
                unit.layout.padded_numel, unit.flat_shard.dtype, unit.flat_full.device
            )
        else:
            self._fill_holes(unit, unit.grad_buffer)
        buffer = unit.grad_buffer
        unit.grad_buffer = None
        flush = None
        if unit.divergence is not None:  # see [Note: asynchronous identities]
            flush = partial(unit.divergence.flush, ticket)
        segs = [(i, unit.layout.segments[i]) for i in unit.masters]
        segs = [(i, seg) for i, seg in segs if seg.padded_numel]
        if not segs:
            self.core.pool.release(buffer)
        for n, (idx, seg) in enumerate(segs):
            self.core.launch(
                buffer[seg.flat_start : seg.flat_end],
                unit.process_group,
                partial(self._deliver, unit, idx),
                release=buffer if n == len(segs) - 1 else None,
                key=(id(unit), idx),
                before_wait=flush,
            )

    def _deliver(self, unit: ShardedUnit, seg: int, chunk: torch.Tensor) -> None:
        """A finished reduction: into the NVMe sink, or added into the master's gradient (a
        host copy under offload)."""
        if self.sink is not None:
            self.sink(unit, seg, chunk)
        else:
            self.core.add(ensure_grad(unit.masters[seg]), chunk)

    def pass_reduce(self, unit: ShardedUnit) -> list[comm.Work]:
        """Issues the collectives of `unit`'s reduce-scatter with zeros, changing no state: a
        rank that leaves the divergence check's window issues those its peers expect ([Note:
        identity windows]). Returns the handles to wait for."""
        works: list[comm.Work] = []
        for idx in unit.masters:
            seg = unit.layout.segments[idx]
            if seg.padded_numel:
                works += self.core.pass_zeros(
                    seg.padded_numel, unit.flat_full.device, unit.process_group
                )
        return works

    def step_skipped(self) -> None:
        """A step was skipped (overflow): qgZ's error feedback drops its residuals, which came
        from the discarded gradients ([Note: qgZ error feedback])."""
        if self.quantized is not None and self.quantized.feedback is not None:
            self.quantized.feedback.clear()

    def finish(self) -> None:
        """Waits for every reduction and adds the results into the master gradients."""
        if self.core.busy:
            with trace("finish_reduce_scatter"):
                self.core.finish()
        else:
            self.core.host_adds.drain()
