"""Checksums of checkpoint files: which algorithm a manifest entry names, and computing it.

[Note: digest algorithms]
New saves record XXH3-128 (xxhash), as ``"digest": {"xxh3_128": hex}`` per file: it runs at
several GB/s on one core where sha256 runs near 1 GB/s, so hashing no longer bounds saving
and loading below disk speed. The checksum guards against corruption (torn writes, bit rot,
a file overwritten by something else), not against a forger: whoever can change a shard can
change the manifest beside it, so a cryptographic hash buys nothing here. Manifests written
before this change hold ``"sha256": hex`` instead; they load as before, checked with sha256.
An algorithm this partita does not know is refused, naming the file and the algorithm, rather
than loading unchecked bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import xxhash

from partita.checkpoint.manifest import CheckpointError

ALGORITHM = "xxh3_128"
"""Algorithm new saves record (see [Note: digest algorithms])."""


class Hasher(Protocol):
    """What hashlib's and xxhash's hash objects share."""

    def update(self, data: Any, /) -> None:
        """Adds `data` (bytes-like) to the hash."""

    def hexdigest(self) -> str:
        """The digest of everything added, as lowercase hex."""


_HASHERS: dict[str, Callable[[], Hasher]] = {
    "xxh3_128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}
_READ_CHUNK = 16 << 20


def new_hasher(algorithm: str = ALGORITHM) -> Hasher:
    """A fresh hash object for `algorithm` (one of the known ones; KeyError otherwise)."""
    return _HASHERS[algorithm]()


def expected_digest(info: dict[str, Any], path: str) -> tuple[str, str]:
    """(algorithm, hex digest) a manifest file entry `info` records for the file at `path`:
    ``info["digest"]`` (one algorithm) or, in manifests from before it, ``info["sha256"]``;
    `CheckpointError` naming `path` and the algorithm when it is not one this partita knows."""
    recorded = info.get("digest")
    if recorded is None:
        return "sha256", str(info["sha256"])
    if not isinstance(recorded, dict) or len(recorded) != 1:
        raise CheckpointError(
            f"{path}: manifest digest entry is {recorded!r}; expected one {{algorithm: hex}}"
        )
    ((algorithm, value),) = recorded.items()
    if algorithm not in _HASHERS:
        raise CheckpointError(
            f"{path}: manifest records checksum algorithm {algorithm!r}, which this partita "
            f"cannot check (it knows {', '.join(sorted(_HASHERS))}); refusing to load "
            "unchecked bytes"
        )
    if not isinstance(value, str):
        raise CheckpointError(f"{path}: manifest {algorithm} digest is {value!r}; expected hex")
    return algorithm, value


def digest_mismatch(path: str, algorithm: str, got: str, expected: str) -> CheckpointError:
    """The error for a file whose content does not match its recorded digest."""
    return CheckpointError(
        f"{path}: checksum check failed ({algorithm}): {got}, manifest says {expected} "
        "(the file is corrupt)"
    )


def file_digest(path: str, algorithm: str = ALGORITHM) -> str:
    """The `algorithm` digest of a file, read in chunks (reading overlaps hashing on a helper
    thread: hashlib and xxhash release the GIL on large buffers)."""
    hasher = new_hasher(algorithm)
    with open(path, "rb") as f, ThreadPoolExecutor(1) as pool:
        pending: Future[None] | None = None
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                break
            if pending is not None:
                pending.result()
            pending = pool.submit(hasher.update, chunk)
        if pending is not None:
            pending.result()
    return hasher.hexdigest()


__all__ = [
    "ALGORITHM",
    "Hasher",
    "digest_mismatch",
    "expected_digest",
    "file_digest",
    "new_hasher",
]
