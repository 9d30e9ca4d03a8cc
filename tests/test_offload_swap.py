"""partita.offload.swap_space: swap files per rank, bitwise round trips, clean-up on exit and
after a crash, and the bounded buffer pool."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

from partita.offload import (
    ALIGNMENT,
    AsyncIOError,
    FileHandle,
    SwapBufferPool,
    SwapSpace,
    Syscalls,
    ThreadPoolIO,
    is_aligned,
    open_file,
    padded_nbytes,
    remove_stale_swap_dirs,
)
from partita.offload.swap_space import OWNER_FILE, SWAP_DIR_PREFIX


def test_register_swap_out_and_in_is_bitwise(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    specs = {
        "layer.0.exp_avg": (33_333, torch.float32),
        "layer.0/w": (4097, torch.bfloat16),
        "scalar": (1, torch.float64),
    }
    io = ThreadPoolIO(block_size=8 * ALIGNMENT, threads=2)
    with SwapSpace(tmp_path, rank=3, aio=io, run_id="t") as space:
        assert space.directory == tmp_path.resolve() / f"{SWAP_DIR_PREFIX}t-rank3"
        owner = json.loads((space.directory / OWNER_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["rank"] == 3
        sources, futures = {}, []
        for key, (numel, dtype) in specs.items():
            slot = space.register(key, numel, dtype)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            assert (slot.nbytes, slot.file_bytes) == (nbytes, padded_nbytes(nbytes))
            assert slot.path.stat().st_size == slot.file_bytes  # preallocated up front
            sources[key] = torch.randn(numel, generator=gen).to(dtype)
            futures.append(space.swap_out(key, sources[key]))
        assert space.file_bytes == sum(s.file_bytes for s in space.slots.values())
        space.wait()
        for key, src in sources.items():
            out = torch.zeros_like(src)
            space.swap_in(key, out).result()
            assert torch.equal(out, src), key
        # Overwriting a slot replaces its content.
        new = torch.full((33_333,), 7.0)
        space.swap_out("layer.0.exp_avg", new).result()
        out = torch.empty(33_333)
        space.swap_in("layer.0.exp_avg", out).result()
        assert torch.equal(out, new)
        directory = space.directory
    assert not directory.exists()
    # A backend passed in is shared: the space leaves it open.
    assert io.submit_write(_open_scratch(tmp_path), 0, torch.ones(3)).result() == 12
    io.close()


def _open_scratch(tmp_path: Path) -> FileHandle:
    return open_file(tmp_path / "scratch.bin")


def test_bad_keys_and_shapes_name_the_key(tmp_path: Path) -> None:
    space = SwapSpace(tmp_path, rank=0)
    space.register("m", 10, torch.float32)
    with pytest.raises(ValueError, match="'m' is already registered"):
        space.register("m", 10, torch.float32)
    with pytest.raises(KeyError, match="'v' is not registered"):
        space.swap_out("v", torch.zeros(10))
    with pytest.raises(
        ValueError, match=r"swap_in 'm': slot holds 10 x torch.float32, tensor is 11 x"
    ):
        space.swap_in("m", torch.zeros(11))
    with pytest.raises(
        ValueError, match=r"slot holds 10 x torch\.float32, tensor is 10 x torch\.float16"
    ):
        space.swap_out("m", torch.zeros(10, dtype=torch.float16))
    space.close()
    assert space.closed and not space.directory.exists()
    with pytest.raises(RuntimeError, match="closed"):
        space.register("w", 1, torch.float32)


def _write_owner(directory: Path, **owner: object) -> None:
    directory.mkdir()
    (directory / OWNER_FILE).write_text(json.dumps(owner))
    (directory / "000000-x.swp").write_bytes(b"\0" * 16)


def test_stale_directories_of_dead_or_reused_pids_are_removed(tmp_path: Path) -> None:
    host = socket.gethostname()
    me = psutil.Process()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_owner(tmp_path / f"{SWAP_DIR_PREFIX}dead-rank0", host=host, pid=dead.pid, start_time=1.0)
    _write_owner(
        tmp_path / f"{SWAP_DIR_PREFIX}reused-rank0",
        host=host,
        pid=me.pid,
        start_time=me.create_time() - 100,
    )
    _write_owner(
        tmp_path / f"{SWAP_DIR_PREFIX}live-rank0",
        host=host,
        pid=me.pid,
        start_time=me.create_time(),
    )
    _write_owner(
        tmp_path / f"{SWAP_DIR_PREFIX}other-host-rank0",
        host=host + "-elsewhere",
        pid=dead.pid,
        start_time=1.0,
    )
    (tmp_path / f"{SWAP_DIR_PREFIX}no-owner-rank0").mkdir()
    (tmp_path / "unrelated").mkdir()
    removed = remove_stale_swap_dirs(tmp_path)
    assert sorted(p.name for p in removed) == [
        f"{SWAP_DIR_PREFIX}dead-rank0",
        f"{SWAP_DIR_PREFIX}reused-rank0",
    ]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [
            f"{SWAP_DIR_PREFIX}live-rank0",
            f"{SWAP_DIR_PREFIX}other-host-rank0",
            f"{SWAP_DIR_PREFIX}no-owner-rank0",
            "unrelated",
        ]
    )


# A process that: creates a space in A and writes to it; forks a child that creates a space in
# B and dies without clean-up (a crash); forks a child that exits normally (its exit must not
# delete the parent's A); prints whether A survived that, then exits normally without close().
_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from partita.offload import SwapSpace
    a_root, b_root = sys.argv[1], sys.argv[2]
    space = SwapSpace(a_root, rank=0)
    space.register("w", 1000, torch.float32)
    space.swap_out("w", torch.ones(1000)).result()
    pid = os.fork()
    if pid == 0:
        crashed = SwapSpace(b_root, rank=1)
        crashed.register("w", 10, torch.float32)
        os._exit(1)
    os.waitpid(pid, 0)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    os.waitpid(pid, 0)
    print("A_SURVIVED_CHILD_EXIT", space.directory.exists(), flush=True)
    """
)


def test_cleanup_on_normal_exit_and_after_a_crash(tmp_path: Path) -> None:
    a_root, b_root = tmp_path / "a", tmp_path / "b"
    a_root.mkdir()
    b_root.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(a_root), str(b_root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "A_SURVIVED_CHILD_EXIT True" in proc.stdout
    assert list(a_root.iterdir()) == []  # removed at the interpreter's exit, without close()
    (crashed,) = b_root.iterdir()  # the crashed run's directory is still there ...
    assert crashed.name.startswith(SWAP_DIR_PREFIX) and crashed.name.endswith("-rank1")
    with SwapSpace(b_root, rank=1) as space:  # ... until the next start removes it
        assert [p.name for p in b_root.iterdir()] == [space.directory.name]


def test_buffer_pool_bounds_buffers() -> None:
    pool = SwapBufferPool(2, 1000, torch.float32)
    assert pool.nbytes >= 2 * 4000
    a = pool.acquire()
    with pool.borrow() as b:
        assert is_aligned(a) and is_aligned(b) and a.data_ptr() != b.data_ptr()
        assert pool.available == 0
        with pytest.raises(TimeoutError, match="no free buffer among 2"):
            pool.acquire(timeout=0.01)
    assert pool.available == 1
    pool.release(a)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(a)
    with pytest.raises(ValueError, match="does not belong"):
        pool.release(torch.zeros(1000))


def test_disk_full_during_swap_out_names_the_swap_file(tmp_path: Path) -> None:
    def disk_full(fd: int, bufs: list[memoryview], offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    io = ThreadPoolIO(syscalls=Syscalls(pwritev=disk_full))
    space = SwapSpace(tmp_path, rank=0, aio=io)
    slot = space.register("exp_avg", 5000, torch.float32)
    space.swap_out("exp_avg", torch.ones(5000))
    with pytest.raises(AsyncIOError) as info:
        space.wait()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(slot.path)
    assert f"'{slot.path}'" in str(info.value) and "ENOSPC" in str(info.value)
    space.wait()  # reported once
    space.close()  # still removes the directory
    assert not space.directory.exists()
    io.close()
