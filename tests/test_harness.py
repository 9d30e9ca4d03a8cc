"""Tests of the multi-process harness (partita.testing): results, failures, hangs, clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from partita import comm
from partita.platform.accelerator import get_accelerator
from partita.platform.env import TEST_START_METHOD
from partita.testing import (
    DistributedTestError,
    DistributedTimeoutError,
    GridCache,
    run_distributed,
    run_python,
    start_process,
)
from partita.testing._start import server_pid
from partita.testing.distributed import execute

# Functions the ranks run: module level, so the spawned processes can unpickle them.


def _whoami_and_sum(numel: int, *, marker: str) -> dict[str, Any]:
    rank = comm.get_rank()
    tensor = torch.full((numel,), float(rank + 1))
    comm.all_reduce(tensor)
    return {
        "env_rank": int(os.environ["RANK"]),
        "rank": rank,
        "world": comm.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
        "backend": comm.get_backend(),
        "device": get_accelerator().device_type,
        "accelerator_env": os.environ["PARTITA_ACCELERATOR"],
        "marker": marker,
        "extra_env": os.environ.get("PARTITA_TEST_EXTRA"),
        "threads": torch.get_num_threads(),
        "sum": tensor.tolist(),
        "all_reduce_bytes": comm.COUNTERS.bytes("all_reduce"),
        "pid": os.getpid(),
    }


def _raise_on_rank_1() -> None:
    # Every rank past gloo's connections first: a rank 2 that exited while rank 1 was still
    # connecting to it failed rank 1 inside the process group's set-up ("Connection closed by
    # peer"), before it could raise (seen once under load, 2026-12-07).
    comm.barrier()
    if comm.get_rank() == 1:
        raise ValueError("boom from rank 1 on purpose")
    if comm.get_rank() == 2:
        os._exit(3)  # dies without an exception
    time.sleep(600)  # rank 0 never finishes on its own: the harness must kill it


def _hang_forever(pid_file: str) -> None:
    if comm.get_rank() == 1:
        # A grandchild: the harness must kill it too.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(pid_file).write_text(str(child.pid))
    time.sleep(600)


def _grid_case(numel: int, fail_on_rank: int | None = None) -> dict[str, Any]:
    if fail_on_rank == comm.get_rank():
        raise RuntimeError(f"case with numel={numel} fails on purpose")
    tensor = torch.arange(numel, dtype=torch.float64) * (comm.get_rank() + 1)
    comm.all_reduce(tensor)
    return {
        "pid": os.getpid(),
        "rank": comm.get_rank(),
        "sum": float(tensor.sum()),
        "bytes": comm.COUNTERS.bytes("all_reduce"),
    }


def _children() -> set[int]:
    """Live descendants of this process, except multiprocessing's resource tracker and the
    harness's fork server (each started once per session by the first run, by design); the
    ranks forked from the server are its children, so they count."""
    server = server_pid()
    return {
        proc.pid
        for proc in psutil.Process().children(recursive=True)
        if proc.pid != server and not any("resource_tracker" in part for part in proc.cmdline())
    }


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order_and_all_reduce(world_size: int) -> None:
    before = _children()
    numel = 5
    results = run_distributed(
        _whoami_and_sum, world_size, numel, marker="kw", env={"PARTITA_TEST_EXTRA": "yes"}
    )
    assert [r["rank"] for r in results] == list(range(world_size))
    assert [r["env_rank"] for r in results] == list(range(world_size))
    assert [r["local_rank"] for r in results] == list(range(world_size))
    expected_sum = world_size * (world_size + 1) / 2
    cpus = len(os.sched_getaffinity(0))
    # The CPUs are shared by the xdist workers running at once, then by the ranks.
    sharing = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    for r in results:
        assert r["world"] == world_size and r["local_world"] == world_size
        assert r["backend"] == "gloo"
        assert r["device"] == "cpu" and r["accelerator_env"] == "cpu"
        assert r["marker"] == "kw" and r["extra_env"] == "yes"
        assert r["threads"] == max(1, cpus // (sharing * world_size))
        assert r["sum"] == [expected_sum] * numel
        assert r["all_reduce_bytes"] == numel * 4  # float32
    assert len({r["pid"] for r in results}) == world_size
    assert _children() <= before


def test_failing_rank_is_named_and_fails_fast() -> None:
    before = _children()
    # Rank 0 sleeps 600 s: only failing fast (not the 60 s timeout) ends it without a
    # DistributedTimeoutError.
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, 3, timeout=60.0)
    err = info.value
    assert not isinstance(err, DistributedTimeoutError)
    assert sorted(err.failed_ranks) == [1, 2]
    message = str(err)
    assert "ValueError: boom from rank 1 on purpose" in message
    assert "rank 2 exited with code 3 without reporting a result" in message
    # Rank 0 was still sleeping: it was stopped, and its stack says where.
    assert "_raise_on_rank_1" in err.reports[0] and "still running" in err.reports[0]
    assert _children() <= before


def test_hang_times_out_with_every_rank_stack(tmp_path: Path) -> None:
    before = _children()
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_forever, 2, str(pid_file), timeout=1.5)
    err = info.value
    assert err.failed_ranks == [0, 1]
    message = str(err)
    assert "timed out after 1.5 s" in message
    for rank in (0, 1):
        assert f"----- rank {rank} was still running" in message
        assert "_hang_forever" in err.reports[rank]
    assert _children() <= before
    assert _is_gone(int(pid_file.read_text())), "the rank's own child survived"


GRID = [{"numel": n} for n in (1, 3, 8, 100, 1000, 7)]
_GRID_PIDS: dict[int, set[int]] = {}


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"numel{c['numel']}")
def test_grid_runs_many_cases_in_one_spawn_shared_by_test_ids(
    distributed_grid: GridCache, case: dict[str, int]
) -> None:
    per_rank = distributed_grid.case(_grid_case, 2, GRID, case)
    n = case["numel"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    for r in per_rank:
        assert r["sum"] == 3 * n * (n - 1) / 2  # (1 + 2) * sum(range(n))
        assert r["bytes"] == n * 8  # counters are reset per case: this case's float64 only
    # Every case, and every test id, saw the same rank processes: one spawn ran them all.
    for rank, result in enumerate(per_rank):
        _GRID_PIDS.setdefault(rank, set()).add(result["pid"])
        assert len(_GRID_PIDS[rank]) == 1, _GRID_PIDS


def test_grid_failure_names_case_keeps_earlier_results_and_skips_later() -> None:
    cache = GridCache()
    cases = [{"numel": 4}, {"numel": 5, "fail_on_rank": 1}, {"numel": 6}]
    assert [r["sum"] for r in cache.case(_grid_case, 2, cases, 0, timeout=60.0)] == [18.0] * 2
    with pytest.raises(DistributedTestError) as info:
        cache.case(_grid_case, 2, cases, 1, timeout=60.0)
    err = info.value
    assert not isinstance(err, DistributedTimeoutError)
    assert str(err).startswith("grid case 1 {'numel': 5, 'fail_on_rank': 1} failed")
    assert err.case_index == 1
    assert err.failed_ranks[0] == 1
    assert "GridCaseError: grid case 1" in err.reports[1]
    assert "fails on purpose" in err.reports[1]
    assert [[r["sum"] for r in row] for row in err.completed_cases] == [[18.0, 18.0]]
    with pytest.raises(DistributedTestError, match="did not run: case 1 failed before it"):
        cache.case(_grid_case, 2, cases, cases[2], timeout=60.0)
    assert cache.spawns == 1


def test_unpicklable_function_is_rejected_before_spawning() -> None:
    before = _children()
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda: None, 2)
    assert _children() == before


@pytest.mark.parametrize(("world_size", "timeout"), [(0, 10.0), (2, 0.0)])
def test_bad_arguments(world_size: int, timeout: float) -> None:
    with pytest.raises(ValueError, match="run_distributed"):
        run_distributed(_grid_case, world_size, timeout=timeout)


def _slowly(value: int) -> int:
    time.sleep(2.0)
    return value


class _SlowToUnpickle:
    """An argument whose unpickling in each rank (part of start-up: before the rendezvous)
    takes 2 s, so start-up outlasts a 0.3 s bound however fast ranks start."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_slowly, (3,))


def test_startup_timeout_dumps_and_kills(tmp_path: Path) -> None:
    before = _children()
    with pytest.raises(DistributedTimeoutError, match=r"start-up exceeded 0.3 s") as info:
        execute(
            _grid_case,
            2,
            (_SlowToUnpickle(),),
            {},
            timeout=60.0,
            env=None,
            run_dir=str(tmp_path),
            startup_timeout=0.3,
        )
    assert info.value.failed_ranks == [0, 1]
    assert set(info.value.reports) == {0, 1}
    assert _children() <= before


def _noop() -> None:
    """A rank that returns at once."""


@pytest.fixture
def started_harness() -> None:
    """One finished run before the test: the fork server (`partita.testing._start`) has
    imported torch, outside the test's own pytest-timeout (``func_only``)."""
    run_distributed(_noop, 2)


# 15 s: the harness's share (three quarters) leaves ranks of a started harness ample time to
# start; what is tested is the mechanism (the pending alarm read and beaten), not a length.
@pytest.mark.timeout(15, func_only=True)
def test_harness_timeout_fires_before_pytests_own(tmp_path: Path, started_harness: None) -> None:
    """A run allowed longer than the test's pytest-timeout (as 300-400 s runs under the
    project's 300 s are) is stopped by the harness first, so every rank's stack is reported;
    pytest-timeout would stop only this process and lose them."""
    before = _children()
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_forever, 2, str(pid_file), timeout=600.0)
    err = info.value
    assert "before pytest's timeout" in str(err)
    assert err.failed_ranks == [0, 1]
    for rank in (0, 1):
        assert "_hang_forever" in err.reports[rank]
    assert _children() <= before
    assert _is_gone(int(pid_file.read_text())), "the rank's own child survived"


@pytest.mark.timeout(5)  # a bare interpreter starts in well under the harness's 3.75 s
def test_run_python_timeout_fires_before_pytests_own() -> None:
    with pytest.raises(AssertionError, match="before pytest's timeout") as info:
        run_python("import time\ndef stuck():\n    time.sleep(600)\nstuck()", timeout=600.0)
    assert "in stuck" in str(info.value)  # the interpreter's stack when it was stopped


def _parent_env_and_output(tag: str) -> dict[str, Any]:
    rank = comm.get_rank()
    print(f"stdout of rank {rank}: {tag}", flush=True)
    print(f"stderr of rank {rank}: {tag}", file=sys.stderr, flush=True)
    names = ("PARTITA_TEST_EARLY", "PARTITA_TEST_LATE", "ATEN_CPU_CAPABILITY")
    return {"ppid": os.getppid(), "env": {name: os.environ.get(name) for name in names}}


def test_ranks_fork_from_one_server_with_the_callers_environment_and_output(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ranks are forked from the harness's fork server (started once, torch imported), yet
    see this process's environment and stdout/stderr as they are at each call, as spawned
    ranks would: not the server's from when it started."""
    monkeypatch.delenv(TEST_START_METHOD.name, raising=False)  # the default start method
    monkeypatch.setenv("PARTITA_TEST_EARLY", "set when the server may start")
    first = run_distributed(_parent_env_and_output, 2, "first")
    server = server_pid()
    assert server is not None and server != os.getpid()
    assert [r["ppid"] for r in first] == [server, server]
    assert all(r["env"]["PARTITA_TEST_EARLY"] == "set when the server may start" for r in first)
    monkeypatch.delenv("PARTITA_TEST_EARLY")
    monkeypatch.setenv("PARTITA_TEST_LATE", "set after the server started")
    second = run_distributed(_parent_env_and_output, 2, "second")
    assert [r["ppid"] for r in second] == [server, server]
    for r in second:
        assert r["env"]["PARTITA_TEST_EARLY"] is None
        assert r["env"]["PARTITA_TEST_LATE"] == "set after the server started"
    out, err = capfd.readouterr()
    for rank in (0, 1):
        for tag in ("first", "second"):
            assert f"stdout of rank {rank}: {tag}" in out
            assert f"stderr of rank {rank}: {tag}" in err


def test_environment_read_at_torch_import_makes_the_run_spawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A variable torch reads when it loads (here ATEN_CPU_CAPABILITY), set otherwise than in
    the fork server, cannot reach a forked rank: that run spawns fresh interpreters."""
    monkeypatch.delenv(TEST_START_METHOD.name, raising=False)
    run_distributed(_noop, 1)  # the server is running, with this process's environment
    value = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    (result,) = run_distributed(_parent_env_and_output, 1, "x", env={"ATEN_CPU_CAPABILITY": value})
    assert result["ppid"] == os.getpid()
    assert result["env"]["ATEN_CPU_CAPABILITY"] == value


def _write_env_and_parent(path: str) -> None:
    print("stdout of a started process", flush=True)
    value = os.environ.get("PARTITA_TEST_LATE")
    Path(path).write_text(f"{value} {os.getppid()} {'torch' in sys.modules}")


def test_start_process_is_started_like_a_rank(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`start_process` (no process group): forked from the fork server, torch imported, with
    this process's environment at the call and its output."""
    monkeypatch.delenv(TEST_START_METHOD.name, raising=False)
    run_distributed(_noop, 1)  # the server is running
    monkeypatch.setenv("PARTITA_TEST_LATE", "late")
    out = tmp_path / "env.txt"
    proc = start_process(_write_env_and_parent, str(out))
    proc.join(60)
    assert proc.exitcode == 0
    assert out.read_text() == f"late {server_pid()} True"
    assert "stdout of a started process" in capfd.readouterr().out


class _Interrupted(BaseException):
    """Stands in for KeyboardInterrupt or a pytest-timeout firing during a run."""


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


def test_interrupted_run_leaves_nothing_running(tmp_path: Path) -> None:
    # SIGUSR2 from a timer thread, not SIGALRM: the harness reads a pending SIGALRM timer as
    # pytest's timeout and would stop the run itself first.
    before = _children()
    previous = signal.signal(signal.SIGUSR2, _interrupt)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR2))
    try:
        timer.start()
        with pytest.raises(_Interrupted):
            run_distributed(_hang_forever, 2, str(tmp_path / "unused.pid"), timeout=60.0)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, previous)
    assert _children() <= before
