"""Streaming safetensors files with a checksum computed on the way (no pickle, no second copy).

`safetensors.torch.save` builds the whole file in memory; a rank's share of a large model's
optimizer state would then exist twice. The format is simple (an 8-byte little-endian header
length, a JSON header with dtype, shape and byte offsets per tensor, then the raw bytes), so
this module writes it tensor by tensor and hashes each buffer as it goes. Files are read back
with the `safetensors` library (`safe_open`), which memory-maps them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from partita.checkpoint import digest as digests
from partita.checkpoint.atomic import atomic_writer

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class WrittenFile:
    """What a reader needs to check a file: its name, size and checksum."""

    path: str
    nbytes: int
    algorithm: str
    digest: str


TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]
"""(name, dtype, shape) of a tensor to be written."""


def _header(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        entries[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    # Pad with spaces (allowed by the format) so tensor data starts 8-byte aligned.
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _as_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A byte view of `t`'s data and the tensor that owns it (keep it alive while the view is
    used). ctypes, not ``Tensor.numpy()``: the latter marks the storage non-resizable, which
    breaks stage 3's resizable gathered storage."""
    flat = t.detach().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    raw = (ctypes.c_char * nbytes).from_address(flat.data_ptr())
    return memoryview(raw).cast("B"), flat


def write_safetensors(
    path: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> WrittenFile:
    """Writes `tensors` (in the mapping's order) to `path` atomically; returns size and digest."""
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    return write_safetensors_stream(path, specs, tensors.__getitem__, metadata)


def write_safetensors_stream(
    path: str,
    specs: Sequence[TensorSpec],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> WrittenFile:
    """Writes the tensors `specs` describes, asking `produce(name)` for each in turn (so only
    one needs to exist at a time), to `path` atomically; returns size and digest (`digest.ALGORITHM`).

    Each piece is hashed on the writing thread just before it is written, while the disk
    writes the earlier windows (see [Note: streaming writeback]): a helper thread for the
    hash cost a handoff per piece, which on a busy machine (more runnable threads than
    cores) waited for a time slice each time and made saves several times slower than the
    write alone. So each tensor is written and hashed to its last byte before the next is
    asked for, and `produce` may return a view of memory that making the next tensor reuses
    (a swapped-in optimizer state, see `ParamStates.local_state_view`).
    """
    hasher = digests.new_hasher(digests.ALGORITHM)
    nbytes = 0

    def buffers() -> Iterator[tuple[memoryview, Any]]:
        header = _header(specs, metadata or {})
        yield memoryview(header), header
        for name, dtype, shape in specs:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"tensor {name!r}: produced {t.dtype} {tuple(t.shape)}, announced "
                    f"{dtype} {tuple(shape)}"
                )
            if t.numel():
                yield _as_bytes(t)

    with atomic_writer(path) as f:
        flusher = _Writeback(f)
        for buf, _owner in buffers():  # the owner keeps `buf`'s memory alive meanwhile
            for at in range(0, max(len(buf), 1), _WRITE_CHUNK):
                piece = buf[at : at + _WRITE_CHUNK]
                hasher.update(piece)
                f.write(piece)
                nbytes += len(piece)
                flusher.written(len(piece))
    return WrittenFile(
        path=path, nbytes=nbytes, algorithm=digests.ALGORITHM, digest=hasher.hexdigest()
    )


_WRITE_CHUNK = 16 << 20
"""Bytes per write and hash call."""
_WRITEBACK_WINDOW = 256 << 20
"""Bytes after which the kernel is asked to start writing the range out (see `_Writeback`)."""


class _Writeback:
    """Starts the disk writing while the file is still being produced.

    [Note: streaming writeback]
    Left alone, the kernel keeps a checkpoint's pages dirty until the final fsync (or until
    the dirty limit throttles the writer), so the disk idles while the bytes are produced
    and hashed, and then works alone during the fsync. Every `_WRITEBACK_WINDOW` bytes this
    asks for the window just written to go out (``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
    which does not wait) and waits for the window before it to be on disk, so the disk
    works all the time, dirty memory stays at two windows, and the final fsync (kept: it is
    what makes the file durable, with its metadata) has little left to do. Where
    ``sync_file_range`` is missing (not Linux) the final fsync does all of it, as before.
    """

    def __init__(self, f: Any) -> None:
        self.f, self.offset, self.started = f, 0, 0
        self.prev: tuple[int, int] | None = None

    def written(self, nbytes: int) -> None:
        """Counts `nbytes` more written; at a window boundary, writes back (see the note)."""
        self.offset += nbytes
        if self.offset - self.started < _WRITEBACK_WINDOW or _sync_file_range() is None:
            return
        self.f.flush()
        fd = self.f.fileno()
        window = (self.started, self.offset - self.started)
        _range_sync(fd, *window, _SYNC_WRITE)
        if self.prev is not None:
            _range_sync(fd, *self.prev, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
        self.prev, self.started = window, self.offset


_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


@functools.cache
def _sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


def _range_sync(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """``sync_file_range``; an error is raised as OSError (a write error shows here first)."""
    if _sync_file_range()(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE):
            return  # unsupported here (e.g. some filesystems): the final fsync does it
        raise OSError(err, os.strerror(err))


__all__ = [
    "TensorSpec",
    "WrittenFile",
    "write_safetensors",
    "write_safetensors_stream",
]
