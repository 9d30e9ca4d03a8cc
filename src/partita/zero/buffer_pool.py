"""Reusable zeroed buffers for transient gradient buckets (ZeRO-2 and ZeRO-3).

Allocating a fresh multi-megabyte bucket for every reduction costs a page-faulting allocation
each time; the pool hands back a previously freed buffer that is large enough (zeroed), so a
steady state allocates nothing. Only buffers that are free are kept, and at most `keep` of them,
so the pool never holds more than the bounded working set of buckets in flight. Between
steps it holds none: the owners call `drop_free` when they release the gradients ([Note:
released gradients]), so the next forward's activations can use that memory (the allocator
keeps it for the next backward's first buffers).
"""

from __future__ import annotations

import torch


class BufferPool:
    """Zeroed 1-D buffers by (dtype, device), reused across steps."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.live_bytes = 0
        """Bytes of the buffers lent out."""
        self.free_bytes = 0
        """Bytes of the free buffers kept."""
        self.peak_bytes = 0
        """Most bytes held at once, lent out or free (the memory the pool takes)."""

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
            self.free_bytes -= _nbytes(base)
            view = base[:numel]
            if zero:
                view.zero_()
        else:
            base = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
            view = base
        self.live_bytes += _nbytes(base)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return view

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers lent out and of the free ones kept."""
        return self.live_bytes + self.free_bytes

    def drop_free(self) -> None:
        """Lets go of every free buffer (those lent out stay the borrowers')."""
        self._free.clear()
        self.free_bytes = 0

    def release(self, buffer: torch.Tensor) -> None:
        """Returns a buffer from `acquire` (callers must not use it afterwards)."""
        base = buffer if buffer._base is None else buffer._base
        self.live_bytes -= _nbytes(base)
        free = self._free.setdefault((base.dtype, base.device), [])
        free.append(base)
        self.free_bytes += _nbytes(base)
        if len(free) > self.keep:
            evicted = min(free, key=lambda b: b.numel())
            _remove(free, evicted)
            self.free_bytes -= _nbytes(evicted)


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


def _remove(items: list[torch.Tensor], item: torch.Tensor) -> None:
    """Removes `item` by identity (``list.remove`` would compare tensors element-wise)."""
    del items[next(i for i, t in enumerate(items) if t is item)]
