"""Asynchronous file I/O for NVMe offload: a thread pool doing aligned ``preadv``/``pwritev``.

`ThreadPoolIO` is the one backend today; it implements the small `AsyncIO` protocol
(`submit_read`, `submit_write`, `wait`, `close`) so that a GPUDirect Storage backend can drop in
later without its callers changing. Files are opened with `open_file`, which tries ``O_DIRECT``
and falls back to buffered I/O (with a logged note) where the filesystem refuses it.

[Note: direct I/O alignment] With ``O_DIRECT`` the kernel moves bytes straight between the
device and our memory, skipping the page cache (so swap traffic neither doubles memory nor
evicts the training data's pages). It demands that the memory address, the file offset and the
length of every request be multiples of the logical block size; we use `ALIGNMENT` (4096),
which covers every common device. So:

- file offsets passed to ``submit_*`` on a direct handle must be multiples of `ALIGNMENT`
  (swap slots are laid out that way; `padded_nbytes` rounds a size up);
- a request is cut into ``block_size`` chunks (a multiple of `ALIGNMENT`). A chunk whose memory
  is aligned and whose length is a whole number of blocks goes to the kernel as is (zero copy);
  otherwise - the tensor's tail, or a tensor not allocated by `aligned_empty` - it goes through
  a per-thread aligned bounce buffer, padded to a whole block. Padding bytes written to the file
  are zeros; padding read back is dropped. The file region ``[offset, offset +
  padded_nbytes(nbytes))`` therefore belongs to the request.

Buffered handles have no alignment rules: chunks go to the kernel as they are.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

if TYPE_CHECKING:
    from partita.config import AioConfig

__all__ = [
    "ALIGNMENT",
    "AsyncIO",
    "AsyncIOError",
    "FileHandle",
    "Syscalls",
    "ThreadPoolIO",
    "aligned_empty",
    "byte_view",
    "is_aligned",
    "open_file",
    "padded_nbytes",
]

logger = logging.getLogger(__name__)

ALIGNMENT = 4096
"""Byte alignment of memory, file offsets and lengths for ``O_DIRECT`` requests."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)

Op = Literal["read", "write"]


def padded_nbytes(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


def is_aligned(tensor: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """True when the tensor's first byte sits at a multiple of ``alignment``."""
    return tensor.data_ptr() % alignment == 0


def aligned_empty(
    numel: int, dtype: torch.dtype, *, alignment: int = ALIGNMENT, pin_memory: bool = False
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts at a multiple of ``alignment``.

    Over-allocates a byte tensor by ``alignment`` (plus padding to a whole block) and slices it,
    so direct I/O on the result needs no bounce copy except for a partial last block.
    ``pin_memory`` asks for page-locked memory (only meaningful with CUDA; ignored elsewhere).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    pin = pin_memory and torch.cuda.is_available()
    raw = torch.empty(
        padded_nbytes(nbytes, alignment) + alignment, dtype=torch.uint8, pin_memory=pin
    )
    start = (-raw.data_ptr()) % alignment
    # start is a multiple of the itemsize because alignment is, so view(dtype) is legal.
    return raw[start : start + nbytes].view(dtype)


def byte_view(tensor: torch.Tensor, start: int, length: int) -> memoryview:
    """A writable memoryview of ``length`` bytes of ``tensor``'s data from byte ``start``.

    ctypes rather than numpy: every dtype (bf16 included) works, and no copy is made. The caller
    keeps ``tensor`` alive for as long as the view is used.
    """
    buf = (ctypes.c_char * length).from_address(tensor.data_ptr() + start)
    return memoryview(buf).cast("B")


class AsyncIOError(OSError):
    """A failed swap read or write, naming the file, the offset and the OS error.

    Attributes (besides OSError's ``errno``, ``strerror``, ``filename``): ``op`` ("read" or
    "write"), ``offset`` (file byte offset of the failed chunk), ``nbytes`` (its length).
    """

    def __init__(self, op: Op, path: str, offset: int, nbytes: int, err: int, detail: str) -> None:
        super().__init__(err, detail, path)
        self.op = op
        self.offset = offset
        self.nbytes = nbytes

    def __str__(self) -> str:
        name = errno_mod.errorcode.get(self.errno or 0, str(self.errno))
        return (
            f"{self.op} of {self.nbytes} bytes at offset {self.offset} of '{self.filename}' "
            f"failed: [errno {self.errno} {name}] {self.strerror}"
        )


@dataclass
class Syscalls:
    """The OS calls the I/O layer makes; tests replace them to inject faults (ENOSPC, EIO,
    short writes, a filesystem that refuses ``O_DIRECT``)."""

    open: Callable[[str, int, int], int] = os.open
    preadv: Callable[[int, list[memoryview], int], int] = os.preadv
    pwritev: Callable[[int, list[memoryview], int], int] = os.pwritev


@dataclass
class FileHandle:
    """An open swap file: its path, descriptor and whether it was opened with ``O_DIRECT``."""

    path: str
    fd: int
    direct: bool
    closed: bool = field(default=False, init=False)

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if not self.closed:
            self.closed = True
            os.close(self.fd)


def open_file(
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    direct: bool | None = None,
    syscalls: Syscalls | None = None,
) -> FileHandle:
    """Open ``path`` for reading and writing, with ``O_DIRECT`` when possible.

    ``direct``: None tries ``O_DIRECT`` and falls back to buffered I/O, logging a note, when
    the filesystem refuses it (EINVAL); True demands it (the EINVAL propagates); False opens
    buffered.
    """
    sys_ = syscalls or Syscalls()
    name = os.fspath(path)
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
    if direct is not False and _O_DIRECT:
        try:
            return FileHandle(name, sys_.open(name, flags | _O_DIRECT, 0o600), True)
        except OSError as exc:
            if direct or exc.errno != errno_mod.EINVAL:
                raise
            logger.info("'%s' does not support O_DIRECT; using buffered I/O for it", name)
    elif direct and not _O_DIRECT:
        raise OSError(errno_mod.EINVAL, "O_DIRECT is not available on this platform", name)
    return FileHandle(name, sys_.open(name, flags, 0o600), False)


class AsyncIO(Protocol):
    """What offload needs from an asynchronous I/O backend.

    ``submit_*`` queue a transfer between a whole contiguous CPU tensor and the file region
    starting at ``offset`` and return a Future that resolves to the number of bytes moved, or
    raises `AsyncIOError`. The tensor must stay alive and untouched until the Future is done.
    """

    def submit_read(self, handle: FileHandle, offset: int, tensor: torch.Tensor) -> Future[int]:
        """Read ``tensor.nbytes`` bytes at ``offset`` into ``tensor``."""
        ...

    def submit_write(self, handle: FileHandle, offset: int, tensor: torch.Tensor) -> Future[int]:
        """Write ``tensor``'s bytes at ``offset``."""
        ...

    def wait(self) -> None:
        """Block until every submitted request is done; raise the first failure among them."""
        ...

    def close(self) -> None:
        """Finish outstanding requests and release threads and buffers."""
        ...


class _Request:
    """Book-keeping of one submitted request: its stripes left and its first error."""

    def __init__(self, parts: int, on_finish: Callable[[_Request], None]) -> None:
        self.future: Future[int] = Future()
        self.on_finish = on_finish
        self.left = parts
        self.done_bytes = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def part_done(self, nbytes: int, error: BaseException | None) -> None:
        with self.lock:
            self.left -= 1
            self.done_bytes += nbytes
            if error is not None and self.error is None:
                self.error = error
            finished = self.left == 0
        if finished:
            # Book-keeping first, so that whoever wakes on the future sees it done.
            self.on_finish(self)
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.done_bytes)


class ThreadPoolIO:
    """`AsyncIO` on a pool of threads issuing blocking ``preadv``/``pwritev`` calls.

    A request is cut into up to ``threads`` stripes of whole ``block_size`` blocks; each stripe
    is one task that issues one call per block. Each thread has one call in the kernel at a
    time (the calls release the GIL), so the device sees up to ``threads`` concurrent requests
    of ``block_size`` bytes. ``queue_depth`` bounds the tasks queued per thread: ``submit_*``
    blocks while ``threads * queue_depth`` stripes are outstanding, so a producer cannot run
    arbitrarily far ahead of the disk. (libaio's queue depth, requests in flight per thread,
    has no equivalent with blocking calls: raise ``threads`` for more device parallelism.)
    """

    def __init__(
        self,
        *,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        threads: int = 1,
        syscalls: Syscalls | None = None,
    ) -> None:
        if block_size <= 0 or block_size % ALIGNMENT:
            raise ValueError(
                f"block_size must be a positive multiple of {ALIGNMENT}, got {block_size}"
            )
        if queue_depth <= 0 or threads <= 0:
            raise ValueError(
                f"queue_depth and threads must be positive, got {queue_depth}, {threads}"
            )
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = threads
        self.syscalls = syscalls or Syscalls()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="partita-aio")
        self._slots = threading.BoundedSemaphore(threads * queue_depth)
        self._local = threading.local()
        self._pending: set[Future[int]] = set()
        self._failed: list[BaseException] = []  # failures since the last wait()
        self._pending_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(cls, aio: AioConfig, *, syscalls: Syscalls | None = None) -> ThreadPoolIO:
        """A backend sized by the config's ``aio`` section."""
        return cls(
            block_size=aio.block_size,
            queue_depth=aio.queue_depth,
            threads=aio.intra_op_parallelism,
            syscalls=syscalls,
        )

    def submit_read(self, handle: FileHandle, offset: int, tensor: torch.Tensor) -> Future[int]:
        """Read ``tensor.nbytes`` bytes at file ``offset`` into ``tensor`` (see `AsyncIO`)."""
        return self._submit("read", handle, offset, tensor)

    def submit_write(self, handle: FileHandle, offset: int, tensor: torch.Tensor) -> Future[int]:
        """Write ``tensor``'s bytes at file ``offset`` (see `AsyncIO`)."""
        return self._submit("write", handle, offset, tensor)

    def wait(self) -> None:
        """Block until every request submitted so far is done, then raise the first failure
        among the requests that finished since the previous ``wait`` (if any)."""
        with self._pending_lock:
            pending = list(self._pending)
        for fut in pending:
            fut.exception()  # blocks until done; _finish has recorded a failure by then
        with self._pending_lock:
            failed, self._failed = self._failed, []
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Wait for outstanding requests (errors are the callers' to collect) and stop threads."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)

    def __enter__(self) -> ThreadPoolIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, op: Op, handle: FileHandle, offset: int, tensor: torch.Tensor) -> Future[int]:
        self._check(op, handle, offset, tensor)
        nbytes = tensor.nbytes
        stripes = self._stripes(nbytes)
        request = _Request(len(stripes), self._finish)
        if not stripes:
            request.future.set_result(0)
            return request.future
        with self._pending_lock:
            self._pending.add(request.future)
        for start, end in stripes:
            self._slots.acquire()  # the queue-depth bound: blocks while the queue is full
            try:
                self._pool.submit(self._run_stripe, op, handle, offset, tensor, start, end, request)
            except BaseException:
                self._slots.release()
                raise
        return request.future

    def _stripes(self, nbytes: int) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` of a request, one per thread at most, each a whole
        number of blocks but the last. A task per stripe rather than per block keeps the
        per-block cost a syscall, not a trip through the executor's queue."""
        blocks = -(-nbytes // self.block_size)
        if blocks == 0:
            return []
        per = -(-blocks // min(self.threads, blocks)) * self.block_size
        return [(lo, min(lo + per, nbytes)) for lo in range(0, nbytes, per)]

    def _finish(self, request: _Request) -> None:
        with self._pending_lock:
            self._pending.discard(request.future)
            if request.error is not None:
                self._failed.append(request.error)

    def _check(self, op: Op, handle: FileHandle, offset: int, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("ThreadPoolIO is closed")
        if handle.closed:
            raise ValueError(f"{op} on closed file '{handle.path}'")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"{op} of '{handle.path}' needs a contiguous CPU tensor, got device "
                f"{tensor.device} contiguous={tensor.is_contiguous()}"
            )
        if offset < 0 or (handle.direct and offset % ALIGNMENT):  # [Note: direct I/O alignment]
            raise ValueError(
                f"{op} of '{handle.path}' at offset {offset}: direct I/O offsets must be "
                f"non-negative multiples of {ALIGNMENT}"
            )

    def _run_stripe(
        self,
        op: Op,
        handle: FileHandle,
        base: int,
        tensor: torch.Tensor,
        start: int,
        end: int,
        request: _Request,
    ) -> None:
        """Move bytes ``[start, end)`` of ``tensor`` block by block; stop at the first error."""
        moved = 0
        error: BaseException | None = None
        try:
            for lo in range(start, end, self.block_size):
                length = min(self.block_size, end - lo)
                try:
                    moved += self._transfer(op, handle, base + lo, tensor, lo, length)
                except AsyncIOError:
                    raise
                except OSError as exc:
                    strerror = exc.strerror or str(exc)
                    code = exc.errno or errno_mod.EIO
                    raise AsyncIOError(op, handle.path, base + lo, length, code, strerror) from exc
        except BaseException as exc:  # never lose an error in a worker thread
            error = exc
        finally:
            self._slots.release()
        request.part_done(moved, error)

    def _transfer(
        self, op: Op, handle: FileHandle, offset: int, tensor: torch.Tensor, start: int, length: int
    ) -> int:
        """Move one block; returns its length. Direct handles with unaligned memory or a partial
        block go through the thread's bounce buffer (see [Note: direct I/O alignment])."""
        zero_copy = not handle.direct or (
            (tensor.data_ptr() + start) % ALIGNMENT == 0 and length % ALIGNMENT == 0
        )
        if zero_copy:
            self._full(op, handle, offset, byte_view(tensor, start, length))
            return length
        padded = padded_nbytes(length)
        bounce = self._bounce()
        src = tensor.reshape(-1).view(torch.uint8)[start : start + length]
        if op == "write":
            bounce[:length].copy_(src)
            bounce[length:padded].zero_()
            self._full(op, handle, offset, byte_view(bounce, 0, padded))
        else:
            self._full(op, handle, offset, byte_view(bounce, 0, padded))
            src.copy_(bounce[:length])
        return length

    def _bounce(self) -> torch.Tensor:
        buf: torch.Tensor | None = getattr(self._local, "bounce", None)
        if buf is None:
            buf = aligned_empty(self.block_size, torch.uint8)
            self._local.bounce = buf
        return buf

    def _full(self, op: Op, handle: FileHandle, offset: int, view: memoryview) -> None:
        """Issue the call until every byte moved; a call that moves nothing is an error (a
        short write that makes no progress, or a read past the end of the file)."""
        call = self.syscalls.pwritev if op == "write" else self.syscalls.preadv
        done, total = 0, len(view)
        while done < total:
            n = call(handle.fd, [view[done:]], offset + done)
            if n <= 0:
                what = "short write: no progress" if op == "write" else "short read: end of file"
                raise AsyncIOError(
                    op,
                    handle.path,
                    offset,
                    total,
                    errno_mod.EIO,
                    f"{what} after {done} of {total} bytes",
                )
            done += n
