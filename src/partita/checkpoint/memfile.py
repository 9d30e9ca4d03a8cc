"""Reading a shard file once: its bytes are hashed as they arrive and then served from memory.

[Note: verified bytes]
Checking a file's digest and then reading its tensors through a memory map reads every byte
twice, and what is loaded is whatever the file holds at the second read, not what was checked.
`read_verified` reads the file into one buffer in chunks, hashing each chunk as it arrives,
compares size and digest with the manifest, and `MemoryShard` then serves the tensors as
views of that same buffer: one read, and the bytes loaded are the bytes checked. `MemoryShard` offers the part of safetensors'
``safe_open`` handle the reader uses (`keys`, `get_slice`, `get_tensor`), parsing the header
itself with bounds checks, since after the digest check the header is still only as
trustworthy as the manifest that names it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch

from partita.checkpoint.digest import digest_mismatch, new_hasher
from partita.checkpoint.manifest import CheckpointError

_CHUNK = 16 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def in_memory_limit() -> int:
    """Largest file read into memory: a quarter of the memory available now (bigger files
    are checked, then memory-mapped, as before: two reads, no copy in process memory)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError):
        return 0


def read_verified(path: str, nbytes: int, algorithm: str, expected: str) -> torch.Tensor:
    """The bytes of `path` (a uint8 tensor) after checking their count and `algorithm` digest
    against the manifest's (`expected`); `CheckpointError` naming the file and the check
    otherwise."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view = buf.numpy().data.cast("B") if nbytes else memoryview(bytearray())
    hasher = new_hasher(algorithm)
    got = 0
    # Hashed on this thread, chunk by chunk while it is still in the CPU's caches: a helper
    # thread cost a handoff per chunk, slow on a busy machine (see `stfile`'s writer).
    with open(path, "rb", buffering=0) as f:
        while got < nbytes:
            n = f.readinto(view[got : got + _CHUNK])
            if not n:
                break
            hasher.update(view[got : got + n])
            got += n
        extra = f.read(1)
    if got != nbytes or extra:
        size = os.path.getsize(path)
        raise CheckpointError(f"{path}: size check failed: {size} bytes, manifest says "
                              f"{nbytes} (truncated or overwritten)")  # fmt: skip
    digest = hasher.hexdigest()
    if digest != expected:
        raise digest_mismatch(path, algorithm, digest, expected)
    return buf


def _checked_entry(info: Any) -> tuple[list[int] | None, list[int] | None]:
    """(shape, [begin, end]) of a header entry, or (None, None) when it is malformed."""
    if not isinstance(info, dict) or info.get("dtype") not in _TORCH_DTYPES:
        return None, None
    shape, span = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(span, list) or len(span) != 2:
        return None, None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape + span):
        return None, None
    return shape, span


class _Slice:
    """One stored tensor, as ``safe_open(...).get_slice`` gives it."""

    def __init__(self, data: torch.Tensor, code: str, shape: list[int]) -> None:
        self.data, self.code, self.shape = data, code, shape

    def get_dtype(self) -> str:
        """The safetensors dtype code ("F32", ...)."""
        return self.code

    def get_shape(self) -> list[int]:
        """The stored shape."""
        return list(self.shape)

    def __getitem__(self, index: slice) -> torch.Tensor:
        return self.data[index]


class MemoryShard:
    """A safetensors file held in memory (see [Note: verified bytes])."""

    def __init__(self, path: str, buf: torch.Tensor) -> None:
        self.path = path
        self._slices: dict[str, _Slice] = {}
        total = buf.numel()
        if total < 8:
            raise self._bad("shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
        if length > min(_MAX_HEADER, total - 8):
            raise self._bad(f"header length {length} exceeds the file")
        try:
            header = json.loads(bytes(buf[8 : 8 + length].numpy()))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        data = buf[8 + length :]
        for key, info in header.items():
            if key != "__metadata__":
                self._slices[key] = self._entry(key, info, data)

    def _bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid safetensors file: {what}")

    def _entry(self, key: str, info: Any, data: torch.Tensor) -> _Slice:
        shape, span = _checked_entry(info)
        if shape is None or span is None:
            raise self._bad(f"tensor {key!r}: entry {info!r}")
        code = info["dtype"]
        dtype = _TORCH_DTYPES[code]
        begin, end = span
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not begin <= end <= data.numel() or end - begin != size:
            raise self._bad(f"tensor {key!r}: offsets {span} do not hold {size} bytes")
        raw = data[begin:end]
        try:
            values = raw.view(dtype) if size else torch.empty(0, dtype=dtype)
        except RuntimeError:  # not aligned to the element size (a foreign writer): a copy
            values = raw.clone().view(dtype)
        return _Slice(values.view(shape), code, shape)

    def keys(self) -> list[str]:
        """The stored tensors' names."""
        return list(self._slices)

    def get_slice(self, key: str) -> _Slice:
        """Tensor `key`, sliceable without a copy."""
        return self._slices[key]

    def get_tensor(self, key: str) -> torch.Tensor:
        """A copy of tensor `key` (a copy: the caller may keep it beyond this file's buffer)."""
        return self._slices[key].data.clone()


__all__ = ["MemoryShard", "in_memory_limit", "read_verified"]
