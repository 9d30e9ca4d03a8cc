"""Bucketed gradient reduction for ZeRO stages 0-2: reduce-scatter (stages 1-2) or all-reduce
(stage 0), one reducer parameterised by its collective.

[Note: gradient buckets of stages 1-2]
Each optimizer parameter group has a `FlatLayout` whose segments are gradient buckets in
readiness order (reverse registration order within the group). A `GradBucket` is one segment:
when every gradient in it is ready, one reduce-scatter sums it over ranks and leaves each rank
its equal chunk, which is added into the rank's fp32 gradient shard. Buckets launch strictly in a
fixed order (by when their last gradient is expected), the same on every rank, so collectives
pair up even if gradients arrive in another order; a complete bucket waits for its predecessors.
(Not ZeRO-3's *unit*, `partita.zero.stage3.unit.ShardedUnit`: parameters gathered together.)

Stage 1 keeps full gradients in one buffer per bucket (``.grad`` are views into it: [Note:
bucket buffers and gradient views] in `partita.zero.reduction`) until the step, and reduces
only during the boundary backward. Stage 0 does the same with an all-reduce
(``collective="all_reduce"``): the sum lands in the bucket's buffer itself, so ``.grad`` holds
the reduced gradient with no copy out; its layouts have no padding (one rank,
`stage0_layout`). Stage 2 copies each
gradient into its bucket's transient buffer as soon as it is ready and frees ``.grad``; at most
`max_in_flight` buckets are alive at once, so full gradients never exist beyond that working
set. Stage 1's buffers and both stages' fp32 gradient shards exist from the first backward after
a step until the step is over ([Note: released gradients]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from partita import comm
from partita.partition import FlatLayout, Segment, plan_buckets
from partita.zero.reduction import Collective, GradReducer, ReduceScaling

MAX_IN_FLIGHT = 2
"""Reduce-scatters in flight by default; the pool keeps one free buffer more than that
(`POOL_KEEP` at the default), so a steady backward allocates nothing. The estimator replays
both (``partita/estimate/backward.py``)."""
POOL_KEEP = MAX_IN_FLIGHT + 1


@dataclass
class GradBucket:
    """One segment of one group's layout, reduced with one reduce-scatter."""

    group: int
    segment: Segment
    params: list[torch.nn.Parameter]
    offsets: list[int]
    """Offset of each parameter inside the segment."""
    views: list[torch.Tensor] = field(default_factory=list)
    """Stage 1: each parameter's gradient view into `buffer` (empty while it is released)."""
    pending: int = 0
    buffer: torch.Tensor | None = None
    """Stage 1: the bucket's full gradients until the step; stage 2: the transient buffer."""
    adopted: bool = False
    """True when `buffer` is a parameter's own gradient taken over without a copy (stage 2, a
    bucket of one parameter that fills its segment): it is dropped after the reduction instead of
    going back to the pool."""
    held: bool = False
    """Reduced only by `flush_held` (see `ShardedGradients.hold`), not in each backward."""


@dataclass
class ShardedGradients:
    """Owns the gradient buckets of a ZeRO 0-2 strategy's groups: counts each bucket's
    arrivals and hands complete buckets, in order, to one `GradReducer`."""

    layouts: list[FlatLayout]
    params: list[list[torch.nn.Parameter]]
    shard_grad: Callable[[int], torch.Tensor] | None
    """Group i's fp32 gradient shard, made (zeroed) when it was released (None with
    ``all_reduce``: the sum stays in the buffer)."""
    persistent: bool
    """True for stage 1 (full gradients kept until the boundary), False for stage 2."""
    scaling: ReduceScaling
    reduce_dtype: torch.dtype
    rank: int
    max_in_flight: int = MAX_IN_FLIGHT
    group: comm.ProcessGroup | None = None
    replicas: comm.ProcessGroup | None = None
    """Hybrid sharding: the ranks holding the same shards, across which each reduced chunk is
    summed before it is scaled (None: no replicas; never the default group)."""
    group_of: list[comm.ProcessGroup | None] | None = None
    """Each parameter group's own process group, where it differs from `group` (expert
    groups: [Note: expert parallelism] in `partita.comm.dims`); None: `group` for all."""
    collective: Collective = "reduce_scatter"
    """"reduce_scatter" (stages 1-2: each rank's chunk goes into its gradient shard) or
    "all_reduce" (stage 0, `persistent`: the whole sum stays in the bucket's buffer)."""
    buckets: list[GradBucket] = field(init=False, default_factory=list)
    armed: bool = field(init=False, default=False)
    peak_transient_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._bucket_of: dict[torch.nn.Parameter, tuple[GradBucket, int]] = {}
        self._build_buckets()
        self._next = 0
        self.reducer = GradReducer(
            self.scaling, self.reduce_dtype, self.collective, self.max_in_flight,
            pool_keep=self.max_in_flight + 1, replicas=self.replicas,
        )  # fmt: skip
        hooks = [
            p.register_post_accumulate_grad_hook(self._on_ready) for g in self.params for p in g
        ]
        self._hooks = hooks

    def _build_buckets(self) -> None:
        order = {p: i for i, p in enumerate(reversed([p for g in self.params for p in g]))}
        for gi, (layout, params) in enumerate(zip(self.layouts, self.params, strict=True)):
            for seg in layout.segments:
                members = [params[i] for i in seg.indices]
                offsets = [off - seg.flat_start for off in seg.offsets]
                bucket = GradBucket(gi, seg, members, offsets)
                self.buckets.append(bucket)
                for j, p in enumerate(members):
                    self._bucket_of[p] = (bucket, j)
        # Expected completion order: when a bucket's last gradient should arrive in backward
        # (the launch order, the same on every rank: [Note: gradient buckets of stages 1-2]).
        self.buckets.sort(key=lambda b: max((order[p] for p in b.params), default=-1))

    def hold(self, params: list[torch.Tensor]) -> None:
        """Keeps the buckets holding any of `params` out of every backward's reduction: their
        gradients accumulate until `flush_held` reduces them (a pipeline sums tied weights'
        gradients over its stages first, [Note: pipeline engine]). Held buckets launch last,
        in their order; every rank of the group must hold the same parameters."""
        ids = {id(p) for p in params}
        for bucket in self.buckets:
            bucket.held = any(id(p) in ids for p in bucket.params)
        self.buckets.sort(key=lambda b: b.held)  # stable: the launch order stays within each

    def held_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The gradient accumulated so far for `p`, a parameter of a held bucket (zeros when
        none arrived), as a view that reductions over other groups may change in place."""
        bucket, j = self._bucket_of[p]  # type: ignore[index]
        assert bucket.held, "held_grad() of a parameter hold() was not given"
        if self.persistent:
            buffer = self._materialize(bucket)
        else:
            if bucket.buffer is None:
                bucket.buffer = self._new_buffer(bucket, p.dtype)
            buffer = bucket.buffer
        off = bucket.offsets[j]
        return buffer[off : off + p.numel()].view_as(p)

    def flush_held(self) -> None:
        """Reduces the held buckets (in order, on every rank) and retires every reduction."""
        for bucket in self.buckets:
            if bucket.held:
                self._launch(bucket)
        self.reducer.finish()

    @property
    def persistent_bytes(self) -> int:
        """Bytes of stage 1's full gradient buffers while they exist (0 for stage 2)."""
        if not self.persistent:
            return 0
        return sum(b.segment.padded_numel * b.params[0].element_size() for b in self.buckets)

    @property
    def pool_held_bytes(self) -> int:
        """Bytes of stage 2's pooled reduce buffers now, lent out or free (none between
        steps)."""
        return self.reducer.pool.held_bytes

    @property
    def persistent_held_bytes(self) -> int:
        """Bytes of stage 1's full gradient buffers now."""
        if not self.persistent:
            return 0
        return sum(
            b.buffer.numel() * b.buffer.element_size() for b in self.buckets if b.buffer is not None
        )

    def begin_backward(self, armed: bool) -> None:
        """Arms the reduction for the coming backward."""
        self.armed = armed
        self._next = 0
        for b in self.buckets:
            b.pending = len(b.params)

    def _on_ready(self, p: torch.Tensor) -> None:
        bucket, j = self._bucket_of[p]  # type: ignore[index]
        if self.persistent:
            self._keep_view(p, bucket, j)
        elif p.grad is not None:
            if bucket.buffer is None and self._can_adopt(bucket, p.grad):
                # A gradient that fills its whole segment is reduced from its own storage, as
                # DeepSpeed reduces gradients larger than a bucket: copying it would hold two
                # of the largest gradient (a vocabulary embedding) at once.
                bucket.buffer, bucket.adopted = p.grad.detach().view(-1), True
            else:
                if bucket.buffer is None:
                    bucket.buffer = self._new_buffer(bucket, p.grad.dtype)
                off = bucket.offsets[j]
                bucket.buffer[off : off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        if not self.armed:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def absorb(self, params: list[torch.nn.Parameter]) -> None:
        """Runs the arrival hook for each of `params` holding a gradient autograd did not
        accumulate (see `partita.zero.strategy.Strategy.absorb_grads`): stage 1 copies it
        into its bucket view, stage 2 into its bucket buffer."""
        for p in params:
            if p.grad is not None and p in self._bucket_of:
                self._on_ready(p)

    @staticmethod
    def _keep_view(p: torch.Tensor, bucket: GradBucket, j: int) -> None:
        """Reinstates the gradient view if something replaced ``.grad`` (e.g. zero_grad), making
        the bucket's buffer first if it was released."""
        ShardedGradients._materialize(bucket)
        view = bucket.views[j]
        if p.grad is None or p.grad.data_ptr() != view.data_ptr():
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    @staticmethod
    def _materialize(bucket: GradBucket) -> torch.Tensor:
        """Stage 1: makes a released bucket's buffer (zeroed) and points each ``.grad`` at its
        view, a gradient already there copied in, so the others accumulate into it directly."""
        if bucket.buffer is not None:
            return bucket.buffer
        like = bucket.params[0]
        buffer = torch.zeros(bucket.segment.padded_numel, dtype=like.dtype, device=like.device)
        bucket.buffer = buffer
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            view = buffer[off : off + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            bucket.views.append(view)
        return buffer

    @staticmethod
    def _can_adopt(bucket: GradBucket, grad: torch.Tensor) -> bool:
        """Whether `grad` can serve as `bucket`'s buffer as it is: the bucket's only parameter, the
        segment's whole length (no padding), contiguous. (A copied buffer would take the
        gradient's dtype too.)"""
        return (
            len(bucket.params) == 1
            and grad.is_contiguous()
            and grad.numel() == bucket.segment.padded_numel
        )

    def _new_buffer(self, bucket: GradBucket, dtype: torch.dtype) -> torch.Tensor:
        pool = self.reducer.pool
        buf = pool.acquire(bucket.segment.padded_numel, dtype, bucket.params[0].device)
        self.peak_transient_bytes = pool.peak_bytes
        return buf

    def _launch_ready(self) -> None:
        # A complete bucket waits for its predecessors ([Note: gradient buckets of stages 1-2]).
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            if self.buckets[self._next].held:  # reduced by flush_held (they come last)
                return
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: GradBucket) -> None:
        seg = bucket.segment
        if seg.padded_numel == 0:
            return
        self.reducer.make_room(seg.padded_numel)  # before a buffer for zeros comes from the pool
        release = None
        if self.persistent:
            data = self._materialize(bucket)  # no gradient reached it: its zeros are reduced
        else:
            if bucket.buffer is None:  # no gradient arrived (unused parameters): reduce zeros
                bucket.buffer = self._new_buffer(bucket, bucket.params[0].dtype)
            data = bucket.buffer
            release = None if bucket.adopted else data  # an adopted gradient is just dropped
            bucket.buffer, bucket.adopted = None, False
        deliver = None if self.collective == "all_reduce" else self._into_shard(bucket)
        self.reducer.launch(data, self._group(bucket.group), deliver, release)

    def _into_shard(self, bucket: GradBucket) -> Callable[[torch.Tensor], None]:
        """Where `bucket`'s reduced chunk goes: added into its group's fp32 gradient shard (a
        host copy under optimizer offload), made when the reduction ends."""
        seg = bucket.segment

        def deliver(chunk: torch.Tensor) -> None:
            assert self.shard_grad is not None  # reduce-scatter: every group has a shard
            shard = self.shard_grad(bucket.group)
            self.reducer.add(shard[seg.shard_offset : seg.shard_offset + seg.chunk_numel], chunk)

        return deliver

    def _group(self, index: int) -> comm.ProcessGroup | None:
        """The process group parameter group `index` reduces over."""
        return self.group if self.group_of is None else self.group_of[index]

    def materialize(self) -> None:
        """Stage 0-1: makes every released full-gradient buffer (zeroed): the step reads every
        gradient."""
        for bucket in self.buckets:
            self._materialize(bucket)

    def end_backward(self) -> None:
        """Launches buckets that did not complete (in order) and retires all reductions."""
        if not self.armed:
            return
        for bucket in self.buckets[self._next :]:
            bucket.pending = 0
        self._launch_ready()
        self.reducer.finish()
        self.armed = False

    def release(self) -> None:
        """Drops stage 1's full gradients and sets every ``.grad`` to None ([Note: released
        gradients]; the strategy releases the shards)."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
            if self.persistent:
                bucket.buffer, bucket.views = None, []
        self.reducer.pool.drop_free()

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def stage0_layout(params: list[torch.nn.Parameter], bucket_numel: int) -> FlatLayout:
    """A stage-0 group's layout: buckets of at most `bucket_numel` elements in reverse
    registration order (about when their gradients become ready), one rank, no padding (the
    buffer holds exactly the gradients, which it is)."""
    numels = [p.numel() for p in params]
    order = list(reversed(range(len(params))))
    buckets = [b.indices for b in plan_buckets(numels, bucket_numel, order=order)]
    return FlatLayout.build(numels, 1, align=1, buckets=buckets)
