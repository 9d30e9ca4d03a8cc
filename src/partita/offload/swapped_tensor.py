"""`SwappedTensor`: a tensor whose values live in a swap file between uses.

Used for ZeRO-3 parameter shards under NVMe parameter offload and for `zero.Init` chunks built
with ``remote_device="nvme"``: read in (asynchronously, ahead of use) when needed, freed again
afterwards, written back only when changed.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from .swap_space import SwapSpace


def release_storage(t: torch.Tensor) -> None:
    """Frees `t`'s memory (its storage resized to zero; views keep their shapes)."""
    t.untyped_storage().resize_(0)


def restore_storage(t: torch.Tensor) -> None:
    """Gives `t` memory for its elements again (values undefined until written)."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


def has_storage(t: torch.Tensor) -> bool:
    """True while `t` holds memory (not released)."""
    return t.untyped_storage().nbytes() > 0


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
        return has_storage(self.tensor)

    def fetch(self) -> None:
        """Starts reading it in (no-op when resident or already being read)."""
        if self.resident:
            return
        restore_storage(self.tensor)
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
        release_storage(self.tensor)

    def discard(self) -> None:
        """Frees its memory and deletes its swap file (its values are gone)."""
        if self._reading is not None:
            reading, self._reading = self._reading, None
            reading.result()
        release_storage(self.tensor)
        self.space.unregister(self.key)
