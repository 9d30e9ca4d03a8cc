"""Optimizer offload to NVMe for ZeRO-3: master weights and optimizer state in swap files.

[Note: swapped sub-groups]
Each master tensor (one per unit and optimizer group) is a sub-group. Between steps its fp32
values and its element-wise optimizer state (Adam's moments) live only in this rank's swap
files; their host storage is resized to zero. A step walks the sub-groups in order: the read of
sub-group k+1 is in flight while k is stepped, and k's write-back is started before moving on, so
at most three sub-groups are resident. Gradients stay in memory (backward adds into them).
Reading a master outside a step (accessors, checkpoints) swaps it in first; it stays resident
until the next step writes it back.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from partita.offload import SwapSpace


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _grow(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class SwappedOptimizerState:
    """Swaps `masters` and their optimizer state in and out of `space` around each step."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, masters: list[torch.nn.Parameter], space: SwapSpace
    ) -> None:
        self.optimizer = optimizer
        self.masters = masters
        self.space = space
        self.resident = [True] * len(masters)
        self._writes: dict[int, list[Future[int]]] = {}
        for i in range(len(masters)):
            self._evict(i)
        self.space.wait()
        for i in range(len(masters)):
            self._release(i)

    def _tensors(self, i: int) -> dict[str, torch.Tensor]:
        m = self.masters[i]
        out = {"param": m.data}
        for key, value in self.optimizer.state.get(m, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == m.numel() and value.dim() > 0:
                out[key] = value
        return out

    def _evict(self, i: int) -> None:
        """Starts writing sub-group i out (its memory is released by `_release`)."""
        futures = []
        for name, t in self._tensors(i).items():
            key = f"{i}.{name}"
            if key not in self.space.slots:
                self.space.register(key, t.numel(), t.dtype)
            futures.append(self.space.swap_out(key, t))
        self._writes[i] = futures

    def _release(self, i: int) -> None:
        for f in self._writes.pop(i, []):
            f.result()  # raises the I/O error naming the file
        for t in self._tensors(i).values():
            _free(t)
        self.resident[i] = False

    def _fetch(self, i: int) -> list[Future[int]]:
        futures = []
        for name, t in self._tensors(i).items():
            _grow(t)
            futures.append(self.space.swap_in(f"{i}.{name}", t))
        self.resident[i] = True
        return futures

    def ensure_resident(self, i: int) -> None:
        """Swaps sub-group i in (blocking) if it is out."""
        if not self.resident[i]:
            for f in self._fetch(i):
                f.result()

    def step(self, step_one: Callable[[int], None]) -> None:
        """Runs `step_one(i)` for every sub-group with it resident, pipelining the I/O."""
        n = len(self.masters)
        pending = None if n == 0 or self.resident[0] else self._fetch(0)
        for i in range(n):
            for f in pending or []:
                f.result()
            pending = None
            if i + 1 < n and not self.resident[i + 1]:
                pending = self._fetch(i + 1)
            step_one(i)
            self._evict(i)
            if i >= 1 and (i - 1) in self._writes:
                self._release(i - 1)
        for i in list(self._writes):
            self._release(i)
        self.space.wait()
