"""Where a checkpoint keeps its inputs between forward and recomputation.

torch's non-reentrant checkpoint stores nothing of the function's inner activations: it saves
the function's inputs (through the saved-tensor hooks in force when it is called) and reruns
the function in backward. Those inputs are what activation checkpointing keeps, one per
checkpointed layer; `pack` / `unpack` here are saved-tensor hooks that choose how:

- whole, on the compute device (the default);
- ``partition_activations``: each model-parallel rank keeps 1/mp of the flattened input and the
  whole is all-gathered back for recomputation (no model parallelism: kept whole);
- ``cpu_checkpointing``: kept in (pinned) host memory and copied back to the device, the
  previous checkpoint's input being prefetched on a side stream while this one recomputes;
- ``contiguous_memory_optimization``: kept in slots of one preallocated buffer per dtype and
  device (``number_checkpoints`` slots) instead of separate allocations.

[Note: saved-input accounting]
`STATS` counts the bytes of stored inputs alive, split into those kept on the compute device
and those moved to host memory by ``cpu_checkpointing``. On a CPU run the compute device is the
host: ``cpu_checkpointing`` copies nothing there, and its inputs are counted as host-held
because that is where a GPU run would have put them. Bytes leave the count when autograd frees
the saved input (after backward, or with the graph).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from partita import comm
from partita.platform.accelerator import get_accelerator

__all__ = ["STATS", "ContiguousArena", "Placement", "SavedInputStats", "pack", "unpack"]


@dataclass
class SavedInputStats:
    """Bytes of checkpointed inputs alive, by where they are kept (see [Note: saved-input
    accounting])."""

    device_bytes: int = 0
    host_bytes: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    saved: int = 0

    def add(self, on_host: bool, nbytes: int) -> None:
        """Counts a stored input."""
        self.saved += 1
        if on_host:
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            self.device_bytes += nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def remove(self, on_host: bool, nbytes: int) -> None:
        """Uncounts a freed input."""
        if on_host:
            self.host_bytes -= nbytes
        else:
            self.device_bytes -= nbytes

    def move_to_host(self, nbytes: int) -> None:
        """Counts a stored input that left the device for host memory."""
        self.device_bytes -= nbytes
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def reset_peaks(self) -> None:
        """Peaks restart from the bytes alive now."""
        self.peak_device_bytes, self.peak_host_bytes = self.device_bytes, self.host_bytes
        self.saved = 0


STATS = SavedInputStats()
"""The process-wide counts."""


@dataclass
class ContiguousArena:
    """``slots`` equal slots per (dtype, device), each sized by the first tensor stored."""

    slots: int
    _buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)
    _free: dict[tuple[torch.dtype, torch.device], list[int]] = field(default_factory=dict)

    def take(self, flat: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Copies `flat` into a free slot of the buffer on `device`; returns the slot's view and
        its release function."""
        key = (flat.dtype, device)
        if key not in self._buffers:
            buffer = torch.empty(self.slots * flat.numel(), dtype=flat.dtype, device=device)
            # A host buffer is pinned on CUDA machines so copies back to the device are async.
            self._buffers[key] = get_accelerator().pin_memory(buffer) if device.type == "cpu" \
                else buffer  # fmt: skip
            self._free[key] = list(range(self.slots - 1, -1, -1))
        buffer, free = self._buffers[key], self._free[key]
        width = buffer.numel() // self.slots
        if flat.numel() > width or not free:
            raise RuntimeError(
                f"activation_checkpointing.contiguous_memory_optimization: a checkpoint input of "
                f"{flat.numel()} {flat.dtype} elements does not fit: {len(free)} of "
                f"number_checkpoints={self.slots} slots of {width} elements are free (the "
                "inputs must be equally sized and at most number_checkpoints alive at once)"
            )
        slot = free.pop()
        view = buffer[slot * width : slot * width + flat.numel()]
        view.copy_(flat, non_blocking=True)
        return view, lambda: free.append(slot)


@dataclass(frozen=True)
class Placement:
    """How checkpoint inputs are kept (built by `partita.activations.checkpointing`)."""

    to_host: bool = False
    group: Any = None
    group_rank: int = 0
    group_size: int = 1
    arena: ContiguousArena | None = None


class _Stored:
    """One saved input in its stored form."""

    def __init__(self, tensor: torch.Tensor, where: Placement) -> None:
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.numel = tensor.numel()
        self.where = where
        self.partitioned = (
            where.group_size > 1 and tensor.is_floating_point() and self.numel >= where.group_size
        )
        data = self._shard(tensor) if self.partitioned else tensor
        release = None
        self.on_host = where.to_host
        move = where.to_host and tensor.device.type != "cpu"
        if where.arena is not None:  # the slots live where the inputs are kept
            keep_on = torch.device("cpu") if move else tensor.device
            data, release = where.arena.take(data.reshape(-1), keep_on)
        elif move:
            host = get_accelerator().pin_memory(torch.empty(data.shape, dtype=data.dtype))
            data = host.copy_(data, non_blocking=True)
        self.data: torch.Tensor = data
        self.nbytes = data.numel() * data.element_size()
        self.prefetched: tuple[torch.Tensor, Any] | None = None
        self.previous: weakref.ref[_Stored] | None = None
        STATS.add(self.on_host, self.nbytes)
        weakref.finalize(self, _forget, self.on_host, self.nbytes, release)

    def _shard(self, tensor: torch.Tensor) -> torch.Tensor:
        size, rank = self.where.group_size, self.where.group_rank
        chunk = -(-self.numel // size)
        flat = tensor.reshape(-1)
        # A copy, not a view: the whole input's storage must be free to go.
        shard = flat.new_zeros(chunk)
        piece = flat[rank * chunk : (rank + 1) * chunk]
        shard[: piece.numel()].copy_(piece)
        return shard

    def _on_device(self) -> torch.Tensor:
        if self.prefetched is not None:
            data, event = self.prefetched
            self.prefetched = None
            if event is not None:
                event.wait()
            return data
        return self.data.to(self.device, non_blocking=True)

    def prefetch(self) -> None:
        """Starts copying a host-held input back on a side stream (CUDA only)."""
        if not self.on_host or self.device.type == "cpu" or self.prefetched is not None:
            return
        accelerator = get_accelerator()
        # Allocated on the compute stream (which uses it), written on the side stream after
        # the compute stream's work so far; the use waits for the copy's event.
        target = torch.empty(self.data.shape, dtype=self.dtype, device=self.device)
        side = _side_stream()
        accelerator.wait_stream(side, None)
        with accelerator.stream(side):
            target.copy_(self.data, non_blocking=True)
        self.prefetched = (target, accelerator.record_event(side))

    def restore(self) -> torch.Tensor:
        """The input as it was given, on its device."""
        previous = self.previous() if self.previous is not None else None
        data = self._on_device()
        if previous is not None:
            previous.prefetch()  # backward runs the checkpoints in reverse: the next one up
        if not self.partitioned:
            return data.view(self.shape)
        size = self.where.group_size
        full = torch.empty(size * data.numel(), dtype=self.dtype, device=self.device)
        comm.all_gather(full, data, group=self.where.group, tag="activation")
        return full[: self.numel].view(self.shape)


def _forget(on_host: bool, nbytes: int, release: Any) -> None:
    STATS.remove(on_host, nbytes)
    if release is not None:
        release()


_SIDE: list[Any] = []
_LAST_ON_HOST: list[weakref.ref[_Stored]] = []


def _side_stream() -> Any:
    if not _SIDE:
        _SIDE.append(get_accelerator().new_stream())
    return _SIDE[0]


def pack(tensor: torch.Tensor, where: Placement) -> _Stored:
    """Saved-tensor pack hook: `tensor` in its stored form."""
    stored = _Stored(tensor, where)
    if stored.on_host:
        if _LAST_ON_HOST:
            stored.previous = _LAST_ON_HOST[0]
        _LAST_ON_HOST[:] = [weakref.ref(stored)]
    return stored


def unpack(stored: _Stored) -> torch.Tensor:
    """Saved-tensor unpack hook: the input back on its device, whole."""
    return stored.restore()
