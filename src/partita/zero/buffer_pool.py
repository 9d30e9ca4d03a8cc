"""Reusable zeroed buffers for transient gradient buckets (ZeRO-2 and ZeRO-3).

Allocating a fresh multi-megabyte bucket for every reduction costs a page-faulting allocation
each time; the pool hands back a previously freed buffer that is large enough (zeroed), so a
steady state allocates nothing. Only buffers that are free are kept, and at most `keep` of them,
so the pool never holds more than the bounded working set of buckets in flight.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Zeroed 1-D buffers by (dtype, device), reused across steps."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def acquire(
        self, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = True
    ) -> torch.Tensor:
        """A buffer of `numel` elements (a view of a pooled one when possible), zeroed unless
        `zero` is False (a caller that overwrites every element it reads)."""
        free = self._free.setdefault((dtype, device), [])
        fits = [b for b in free if b.numel() >= numel]
        if fits:
            base = min(fits, key=lambda b: b.numel())
            _remove(free, base)
            view = base[:numel]
            if zero:
                view.zero_()
        else:
            base = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
            view = base
        self.live_bytes += base.numel() * base.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return view

    def release(self, buffer: torch.Tensor) -> None:
        """Returns a buffer from `acquire` (callers must not use it afterwards)."""
        base = buffer if buffer._base is None else buffer._base
        self.live_bytes -= base.numel() * base.element_size()
        free = self._free.setdefault((base.dtype, base.device), [])
        free.append(base)
        if len(free) > self.keep:
            _remove(free, min(free, key=lambda b: b.numel()))


def _remove(items: list[torch.Tensor], item: torch.Tensor) -> None:
    """Removes `item` by identity (``list.remove`` would compare tensors element-wise)."""
    del items[next(i for i, t in enumerate(items) if t is item)]
