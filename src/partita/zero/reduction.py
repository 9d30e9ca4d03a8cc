"""Data-parallel gradient reduction, one reducer for every stage: `GradReducer` starts each
reduction (an all-reduce, a reduce-scatter, or qgZ's quantized pair of hops), keeps at most a
bounded number of them in flight and delivers each result where its stage keeps gradients;
`ReduceScaling` says how the sum is averaged. What collects gradients into the buffers it
reduces is the stage's: bucket arrival counters for stages 0-2
(`partita.zero.sharded_grads.ShardedGradients`), a unit's backward for stage 3
(`partita.zero.stage3.grads.UnitGradReducer`).

[Note: bucket buffers and gradient views]
At stages 0 and 1 every trainable parameter's ``.grad`` is a view into one flat bucket buffer, so
autograd accumulates straight into the buffer and the reduction reads every gradient in it with
no copy in. Buckets hold parameters in reverse registration order, which is close to the order
gradients become ready in backward. A post-accumulate-grad hook per parameter counts arrivals;
when a bucket is complete its reduction starts asynchronously while backward continues. Buckets
are launched strictly in a fixed order on every rank (a complete bucket waits for its
predecessors), so collectives pair up across ranks even if gradient arrival order differs.
Whatever did not complete is launched at the end of backward (parameters unused this step still
carry their zeroed slice). If something replaced a ``.grad`` with a fresh tensor (e.g.
``optimizer.zero_grad(set_to_none=True)``), the hook copies it back into the view and
reinstates the view.

A bucket's buffer exists only from the first gradient that reaches it after a step until the
next release ([Note: released gradients]): the hook of that gradient makes the buffer (zeroed),
copies the gradient in and points every parameter of the bucket at its view, so the others
accumulate into it directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from partita import comm
from partita.offload.host_adds import HostAdds
from partita.zero.buffer_pool import BufferPool

Collective = Literal["all_reduce", "reduce_scatter"]


@dataclass(frozen=True)
class ReduceScaling:
    """How gradients are averaged, following DeepSpeed's ``prescale_gradients`` and
    ``gradient_predivide_factor``: divide by the factor before the sum and by
    world_size/factor after it (or by world_size before, when prescaling). With ``average``
    False (``gradient_allreduce_op: "sum"``) the plain sum: neither divides, as in DeepSpeed."""

    world_size: int
    prescale: bool = False
    predivide_factor: float = 1.0
    average: bool = True

    @property
    def before(self) -> float:
        """Multiplier applied before the all-reduce."""
        if not self.average:
            return 1.0
        if self.prescale:
            return 1.0 / self.world_size
        return 1.0 / self.predivide_factor

    @property
    def after(self) -> float:
        """Multiplier applied after the all-reduce."""
        if not self.average:
            return 1.0
        if self.prescale:
            return 1.0
        return self.predivide_factor / self.world_size


Start = Callable[[torch.Tensor, torch.Tensor, Any, Any], Any]
"""Starts reducing (output chunk, input, process group, key) and returns its handle: qgZ's
quantized hops in place of one reduce-scatter (`partita.zero.stage3.qgz`)."""


@dataclass
class _InFlight:
    data: torch.Tensor
    """The buffer reduced (an all-reduce's result goes back into it)."""
    sent: torch.Tensor
    """What the collective reads: `data` itself or a converted copy."""
    output: torch.Tensor
    handle: comm.Work | None
    deliver: Callable[[torch.Tensor], None] | None
    release: torch.Tensor | None
    numel: int
    before_wait: Callable[[], None] | None


class GradReducer:
    """Gradient reductions in flight, in launch order, parameterised by their collective.

    ``reduce_scatter``: each rank's chunk of the sum (summed across `replicas` too, under
    hybrid sharding) is scaled and handed to the launch's `deliver`, usually an add into a
    gradient shard (`add`, which defers host adds under optimizer offload). ``all_reduce``:
    the scaled sum goes back into the reduced buffer itself, which is the gradients' home.
    At most `max_in_flight` reductions, and at most `max_in_flight_numel` elements (one
    reduction always may), are alive; a launch first retires the oldest beyond that. `pool`
    lends the stages their transient buffers, which a launch's `release` returns."""

    def __init__(
        self,
        scaling: ReduceScaling,
        reduce_dtype: torch.dtype,
        collective: Collective,
        max_in_flight: int,
        pool_keep: int,
        max_in_flight_numel: int | None = None,
        replicas: comm.ProcessGroup | None = None,
        start: Start | None = None,
    ) -> None:
        assert collective == "reduce_scatter" or (replicas is None and start is None)
        self.scaling = scaling
        self.reduce_dtype = reduce_dtype
        self.collective = collective
        self.max_in_flight = max_in_flight
        self.max_in_flight_numel = max_in_flight_numel
        self.replicas = replicas
        """Hybrid sharding: the ranks holding the same shards, across which each reduced chunk
        is summed before it is scaled ([Note: hybrid sharding] in `partita.comm.dims`)."""
        self.start = start
        self.pool = BufferPool(keep=pool_keep)
        self.host_adds = HostAdds()
        self._in_flight: deque[_InFlight] = deque()
        self._in_flight_numel = 0
        self.peak_in_flight_numel = 0
        """Most gradient elements in flight at once."""

    @property
    def busy(self) -> bool:
        """Whether any reduction is in flight."""
        return bool(self._in_flight)

    def make_room(self, numel: int) -> None:
        """Retires the oldest reductions until one of `numel` more elements may start."""
        while self._in_flight and self._full(numel):
            self._retire(self._in_flight.popleft())

    def _full(self, numel: int) -> bool:
        if len(self._in_flight) >= self.max_in_flight:
            return True
        limit = self.max_in_flight_numel
        return limit is not None and self._in_flight_numel + numel > limit

    def launch(
        self,
        data: torch.Tensor,
        group: comm.ProcessGroup | None,
        deliver: Callable[[torch.Tensor], None] | None = None,
        release: torch.Tensor | None = None,
        key: Any = None,
        before_wait: Callable[[], None] | None = None,
    ) -> None:
        """Starts reducing `data` over `group`. `deliver` takes this rank's scaled chunk
        (reduce-scatter); `release` goes back to the pool once the reduction is over;
        `before_wait` runs just before its handle is waited for; `key` names it to `start`."""
        numel = data.numel()
        self.make_room(numel)
        before = self.scaling.before
        if self.collective == "all_reduce":  # in place: the buffer is the gradients' home
            sent = data if data.dtype == self.reduce_dtype else data.to(self.reduce_dtype)
            if before != 1.0:
                sent.mul_(before)
            handle = comm.all_reduce(sent, group=group, async_op=True, tag="grad")
            output = sent
        else:
            sent = data
            if data.dtype != self.reduce_dtype or before != 1.0:
                sent = data.to(self.reduce_dtype, copy=True).mul_(before)
            world = comm.get_world_size(group)
            output = torch.empty(numel // world, dtype=self.reduce_dtype, device=data.device)
            if self.start is not None:
                handle = self.start(output, sent, group, key)
            else:
                handle = comm.reduce_scatter(output, sent, group=group, async_op=True, tag="grad")
        self._in_flight.append(
            _InFlight(data, sent, output, handle, deliver, release, numel, before_wait)
        )
        self._in_flight_numel += numel
        self.peak_in_flight_numel = max(self.peak_in_flight_numel, self._in_flight_numel)

    def _retire(self, job: _InFlight) -> None:
        self._in_flight_numel -= job.numel
        if job.before_wait is not None:
            job.before_wait()
        if job.handle is not None:
            job.handle.wait()
        out = job.output
        if self.collective == "all_reduce":
            if job.sent is not job.data:  # sent in another dtype: the sum back into the buffer
                job.data.copy_(job.sent)
            out = job.data
        elif self.replicas is not None:
            # Each replica reduced its own ranks' gradients: the sum over replicas makes the
            # sum over the whole data-parallel world, scaled below by its size.
            comm.all_reduce(out, group=self.replicas, tag="grad")
        if self.scaling.after != 1.0:
            out.mul_(self.scaling.after)
        if job.deliver is not None:
            job.deliver(out)
        if job.release is not None:
            self.pool.release(job.release)

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst += src``, deferred while a device-to-host copy lands (optimizer offload)."""
        self.host_adds.add(dst, src)

    def finish(self) -> None:
        """Waits for every reduction, delivering each, and applies the deferred adds."""
        while self._in_flight:
            self._retire(self._in_flight.popleft())
        self.host_adds.drain()

    def pass_zeros(
        self, numel: int, device: torch.device, group: comm.ProcessGroup | None
    ) -> list[comm.Work]:
        """Issues the collectives of a reduction of `numel` zeros over `group`, changing no
        state (a rank leaving the divergence check's window: [Note: identity windows]).
        Returns the handles to wait for."""
        assert self.collective == "reduce_scatter"
        data = torch.zeros(numel, dtype=self.reduce_dtype, device=device)
        world = comm.get_world_size(group)
        out = torch.empty(numel // world, dtype=self.reduce_dtype, device=device)
        if self.start is not None:
            handle = self.start(out, data, group, None)
        else:
            handle = comm.reduce_scatter(out, data, group=group, async_op=True, tag="grad")
        if self.replicas is not None:  # its peers' retire sums across the replicas next
            if handle is not None:
                handle.wait()
            handle = comm.all_reduce(out, group=self.replicas, async_op=True, tag="grad")
        return [] if handle is None else [handle]
