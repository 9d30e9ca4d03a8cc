"""Data-parallel gradient reduction in buckets, overlapped with backward (ZeRO stage 0).

[Note: bucket buffers and gradient views]
Every trainable parameter's ``.grad`` is a view into one flat bucket buffer, assigned at set-up,
so autograd accumulates straight into the buffer and an all-reduce of the buffer reduces every
gradient in it with no copy in or out. Buckets hold parameters in reverse registration order,
which is close to the order gradients become ready in backward. A post-accumulate-grad hook per
parameter counts arrivals; when a bucket is complete its all-reduce starts asynchronously while
backward continues. Buckets are launched strictly in index order on every rank (a complete
bucket waits for its predecessors), so collectives pair up across ranks even if gradient arrival
order differs. `finish` launches whatever did not complete (parameters unused this step still
carry their zeroed slice) and waits for all handles. If something replaced a ``.grad`` with a
fresh tensor (e.g. ``optimizer.zero_grad(set_to_none=True)``), the hook copies it back into the
view and reinstates the view.

A bucket's buffer exists only from the first gradient that reaches it after a step until the
next `release` ([Note: released gradients]): the hook of that gradient makes the buffer
(zeroed), copies the gradient in and points every parameter of the bucket at its view, so the
others accumulate into it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from partita import comm


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    """The flat gradients; None while released."""
    views: list[torch.Tensor] = field(default_factory=list)
    """Each parameter's gradient view into `buffer` (empty while released)."""
    pending: int = 0
    handle: comm.Work | None = None
    comm_buffer: torch.Tensor | None = None
    launched: bool = False


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


@dataclass
class GradientBuckets:
    """Owns the flat gradient buffers of a set of parameters and their all-reduce."""

    params: Sequence[torch.nn.Parameter]
    bucket_numel: int
    scaling: ReduceScaling
    reduce_dtype: torch.dtype
    group: comm.ProcessGroup | None = None
    buckets: list[_Bucket] = field(init=False, default_factory=list)
    sync_enabled: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._where: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self._build()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params
        ]
        self._next_launch = 0

    def _build(self) -> None:
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(list(self.params)):
            if current and size + p.numel() > self.bucket_numel:
                self._add_bucket(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            self._add_bucket(current)

    def _add_bucket(self, params: list[torch.nn.Parameter]) -> None:
        for i, p in enumerate(params):
            self._where[p] = (len(self.buckets), i)
        numel = sum(p.numel() for p in params)
        bucket = _Bucket(params, numel, params[0].dtype, params[0].device, pending=len(params))
        self.buckets.append(bucket)
        if any(p.grad is not None for p in params):  # gradients from before the engine: kept
            self._materialize(bucket)

    @staticmethod
    def _materialize(bucket: _Bucket) -> torch.Tensor:
        """Makes a released bucket's buffer (zeroed) and points each ``.grad`` at its view, a
        gradient already there copied in ([Note: bucket buffers and gradient views])."""
        if bucket.buffer is not None:
            return bucket.buffer
        buffer = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        offset = 0
        for p in bucket.params:
            view = buffer[offset : offset + p.numel()].view_as(p)
            GradientBuckets._reinstate_view(p, view)
            bucket.views.append(view)
            offset += p.numel()
        bucket.buffer = buffer
        return buffer

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all bucket buffers while they exist (these are the gradients themselves)."""
        return sum(b.numel * b.dtype.itemsize for b in self.buckets)

    @property
    def held_bytes(self) -> int:
        """Bytes of the bucket buffers that exist now."""
        return sum(b.numel * b.dtype.itemsize for b in self.buckets if b.buffer is not None)

    def begin_backward(self, sync: bool) -> None:
        """Arms (sync=True) or disarms the reduction for the coming backward."""
        self.sync_enabled = sync
        self._next_launch = 0
        for b in self.buckets:
            b.pending, b.launched, b.handle = len(b.params), False, None

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        b_idx, i = self._where[p]  # type: ignore[index]
        bucket = self.buckets[b_idx]
        self._materialize(bucket)
        view = bucket.views[i]
        if p.grad is not view:  # replaced, e.g. by zero_grad(set_to_none=True): see the Note
            self._reinstate_view(p, view)
        if not self.sync_enabled:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    @staticmethod
    def _reinstate_view(p: torch.Tensor, view: torch.Tensor) -> None:
        grad = p.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        p.grad = view

    def _launch_ready(self) -> None:
        # Strictly in index order on every rank, so the all-reduces pair up across ranks
        # ([Note: bucket buffers and gradient views]).
        while (
            self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0
        ):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        data = self._materialize(bucket)  # no gradient reached it: its zeros are reduced
        if data.dtype != self.reduce_dtype:
            data = data.to(self.reduce_dtype)
            bucket.comm_buffer = data
        if self.scaling.before != 1.0:
            data.mul_(self.scaling.before)
        bucket.handle = comm.all_reduce(data, group=self.group, async_op=True, tag="grad")
        bucket.launched = True

    def finish(self) -> None:
        """Launches incomplete buckets in order and waits for every reduction (a no-op when
        the backward was not armed)."""
        if not self.sync_enabled:
            return
        for bucket in self.buckets[self._next_launch :]:
            bucket.pending = 0
        self._launch_ready()
        for bucket in self.buckets:
            buffer = bucket.buffer
            assert buffer is not None  # every bucket was launched
            if bucket.handle is not None:
                bucket.handle.wait()
            if bucket.comm_buffer is not None:
                buffer.copy_(bucket.comm_buffer)
                bucket.comm_buffer = None
            if self.scaling.after != 1.0:
                buffer.mul_(self.scaling.after)
            bucket.handle = None
        self.sync_enabled = False

    def materialize(self) -> None:
        """Makes every released buffer (zeroed): the step reads every gradient."""
        for b in self.buckets:
            self._materialize(b)

    def release(self) -> None:
        """Drops every buffer and sets every ``.grad`` to None ([Note: released gradients])."""
        for b in self.buckets:
            for p in b.params:
                p.grad = None
            b.buffer, b.views = None, []

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks (engine teardown)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
