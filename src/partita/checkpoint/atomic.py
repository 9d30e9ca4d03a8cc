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
import ctypes
import errno
import fcntl
import functools
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

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
def atomic_writer(final_path: str, tmp: str | None = None) -> Iterator[BinaryIO]:
    """Yields a binary file that appears at `final_path` only when the block exits cleanly
    (written, fsynced, renamed, directory fsynced); on an exception the temporary (`tmp`, by
    default `temp_path(final_path)`) is removed."""
    tmp = tmp or temp_path(final_path)
    f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        # See [Note: commit order].
        os.replace(tmp, final_path)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(final_path) or ".")


def write_atomic(final_path: str, data: bytes, tmp: str | None = None) -> None:
    """Writes `data` to `final_path` atomically (see `atomic_writer`); `tmp`: the temporary
    name to use instead of `temp_path`'s (same directory)."""
    with atomic_writer(final_path, tmp) as f:
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


def exchange_dirs(a: str, b: str) -> bool:
    """Atomically swaps the names `a` and `b` (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the platform or filesystem cannot, so the caller falls back to two renames."""
    func = _renameat2()
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.renameat2
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


SAVE_PREFIX = ".partita-save-"
"""Name prefix of everything one save creates beside the tag folders (see `Staging`)."""
_NONCE_LEN = 16


def staging_path(save_dir: str, nonce: str, tag: str) -> str:
    """Folder the save with `nonce` writes tag `tag` into before it is swapped in."""
    return os.path.join(save_dir, f"{SAVE_PREFIX}{nonce}.new.{tag}")


def _aside_path(save_dir: str, nonce: str, tag: str) -> str:
    return os.path.join(save_dir, f"{SAVE_PREFIX}{nonce}.old.{tag}")


def lock_path(save_dir: str, nonce: str) -> str:
    """Lock file rank 0 holds (``flock``) while the save with `nonce` runs."""
    return os.path.join(save_dir, f"{SAVE_PREFIX}{nonce}.lock")


class Staging:
    """One save's private folder beside the tag folders, swapped in on commit.

    [Note: staging and replacement]
    Rank 0 takes a fresh random nonce, creates and ``flock``s ``.partita-save-<nonce>.lock``
    and makes ``.partita-save-<nonce>.new.<tag>``; every rank writes its shard there and rank 0
    writes the manifest there. `commit` then renames the folder to ``<tag>``; when ``<tag>``
    already exists the two are exchanged atomically (``renameat2``), so at every instant
    ``<tag>`` is the old complete checkpoint or the new one, never a mix and never absent.
    Where the exchange is unsupported, the old folder is first renamed aside
    (``.old.<tag>``); a crash between the two renames is repaired by the next save, which
    renames it back (`remove_dead_saves`), and until then a load falls back to the newest
    complete tag. A staged folder is never promoted after a crash: that save did not return.
    `close` removes whatever is left (the old content, or an uncommitted staging folder) and
    the lock file last. The kernel drops the lock when its holder dies, even by SIGKILL, so
    another save can tell a dead save's leftovers (lock free, or no lock file at all) from
    another live job's in-flight save (lock held) and only removes the former.
    """

    def __init__(self, save_dir: str, tag: str) -> None:
        self.save_dir, self.tag = save_dir, tag
        self._fd: int | None = None
        self.nonce = ""
        self.path = ""

    def open(self) -> str:
        """Takes the lock and creates the staging folder; returns its path."""
        for _ in range(8):
            nonce = os.urandom(_NONCE_LEN // 2).hex()
            lock = lock_path(self.save_dir, nonce)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            with contextlib.suppress(OSError):
                # Where locks are unsupported (some network filesystems) a cleaner cannot take
                # the lock either, so it leaves this save alone: leftovers stay, data is safe.
                fcntl.flock(fd, fcntl.LOCK_EX)
            # A cleaner that saw the file before we locked it may have removed it: then our
            # lock guards nothing and we start over with another nonce.
            if _same_file(lock, fd):
                self._fd, self.nonce = fd, nonce
                self.path = staging_path(self.save_dir, nonce, self.tag)
                os.mkdir(self.path)
                return self.path
            os.close(fd)
        raise OSError(f"{self.save_dir}: could not create a save lock (8 attempts)")

    def commit(self) -> None:
        """Puts the staging folder (manifest written) in place of ``save_dir/tag``. See
        [Note: staging and replacement]."""
        target = os.path.join(self.save_dir, self.tag)
        if not os.path.lexists(target):
            os.rename(self.path, target)
        elif not exchange_dirs(self.path, target):
            os.rename(target, _aside_path(self.save_dir, self.nonce, self.tag))
            os.rename(self.path, target)
        fsync_dir(self.save_dir)

    def latest_temp(self) -> str:
        """Temporary name for writing `latest` (removed with this save's leftovers)."""
        return os.path.join(self.save_dir, f"{SAVE_PREFIX}{self.nonce}.latest")

    def close(self) -> None:
        """Removes this save's leftovers, then the lock file; releases the lock. If the save
        failed between the fallback's two renames, the old folder goes back under its tag."""
        if self._fd is None:
            return
        _remove_group(self.save_dir, self.nonce, repair=True)
        os.close(self._fd)
        self._fd = None


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _group_names(save_dir: str) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in os.listdir(save_dir):
        if name.startswith(SAVE_PREFIX):
            nonce = name[len(SAVE_PREFIX) : len(SAVE_PREFIX) + _NONCE_LEN]
            groups.setdefault(nonce, []).append(name)
    return groups


def _remove_group(save_dir: str, nonce: str, repair: bool) -> list[str]:
    """Removes the save `nonce`'s folders and files, the lock file last (with `repair`, see
    `_repair` first)."""
    prefix = f"{SAVE_PREFIX}{nonce}."
    names = sorted(n for n in os.listdir(save_dir) if n.startswith(prefix))
    if repair:
        names = _repair(save_dir, prefix, names)
    lock = f"{prefix}lock"
    for name in [n for n in names if n != lock] + [n for n in names if n == lock]:
        path = os.path.join(save_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            remove_quietly(path)
    fsync_dir(save_dir)
    return names


def _repair(save_dir: str, prefix: str, names: list[str]) -> list[str]:
    """Renames a dead save's set-aside folder back to its tag where the tag has no folder (a
    crash between the fallback's two renames); returns the names still to remove."""
    left = list(names)
    for name in [n for n in left if n.startswith(f"{prefix}old.")]:
        target = os.path.join(save_dir, name[len(prefix) + len("old.") :])
        if not os.path.lexists(target):
            os.rename(os.path.join(save_dir, name), target)
            left.remove(name)
    return left


def remove_dead_saves(save_dir: str) -> list[str]:
    """Removes the leftovers of saves whose process died (their lock is free or gone),
    repairing a tag a dead save left without its folder; never touches a save whose lock is
    held (another live job sharing `save_dir`). Returns the names removed."""
    removed: list[str] = []
    for nonce, names in _group_names(save_dir).items():
        lock = lock_path(save_dir, nonce)
        if os.path.basename(lock) not in names:
            removed += _remove_group(save_dir, nonce, repair=True)
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue  # its owner finished meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # held: a live save (or locks unsupported: leave it alone)
            continue
        try:
            removed += _remove_group(save_dir, nonce, repair=True)
        finally:
            os.close(fd)
    return removed


__all__ = [
    "SAVE_PREFIX",
    "TMP_PREFIX",
    "Staging",
    "atomic_writer",
    "exchange_dirs",
    "fsync_dir",
    "is_temp_name",
    "lock_path",
    "remove_dead_saves",
    "remove_quietly",
    "staging_path",
    "temp_path",
    "write_atomic",
]
