"""`SwappedTensor`: a tensor whose values live in a swap file between uses.

Used for ZeRO-3 parameter shards under NVMe parameter offload and for `zero.Init` chunks built
with ``remote_device="nvme"``: read in (asynchronously, ahead of use) when needed, freed again
afterwards, written back only when changed.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from .swap import SwapSpace


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _grow(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class SwappedTensor:
    """A 1-D tensor kept in `space` under `key` between uses: its storage is resized to zero
    while it is out, and grown again when it is read back (`fetch`/`ensure`)."""

    def __init__(self, tensor: torch.Tensor, space: SwapSpace, key: str) -> None:
        self.tensor = tensor
        self.space = space
        self.key = key
        space.register(key, tensor.numel(), tensor.dtype)
        self._reading: Future[int] | None = None
        self.dirty = True

    @property
    def resident(self) -> bool:
        """True while its values are in memory (or being read into it)."""
        return self.tensor.untyped_storage().nbytes() > 0

    def fetch(self) -> None:
        """Starts reading it in (no-op when resident or already being read)."""
        if self.resident:
            return
        _grow(self.tensor)
        self._reading = self.space.swap_in(self.key, self.tensor)

    def ensure(self) -> None:
        """Makes it resident (blocking)."""
        self.fetch()
        if self._reading is not None:
            reading, self._reading = self._reading, None
            reading.result()  # raises the I/O error naming the file

    def modified(self) -> None:
        """The resident values changed: `evict` must write them back."""
        self.dirty = True

    def evict(self) -> None:
        """Writes it back if it changed, then frees its memory."""
        if not self.resident:
            return
        self.ensure()
        if self.dirty:
            self.space.swap_out(self.key, self.tensor).result()
            self.dirty = False
        _free(self.tensor)
