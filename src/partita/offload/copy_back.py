"""Updated parameters from the host optimizer step back into the module's weights.

Under optimizer offload the fp32 masters are stepped on the CPU while the module's weights
(16-bit or fp32) stay on the device. partita's CPU Adam writes each sub-group's updated values,
converted to the weights' dtype, in the same pass over memory as the update
(`partita.optim.CPUAdamW.step_slices`); `CopyBack` says where (it is the step's `SliceSink`):

- weights in host memory (CPU training, stage-3 parameter offload to CPU): into the weights
  themselves, so no separate cast and copy pass follows the step;
- weights on a device: into one of two pinned staging buffers per dtype, copied to the device
  on a side stream while the next sub-group is stepped. A buffer is written again two
  sub-groups later, after its copy has finished.

[Note: stream order] The copy stream first waits for the compute stream (queued work may still
read the weights), and `finish` makes the compute stream wait for the copies, so whatever
follows the step (the all-gathers of stages 1-2, the next forward) sees the new weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from partita.platform.accelerator import get_accelerator

__all__ = ["CopyBack"]


class CopyBack:
    """Destinations of the updated parameters, per sub-group and slice (see the module doc).

    ``targets[k][j]`` is where slice j of sub-group k goes: a contiguous view of the module's
    weights with as many elements as the slice. ``staged`` forces the staging buffers even when
    every target is in host memory (how tests exercise the device path on CPU machines).
    """

    def __init__(self, targets: Sequence[Sequence[torch.Tensor]], staged: bool | None = None):
        self.targets = [list(ts) for ts in targets]
        on_device = any(t.device.type != "cpu" for ts in self.targets for t in ts)
        self.staged = on_device if staged is None else staged
        self._accelerator = get_accelerator()
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._views: list[list[torch.Tensor]] = [[], []]
        self._stream = self._accelerator.new_stream() if self.staged else None
        if self.staged:
            need: dict[torch.dtype, int] = {}
            for ts in self.targets:
                per_dtype: dict[torch.dtype, int] = {}
                for t in ts:
                    per_dtype[t.dtype] = per_dtype.get(t.dtype, 0) + t.numel()
                for dtype, numel in per_dtype.items():
                    need[dtype] = max(need.get(dtype, 0), numel)
            self._buffers = {
                dtype: [
                    self._accelerator.pin_memory(torch.empty(numel, dtype=dtype)) for _ in range(2)
                ]
                for dtype, numel in need.items()
            }

    @property
    def nbytes(self) -> int:
        """Bytes of the staging buffers (0 when the targets are written directly)."""
        return sum(b.numel() * b.element_size() for bufs in self._buffers.values() for b in bufs)

    def begin(self) -> None:
        """Before the step: copies to the weights wait for the work already queued on them."""
        # See [Note: stream order].
        self._accelerator.wait_stream(self._stream, None)

    def outs(self, k: int) -> list[torch.Tensor | None]:
        """Where sub-group ``k``'s slices are written (waits until that staging buffer's last
        copy is done)."""
        if not self.staged:
            return list(self.targets[k])
        slot = k % 2
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        used: dict[torch.dtype, int] = {}
        views = []
        for t in self.targets[k]:
            start = used.get(t.dtype, 0)
            views.append(self._buffers[t.dtype][slot][start : start + t.numel()])
            used[t.dtype] = start + t.numel()
        self._views[slot] = views
        return list(views)

    def done(self, k: int) -> None:
        """Sub-group ``k`` is updated: starts copying its staged values to the weights."""
        if not self.staged:
            return
        slot = k % 2
        with self._accelerator.stream(self._stream):
            for dst, src in zip(self.targets[k], self._views[slot], strict=True):
                dst.copy_(src.view_as(dst), non_blocking=True)
        self._events[slot] = self._accelerator.record_event(self._stream)

    def finish(self) -> None:
        """After the step: later work on the compute stream follows the copies."""
        # See [Note: stream order].
        self._accelerator.wait_stream(None, self._stream)
