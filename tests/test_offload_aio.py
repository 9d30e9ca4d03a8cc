"""partita.offload.aio: aligned async I/O with O_DIRECT, its buffered fallback, and its errors."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from partita.offload import (
    ALIGNMENT,
    AsyncIOError,
    Syscalls,
    ThreadPoolIO,
    aligned_empty,
    is_aligned,
    open_file,
    padded_nbytes,
    probe_directory,
)

# Odd sizes: under one block, one element past a block, several block_size chunks plus a tail.
CASES = [
    (1, torch.float32),
    (1023, torch.float32),
    (1025, torch.bfloat16),
    (70_001, torch.float32),
    (12_345, torch.int8),
]
BLOCK = 16 * ALIGNMENT  # small, so the larger cases span many chunks


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator, aligned: bool) -> torch.Tensor:
    bits = torch.randint(
        0,
        256,
        (numel * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=gen,
    )
    out = aligned_empty(numel, dtype) if aligned else torch.empty(numel + 1, dtype=dtype)[1:]
    out.view(torch.uint8).copy_(bits)
    return out


def _round_trip(io: ThreadPoolIO, handle_path: Path, direct: bool | None, offset_step: int) -> bool:
    """Write every case (aligned and unaligned memory) at its own offset, read all back and
    compare bytes. Returns whether the file was opened with O_DIRECT."""
    gen = torch.Generator().manual_seed(0)
    handle = open_file(handle_path, direct=direct)
    try:
        written, offset = [], 0
        for numel, dtype in CASES:
            for aligned in (True, False):
                src = _random(numel, dtype, gen, aligned)
                written.append((offset, src, io.submit_write(handle, offset, src)))
                offset += padded_nbytes(src.nbytes) + offset_step
        assert all(fut.result() == src.nbytes for _, src, fut in written)
        reads = []
        for offset, src, _ in written:
            dst = torch.full_like(src, 0) if src.dtype == torch.int8 else torch.zeros_like(src)
            reads.append((src, dst, io.submit_read(handle, offset, dst)))
        io.wait()
        for src, dst, fut in reads:
            assert fut.result() == src.nbytes
            assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
        return handle.direct
    finally:
        handle.close()


def test_round_trip_direct_io_on_disk(tmp_path: Path) -> None:
    if not probe_directory(tmp_path).direct_io:
        pytest.skip(f"{tmp_path} does not support O_DIRECT on this machine")
    with ThreadPoolIO(block_size=BLOCK, queue_depth=4, threads=2) as io:
        assert _round_trip(io, tmp_path / "swap.bin", None, offset_step=0) is True
        # An unaligned offset cannot go to an O_DIRECT file.
        handle = open_file(tmp_path / "other.bin")
        with pytest.raises(ValueError, match="multiples of 4096"):
            io.submit_write(handle, 100, torch.zeros(10))
        handle.close()


def _refuse_direct(path: str, flags: int, mode: int) -> int:
    if flags & getattr(os, "O_DIRECT", 0):
        raise OSError(errno.EINVAL, "Invalid argument", path)
    return os.open(path, flags, mode)


def test_buffered_fallback_when_filesystem_refuses_o_direct(tmp_path: Path) -> None:
    sys_ = Syscalls(open=_refuse_direct)
    handle = open_file(tmp_path / "f.bin", syscalls=sys_)
    assert handle.direct is False
    handle.close()
    with pytest.raises(OSError) as info:
        open_file(tmp_path / "g.bin", direct=True, syscalls=sys_)
    assert info.value.errno == errno.EINVAL
    # Buffered files take any offset: 7 bytes between regions.
    with ThreadPoolIO(block_size=BLOCK, queue_depth=2, threads=2) as io:
        assert _round_trip(io, tmp_path / "h.bin", False, offset_step=7) is False


def test_real_device_refusing_o_direct_falls_back_and_reports_enospc() -> None:
    # /dev/full refuses O_DIRECT (EINVAL at open) and fails every write with ENOSPC.
    handle = open_file("/dev/full", create=False)
    assert handle.direct is False
    with ThreadPoolIO(block_size=BLOCK) as io:
        fut = io.submit_write(handle, 3 * BLOCK, torch.ones(100))
        with pytest.raises(AsyncIOError) as info:
            fut.result()
        with pytest.raises(AsyncIOError):
            io.wait()  # the failure is reported by wait() too
        io.wait()  # ... once
    handle.close()
    err = info.value
    assert err.errno == errno.ENOSPC and err.filename == "/dev/full" and err.op == "write"
    assert f"offset {3 * BLOCK}" in str(err) and "/dev/full" in str(err) and "ENOSPC" in str(err)


def test_many_outstanding_requests_respect_thread_count(tmp_path: Path) -> None:
    active, peak, lock = [0], [0], threading.Lock()

    def slow_pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.002)  # keep calls in the kernel long enough to overlap
        try:
            return os.pwritev(fd, bufs, offset)
        finally:
            with lock:
                active[0] -= 1

    gen = torch.Generator().manual_seed(1)
    with ThreadPoolIO(
        block_size=2 * ALIGNMENT, queue_depth=2, threads=4, syscalls=Syscalls(pwritev=slow_pwritev)
    ) as io:
        handle = open_file(tmp_path / "many.bin")
        tensors = [
            _random(5000 + 37 * i, torch.float32, gen, aligned=i % 2 == 0) for i in range(48)
        ]
        step = padded_nbytes(max(t.nbytes for t in tensors))
        futures = [io.submit_write(handle, i * step, t) for i, t in enumerate(tensors)]
        io.wait()
        assert all(f.done() and f.exception() is None for f in futures)
        outs = [torch.empty_like(t) for t in tensors]
        for i, out in enumerate(outs):
            io.submit_read(handle, i * step, out)
        io.wait()
        handle.close()
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(tensors, outs, strict=True)
    )
    assert 1 < peak[0] <= 4


def test_injected_eio_names_file_offset_and_errno(tmp_path: Path) -> None:
    calls = [0]

    def failing_pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if offset == 2 * BLOCK:  # the third chunk of the request
            raise OSError(errno.EIO, "Input/output error")
        return os.pwritev(fd, bufs, offset)

    path = tmp_path / "eio.bin"
    with ThreadPoolIO(block_size=BLOCK, syscalls=Syscalls(pwritev=failing_pwritev)) as io:
        handle = open_file(path)
        with pytest.raises(AsyncIOError) as info:
            io.submit_write(handle, 0, torch.ones(5 * BLOCK // 4)).result()
        handle.close()
    err = info.value
    assert (err.errno, err.filename, err.offset, err.nbytes) == (
        errno.EIO,
        str(path),
        2 * BLOCK,
        BLOCK,
    )
    assert str(path) in str(err) and f"offset {2 * BLOCK}" in str(err) and "EIO" in str(err)
    assert calls[0] == 3  # one thread, one stripe: it stops at the failed block, and nothing hangs


def test_partial_writes_are_completed_and_no_progress_is_an_error(tmp_path: Path) -> None:
    def page_at_a_time(fd: int, bufs: list[memoryview], offset: int) -> int:
        return os.pwritev(fd, [bufs[0][:ALIGNMENT]], offset)

    src = aligned_empty(3 * BLOCK // 4 + 5, torch.float32)
    src.copy_(torch.arange(src.numel(), dtype=torch.float32))
    with ThreadPoolIO(block_size=BLOCK, syscalls=Syscalls(pwritev=page_at_a_time)) as io:
        handle = open_file(tmp_path / "partial.bin")
        io.submit_write(handle, 0, src).result()
        back = torch.zeros_like(src)
        io.submit_read(handle, 0, back).result()
        assert torch.equal(src, back)
        # Reading beyond the end of the file is a short read, not silent zeros.
        with pytest.raises(AsyncIOError, match="short read") as info:
            io.submit_read(handle, 64 * BLOCK, back).result()
        assert info.value.filename == handle.path
        handle.close()

    with ThreadPoolIO(block_size=BLOCK, syscalls=Syscalls(pwritev=lambda fd, b, o: 0)) as io:
        handle = open_file(tmp_path / "stuck.bin")
        with pytest.raises(AsyncIOError, match="short write") as info:
            io.submit_write(handle, ALIGNMENT, src).result()
        assert info.value.offset == ALIGNMENT and info.value.errno == errno.EIO
        handle.close()


def test_bad_tensors_and_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        ThreadPoolIO(block_size=1000)
    with ThreadPoolIO() as io:
        handle = open_file(tmp_path / "x.bin")
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            io.submit_write(handle, 0, torch.zeros(4, 4).t())
        assert io.submit_write(handle, 0, torch.zeros(0)).result() == 0
        handle.close()
        with pytest.raises(ValueError, match="closed file"):
            io.submit_read(handle, 0, torch.zeros(4))


def test_aligned_empty() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.uint8):
        t = aligned_empty(1001, dtype)
        assert is_aligned(t) and t.numel() == 1001 and t.dtype == dtype and t.is_contiguous()
