"""NVMe swap space: preallocated per-tensor files under ``nvme_path``, one directory per rank.

`SwapSpace` owns ``<nvme_path>/partita-swap-<run id>-rank<r>/``: one file per registered key
(``register``), sized and preallocated up front so that running out of disk shows at set-up,
not mid-step. ``swap_out``/``swap_in`` move a whole tensor to/from its file through an
`AsyncIO` backend and return Futures. `SwapBufferPool` holds a fixed number of aligned (and, on
CUDA, pinned) host buffers, so the memory used for swapping is bounded by the config's
``buffer_count`` x ``buffer_size``.

[Note: swap directory lifetime] The directory is removed by `SwapSpace.close`, and by a
finaliser at interpreter exit or garbage collection, but only in the process that created it
(a forked child exiting must not delete its parent's files). A run killed by a signal or a
crash leaves it behind; its ``owner.json`` records host name, pid and the process start time,
and the next `SwapSpace` created under the same ``nvme_path`` on the same host removes every
``partita-swap-*`` directory whose owner process is gone (`remove_stale_swap_dirs`). The start
time guards against pid reuse; directories of other hosts (a shared filesystem) are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from .aio import (
    ALIGNMENT,
    AsyncIO,
    FileHandle,
    ThreadPoolIO,
    aligned_empty,
    open_file,
    padded_nbytes,
)

__all__ = [
    "OWNER_FILE",
    "SWAP_DIR_PREFIX",
    "SwapBufferPool",
    "SwapSlot",
    "SwapSpace",
    "remove_stale_swap_dirs",
]

logger = logging.getLogger(__name__)

SWAP_DIR_PREFIX = "partita-swap-"
"""Name prefix of every swap directory under an ``nvme_path``."""

OWNER_FILE = "owner.json"
"""File in a swap directory naming the process that owns it."""


@dataclass(frozen=True)
class SwapSlot:
    """Where one registered tensor lives on disk.

    Attributes:
        key: the name it was registered under.
        path: its swap file.
        numel, dtype: the shape of what it holds (1-D).
        nbytes: ``numel * itemsize``; ``file_bytes``: that rounded up to `ALIGNMENT`.
    """

    key: str
    path: Path
    numel: int
    dtype: torch.dtype
    nbytes: int
    file_bytes: int


def _process_start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _owner_alive(owner: dict[str, Any]) -> bool:
    started = _process_start_time(int(owner["pid"]))
    # A live process with another start time is a reused pid: the owner is gone ([Note: swap
    # directory lifetime]).
    return started is not None and abs(started - float(owner["start_time"])) < 1.0


def remove_stale_swap_dirs(nvme_path: str | os.PathLike[str]) -> list[Path]:
    """Remove swap directories under ``nvme_path`` left by dead processes of this host.

    Returns the directories removed. A directory without a readable ``owner.json`` is left in
    place with a warning (it may be one being created right now).
    """
    removed: list[Path] = []
    host = socket.gethostname()
    for entry in sorted(Path(nvme_path).glob(f"{SWAP_DIR_PREFIX}*")):
        if not entry.is_dir():
            continue
        try:
            owner = json.loads((entry / OWNER_FILE).read_text())
            mine = owner["host"] == host
            alive = _owner_alive(owner) if mine else True
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # A directory a few seconds old may be one another rank is creating right now.
            young = time.time() - entry.stat().st_mtime < 60
            log = logger.debug if young else logger.warning
            log(
                "swap directory '%s' has no readable %s (%s); left in place", entry, OWNER_FILE, exc
            )
            continue
        if mine and not alive:
            shutil.rmtree(entry, ignore_errors=True)
            logger.info("removed stale swap directory '%s' of dead pid %s", entry, owner["pid"])
            removed.append(entry)
    return removed


def unique_run_id(kind: str) -> str:
    """A swap directory run id no other space gets: ``<host>-<pid>-<random>-<kind>`` (several
    spaces may live in one process; a crashed run's directory is recognised as stale by its
    dead owner pid, not by its name)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{kind}"


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)[:80]


def _close_and_remove(
    directory: Path, handles: dict[str, FileHandle], owner_pid: int, aio: AsyncIO | None
) -> None:
    """Finaliser body: close files, stop an owned backend, delete the directory (owner only)."""
    if os.getpid() != owner_pid:  # a forked child: [Note: swap directory lifetime]
        return
    if aio is not None:
        aio.close()
    for handle in handles.values():
        handle.close()
    handles.clear()
    shutil.rmtree(directory, ignore_errors=True)


class SwapSpace:
    """Preallocated swap files of one rank, and async transfers between them and CPU tensors.

    Args:
        nvme_path: the directory to create this rank's swap directory in (must exist).
        rank: global rank, part of the directory name.
        aio: the I/O backend; default a `ThreadPoolIO` with default settings, owned (closed) by
            this space. A backend passed in is shared and left open.
        run_id: distinguishes concurrent runs; default ``<host>-<pid>``.
        direct: passed to `open_file` (None: O_DIRECT when the filesystem allows it).
        remove_stale: first remove directories left by dead runs (`remove_stale_swap_dirs`).
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        rank: int,
        *,
        aio: AsyncIO | None = None,
        run_id: str | None = None,
        direct: bool | None = None,
        remove_stale: bool = True,
    ) -> None:
        root = Path(nvme_path).resolve()
        if remove_stale:
            remove_stale_swap_dirs(root)
        run = _safe_name(run_id or f"{socket.gethostname()}-{os.getpid()}")
        self.directory = root / f"{SWAP_DIR_PREFIX}{run}-rank{rank}"
        self.directory.mkdir()  # exists already: another live run uses this id; do not share
        self._write_owner(rank)  # what a later run's cleanup reads: [Note: swap directory lifetime]
        self.rank = rank
        self.aio: AsyncIO = aio if aio is not None else ThreadPoolIO()
        self._direct = direct
        self._slots: dict[str, SwapSlot] = {}
        self._handles: dict[str, FileHandle] = {}
        self._issued: list[Future[int]] = []  # transfers since the last wait(), this space's only
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(
            self, _close_and_remove, self.directory, self._handles, os.getpid(),
            self.aio if aio is None else None,
        )  # fmt: skip

    def _write_owner(self, rank: int) -> None:
        pid = os.getpid()
        owner = {
            "host": socket.gethostname(),
            "pid": pid,
            "start_time": _process_start_time(pid),
            "rank": rank,
        }
        tmp = self.directory / f".{OWNER_FILE}.tmp"
        tmp.write_text(json.dumps(owner))
        tmp.replace(self.directory / OWNER_FILE)  # atomic: readers never see half a file

    @property
    def slots(self) -> dict[str, SwapSlot]:
        """Registered slots by key (a copy)."""
        return dict(self._slots)

    @property
    def file_bytes(self) -> int:
        """Bytes of disk the registered slots occupy."""
        return sum(slot.file_bytes for slot in self._slots.values())

    def register(self, key: str, numel: int, dtype: torch.dtype) -> SwapSlot:
        """Create and preallocate the swap file for ``key`` (``numel`` elements of ``dtype``).

        Raises ValueError for a key registered twice, OSError naming the file when the disk
        cannot hold it (ENOSPC from ``posix_fallocate``).
        """
        if self._finalizer.alive is False:
            raise RuntimeError(f"swap space '{self.directory}' is closed")
        with self._lock:
            if key in self._slots:
                raise ValueError(f"swap key '{key}' is already registered in '{self.directory}'")
            index = len(self._slots)
            path = self.directory / f"{index:06d}-{_safe_name(key)}.swp"
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            slot = SwapSlot(key, path, numel, dtype, nbytes, padded_nbytes(nbytes))
            handle = open_file(path, direct=self._direct)
            if self._direct is None:
                self._direct = handle.direct  # probe once per space; one log line at most
            try:
                self._preallocate(handle, slot.file_bytes)
            except OSError:
                handle.close()
                path.unlink(missing_ok=True)
                raise
            self._handles[key] = handle
            self._slots[key] = slot
        return slot

    def unregister(self, key: str) -> None:
        """Close and delete ``key``'s swap file, giving its disk space back (waits for this
        space's transfers first: one may still use the file). Unknown keys are a KeyError."""
        self.wait()
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                raise KeyError(f"swap key '{key}' is not registered in '{self.directory}'")
            self._handles.pop(key).close()
        slot.path.unlink(missing_ok=True)

    @staticmethod
    def _preallocate(handle: FileHandle, nbytes: int) -> None:
        if nbytes == 0:
            return
        try:
            os.posix_fallocate(handle.fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: sparse file
                raise OSError(
                    exc.errno, f"cannot preallocate {nbytes} bytes: {exc.strerror}", handle.path
                ) from exc
            os.ftruncate(handle.fd, nbytes)
        except AttributeError:  # platforms without posix_fallocate
            os.ftruncate(handle.fd, nbytes)

    def _checked(
        self, key: str, tensor: torch.Tensor, what: str
    ) -> tuple[FileHandle, torch.Tensor]:
        slot = self._slots.get(key)
        if slot is None:
            raise KeyError(f"swap key '{key}' is not registered in '{self.directory}'")
        if tensor.numel() != slot.numel or tensor.dtype != slot.dtype:
            raise ValueError(
                f"{what} '{key}': slot holds {slot.numel} x {slot.dtype}, tensor is "
                f"{tensor.numel()} x {tensor.dtype}"
            )
        return self._handles[key], tensor.reshape(-1)

    def swap_out(self, key: str, tensor: torch.Tensor) -> Future[int]:
        """Start writing ``tensor`` (contiguous, CPU, the slot's numel and dtype) to ``key``'s
        file. Keep ``tensor`` unchanged until the Future is done."""
        handle, flat = self._checked(key, tensor, "swap_out")
        return self._track(self.aio.submit_write(handle, 0, flat))

    def swap_in(self, key: str, out: torch.Tensor) -> Future[int]:
        """Start reading ``key``'s file into ``out`` (contiguous, CPU, the slot's numel and
        dtype). ``out`` holds the data once the Future is done."""
        handle, flat = self._checked(key, out, "swap_in")
        return self._track(self.aio.submit_read(handle, 0, flat))

    def _track(self, future: Future[int]) -> Future[int]:
        with self._lock:
            if len(self._issued) >= 256:
                # Callers that wait on each Future themselves (swapped shards and gradients)
                # never call `wait`: forget transfers that ended well so the list stays short.
                self._issued = [f for f in self._issued if not f.done() or f.exception()]
            self._issued.append(future)
        return future

    def wait(self) -> None:
        """Wait for this space's transfers issued since the previous ``wait``; raise the first
        failure among them (`AsyncIOError` naming the file). A shared backend's other users are
        neither waited for nor have their errors taken."""
        with self._lock:
            issued, self._issued = self._issued, []
        errors = [exc for exc in (fut.exception() for fut in issued) if exc is not None]
        if errors:
            raise errors[0]

    def sync(self) -> None:
        """Wait for outstanding transfers, then ``fsync`` every swap file (so their bytes are on
        the device, not in its write cache; benchmarks use it, training does not need it)."""
        self.wait()
        for handle in list(self._handles.values()):
            os.fsync(handle.fd)

    def close(self) -> None:
        """Wait for outstanding transfers, close the files and delete the directory."""
        try:
            self.wait()
        except OSError as exc:  # already reported through the failed transfer's Future
            logger.warning(
                "swap space '%s' closed after a failed transfer: %s", self.directory, exc
            )
        finally:
            self._finalizer()

    @property
    def closed(self) -> bool:
        """True once `close` ran (or the finaliser did)."""
        return not self._finalizer.alive

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SwapBufferPool:
    """A fixed set of ``count`` aligned host buffers of ``numel`` elements of ``dtype``.

    Swapping goes through these buffers so that the host memory used for NVMe traffic is
    ``count * numel * itemsize`` however large the swapped state is. ``acquire`` blocks while
    every buffer is lent out; ``pin_memory`` page-locks them on CUDA machines (ignored on CPU).
    """

    def __init__(
        self, count: int, numel: int, dtype: torch.dtype, *, pin_memory: bool = False
    ) -> None:
        if count <= 0 or numel <= 0:
            raise ValueError(f"SwapBufferPool needs positive count and numel, got {count}, {numel}")
        self.count = count
        self.numel = numel
        self.dtype = dtype
        self._buffers = [aligned_empty(numel, dtype, pin_memory=pin_memory) for _ in range(count)]
        self._free = list(range(count))
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool holds."""
        return sum(padded_nbytes(b.nbytes) + ALIGNMENT for b in self._buffers)

    @property
    def available(self) -> int:
        """Buffers not lent out right now."""
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        """Lend a buffer, waiting up to ``timeout`` seconds (None: forever) for one to be free.
        Raises TimeoutError when none became free in time."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                raise TimeoutError(f"no free buffer among {self.count} within {timeout} s")
            return self._buffers[self._free.pop()]

    def release(self, buffer: torch.Tensor) -> None:
        """Give back a buffer obtained from `acquire` (any other tensor is a ValueError)."""
        for index, own in enumerate(self._buffers):
            if own.data_ptr() == buffer.data_ptr() and own.numel() == buffer.numel():
                with self._cond:
                    if index in self._free:
                        raise ValueError("buffer released twice")
                    self._free.append(index)
                    self._cond.notify()
                return
        raise ValueError("tensor does not belong to this SwapBufferPool")

    @contextlib.contextmanager
    def borrow(self, timeout: float | None = None) -> Iterator[torch.Tensor]:
        """``with pool.borrow() as buf:`` - `acquire` and, whatever happens, `release`."""
        buffer = self.acquire(timeout)
        try:
            yield buffer
        finally:
            self.release(buffer)
