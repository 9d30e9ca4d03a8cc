"""Crash-safe file writes: temporary name in the same directory, fsync, rename, fsync the folder.

[Note: commit order]
A checkpoint folder becomes a checkpoint when its manifest appears, and the manifest is written
only after every rank has renamed its shard into place. Each file is written under a temporary
name (`TMP_PREFIX` + final name + a per-process suffix) in its final directory, so the rename is
atomic on POSIX filesystems, and the directory is fsynced after the rename so the new name
survives a power loss. A crash therefore leaves either temporary files (cleaned by the next
save, `remove_leftovers`) or complete files; never a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import BinaryIO

TMP_PREFIX = ".partita-tmp-"
"""Name prefix of files still being written; a reader never trusts such a file."""


def fsync_dir(path: str) -> None:
    """Makes renames and creations inside `path` durable (no-op where directories cannot be
    opened, e.g. some network filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(final_path: str) -> str:
    """The temporary name `final_path` is written under (same directory, unique per process)."""
    folder, name = os.path.split(final_path)
    return os.path.join(folder, f"{TMP_PREFIX}{name}.{os.getpid()}")


@contextlib.contextmanager
def atomic_writer(final_path: str) -> Iterator[BinaryIO]:
    """Yields a binary file that appears at `final_path` only when the block exits cleanly
    (written, fsynced, renamed, directory fsynced); on an exception the temporary is removed."""
    tmp = temp_path(final_path)
    f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final_path)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(final_path) or ".")


def write_atomic(final_path: str, data: bytes) -> None:
    """Writes `data` to `final_path` atomically (see `atomic_writer`)."""
    with atomic_writer(final_path) as f:
        f.write(data)


def is_temp_name(name: str) -> bool:
    """True for names `temp_path` produces."""
    return name.startswith(TMP_PREFIX)


def remove_quietly(path: str) -> bool:
    """Removes a file; False if it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


__all__ = [
    "TMP_PREFIX",
    "atomic_writer",
    "fsync_dir",
    "is_temp_name",
    "remove_quietly",
    "temp_path",
    "write_atomic",
]
