"""Runs a function on `world_size` fresh CPU processes joined by a gloo process group.

`run_distributed(fn, world_size, *args, **kwargs)` starts one process per rank (forked from a
fork server that imported torch once, or spawned: `partita.testing._start`), sets the
launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, ...; PARTITA_ACCELERATOR=cpu), creates the
default process group with `partita.comm.init_distributed` over a FileStore in a fresh temporary
directory (no ports, so no port races), calls `fn(*args, **kwargs)` and returns every rank's
return value in rank order.

[Note: failure handling]
- A rank that raises or dies fails the run fast: the others get `FAIL_FAST_GRACE_S` to finish
  or fail on their own (so every rank's own error is reported), then their stacks are dumped
  and they are killed. `DistributedTestError` names the failed ranks, first failure first.
- `timeout` bounds the run once every rank's process group is up; start-up (spawn, imports,
  rendezvous) has its own bound, `STARTUP_TIMEOUT_S`, so a slow import on a loaded machine
  never eats a test's time. On either timeout every live rank's Python stack is dumped
  (faulthandler on SIGUSR1) and the error carries all of them.
- Under pytest-timeout both bounds together end before the test's own timeout would fire
  (`partita.testing.deadline`): that one would kill the ranks without their stacks.
- Every rank runs in its own session; at the end, whatever happened (including an interrupted
  test), each rank's process group and its process tree are killed and reaped. Ranks also
  die with the parent (PR_SET_PDEATHSIG).

Threads: each rank gets `max(1, cpus // world_size)` intra-op threads (cpus = this process's
CPU affinity), so a 4-rank test on a 2-core machine does not oversubscribe the cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from partita.platform import env as env_vars
from partita.testing import deadline
from partita.testing._child import ChildSpec, RunFiles, child_main
from partita.testing._start import InheritedStdio, rank_environ, start_context

STARTUP_TIMEOUT_S = 120.0
"""Bound on spawn + imports + rendezvous, counted apart from a run's `timeout`."""

FAIL_FAST_GRACE_S = 1.0
"""How long the other ranks may run on after the first rank fails before they are killed."""

_POLL_S = 0.05
_STACK_DUMP_WAIT_S = 2.0


class DistributedTestError(RuntimeError):
    """A distributed run failed. `failed_ranks` lists the failed ranks, first failure first;
    `reports` maps every rank to what is known of it (traceback, exit status or stack)."""

    def __init__(self, message: str, failed_ranks: list[int], reports: Mapping[int, str]) -> None:
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)
        self.reports = dict(reports)
        self.case_index: int | None = None
        """Grid runs: index of the case that failed (None when no case had started or failed)."""
        self.completed_cases: list[list[Any]] = []
        """Grid runs: results[case][rank] of the cases every rank finished before the failure."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the error copyable and picklable despite the extra constructor arguments.
        return (type(self), (str(self), self.failed_ranks, self.reports), self.__dict__)


class DistributedTimeoutError(DistributedTestError):
    """A distributed run did not finish in time; `reports` holds every live rank's stack."""


@dataclass
class _RankState:
    """What the parent knows of one rank while supervising."""

    proc: BaseProcess
    failed_at: float | None = None
    """Wall-clock time of the rank's failure (from its report, else when it was seen dead)."""
    stack: str = field(default="")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs `fn(*args, **kwargs)` on `world_size` spawned CPU ranks; returns their results in
    rank order.

    `fn` must be a module-level (picklable) function and its arguments and result picklable.
    `env` adds or overrides environment variables in every rank. `timeout` (seconds) bounds the
    run after start-up; it is also the process group's collective timeout, unless start-up's
    bound is larger. Raises `DistributedTestError` naming the failed ranks with their tracebacks,
    or `DistributedTimeoutError` with every live rank's stack.
    """
    run_dir = tempfile.mkdtemp(prefix="partita-dist-")
    try:
        return execute(fn, world_size, args, kwargs, timeout=timeout, env=env, run_dir=run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def execute(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    timeout: float,
    env: dict[str, str] | None,
    run_dir: str,
    startup_timeout: float | None = None,
    name: str | None = None,
) -> list[Any]:
    """`run_distributed` in a caller-owned `run_dir` (the grid helper reads it on failure).

    `startup_timeout` overrides `STARTUP_TIMEOUT_S`; `name` replaces fn's name in messages.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"run_distributed: timeout must be > 0 seconds, got {timeout}")
    label = f"{name or fn_name(fn)} on world_size={world_size}"
    cap = deadline.budget()
    limit = None if cap is None else time.monotonic() + cap
    payload = _pickle_payload(fn, args, kwargs, label)
    startup = STARTUP_TIMEOUT_S if startup_timeout is None else startup_timeout
    files = RunFiles(run_dir)
    ranks: list[_RankState] = []
    try:
        base_env = rank_environ(_rank_env(world_size, run_dir, env))
        threads = rank_threads(world_size)
        ctx, parent_pid = start_context(base_env)
        # `env` may set LOCAL_WORLD_SIZE to lay the ranks out as several "nodes" of that many
        # consecutive ranks (what the node-aware counters and layouts read).
        node = int(base_env.get("LOCAL_WORLD_SIZE", world_size))
        for rank in range(world_size):
            spec = ChildSpec(
                rank=rank,
                world_size=world_size,
                run_dir=run_dir,
                payload=payload,
                env={**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank % node)},
                num_threads=threads,
                pg_timeout_s=max(timeout, startup),
                parent_pid=parent_pid,
                stdio=InheritedStdio(),
            )
            proc = ctx.Process(target=child_main, args=(spec,), name=f"partita-rank{rank}")
            proc.start()
            ranks.append(_RankState(proc))
        _supervise(ranks, files, (timeout, startup, limit), label)
        return [_load_result(files, rank, label) for rank in range(world_size)]
    finally:
        _kill_all(ranks)


def _pickle_payload(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], label: str
) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_distributed({label}): cannot pickle the function or its arguments for the "
            f"spawned ranks ({type(exc).__name__}: {exc}); fn must be a module-level function "
            "and every argument picklable"
        ) from exc


def rank_threads(world_size: int) -> int:
    """Intra-op threads of each rank of a `world_size` run: this process's CPUs, shared first
    by the test processes running at once (pytest-xdist's workers, ``PYTEST_XDIST_WORKER_COUNT``)
    and then by the run's ranks. More threads than CPUs left OpenMP's threads spinning at
    barriers while descheduled: one world-1 parity grid (12 small cases) took 52 s with 2
    threads and 18 s with 1 while the other worker's ranks held the 2 cores (2026-12-07)."""
    sharing = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    return max(1, _cpu_count() // (sharing * world_size))


def _rank_env(world_size: int, run_dir: str, env: dict[str, str] | None) -> dict[str, str]:
    threads = str(rank_threads(world_size))
    base = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        # The FileStore does the rendezvous; a free port keeps env:// users from colliding.
        "MASTER_PORT": str(_free_port()),
        env_vars.ACCELERATOR.name: "cpu",
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        env_vars.TEST_RUN_DIR.name: run_dir,
    }
    return {**base, **(env or {})}


def _supervise(
    ranks: list[_RankState],
    files: RunFiles,
    bounds: tuple[float, float, float | None],
    label: str,
) -> None:
    """Waits until every rank exits cleanly; raises on the first failure or a timeout.
    ``bounds``: the run's timeout, start-up's, and the monotonic time by which either must
    have been reported to beat pytest's timeout (None: no such limit). See [Note: failure
    handling]."""
    timeout, startup, limit = bounds
    started = time.monotonic()
    deadline: float | None = None
    first_failure: float | None = None
    while True:
        now = time.monotonic()
        codes = [r.proc.exitcode for r in ranks]
        if all(code == 0 for code in codes):
            return
        for rank, state in enumerate(ranks):
            if codes[rank] not in (None, 0) and state.failed_at is None:
                state.failed_at = _failure_time(files, rank)
                first_failure = first_failure or now
        if first_failure is not None:
            if None not in codes or now - first_failure >= FAIL_FAST_GRACE_S:
                raise _failure_error(ranks, files, label)
        elif limit is not None and now > limit:
            phase = "start-up" if deadline is None else f"the run (given {timeout:g} s)"
            what = f"stopped in {phase} after {now - started:.1f} s, before pytest's timeout"
            raise _timeout_error(ranks, files, label, what)
        elif deadline is None:
            if all(os.path.exists(files.ready(rank)) for rank in range(len(ranks))):
                deadline = now + timeout
            elif now - started > startup:
                raise _timeout_error(ranks, files, label, f"start-up exceeded {startup:g} s")
        elif now > deadline:
            raise _timeout_error(ranks, files, label, f"timed out after {timeout:g} s")
        wait([r.proc.sentinel for r in ranks if r.proc.exitcode is None], timeout=_POLL_S)


def _failure_time(files: RunFiles, rank: int) -> float:
    try:
        with open(files.error(rank)) as fh:
            return float(json.load(fh)["time"])
    except (OSError, ValueError, KeyError):
        return time.time()


def _failure_error(ranks: list[_RankState], files: RunFiles, label: str) -> DistributedTestError:
    _dump_stacks(ranks, files)
    failed = sorted(
        (r for r, s in enumerate(ranks) if s.failed_at is not None),
        key=lambda r: (ranks[r].failed_at, r),
    )
    reports = {rank: _describe(rank, state, files) for rank, state in enumerate(ranks)}
    names = ", ".join(str(r) for r in failed)
    head = f"run_distributed({label}): rank{'s' if len(failed) > 1 else ''} {names} failed"
    head += f" (rank {failed[0]} first)" if len(failed) > 1 else ""
    order = failed + [r for r in range(len(ranks)) if r not in failed]
    body = "\n".join(_section(rank, reports[rank]) for rank in order)
    return DistributedTestError(f"{head}\n{body}", failed, reports)


def _timeout_error(
    ranks: list[_RankState], files: RunFiles, label: str, what: str
) -> DistributedTimeoutError:
    live = [rank for rank, state in enumerate(ranks) if state.proc.exitcode is None]
    _dump_stacks(ranks, files)
    reports = {rank: _describe(rank, state, files) for rank, state in enumerate(ranks)}
    head = f"run_distributed({label}): {what}; ranks still running: {live}"
    body = "\n".join(_section(rank, reports[rank]) for rank in range(len(ranks)))
    return DistributedTimeoutError(f"{head}\n{body}", live, reports)


def _dump_stacks(ranks: list[_RankState], files: RunFiles) -> None:
    """Asks every live rank for a faulthandler dump of all its threads and stores the text."""
    sizes: dict[int, int] = {}
    for rank, state in enumerate(ranks):
        if state.proc.exitcode is None and state.proc.pid is not None:
            sizes[rank] = _size(files.stack(rank))
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.proc.pid, signal.SIGUSR1)
    end = time.monotonic() + _STACK_DUMP_WAIT_S
    last: dict[int, int] = {}
    while sizes and time.monotonic() < end:
        time.sleep(_POLL_S)
        now = {rank: _size(files.stack(rank)) for rank in sizes}
        # Done when each rank wrote something (or died) and no file grew since the last look.
        written = all(now[r] > sizes[r] or ranks[r].proc.exitcode is not None for r in sizes)
        if written and now == last:
            break
        last = now
    for rank, offset in sizes.items():
        ranks[rank].stack = _trim_bootstrap(_read(files.stack(rank), offset)) or (
            "(no stack: the rank had not installed its stack-dump handler yet)"
        )


def _trim_bootstrap(stack: str) -> str:
    """Drops multiprocessing's start-up frames, the same in every dump."""
    keep = [
        line
        for line in stack.splitlines()
        if "/multiprocessing/" not in line and not line.strip().startswith('File "<string>"')
    ]
    return "\n".join(keep)


def _describe(rank: int, state: _RankState, files: RunFiles) -> str:
    code = state.proc.exitcode
    if state.stack:
        return f"was still running; its stack when stopped:\n{state.stack}"
    if os.path.exists(files.error(rank)):
        with open(files.error(rank)) as fh:
            return f"raised:\n{json.load(fh)['traceback']}"
    if code == 0:
        return "finished"
    if code is not None and code < 0:
        crash = _read(files.stack(rank), 0)
        how = f"was killed by {signal.Signals(-code).name}"
        return f"{how}; fatal-error dump:\n{crash}" if crash else how
    return f"exited with code {code} without reporting a result (see its stderr)"


def _section(rank: int, report: str) -> str:
    return f"----- rank {rank} {report.rstrip()}"


def _load_result(files: RunFiles, rank: int, label: str) -> Any:
    try:
        with open(files.result(rank), "rb") as fh:
            return pickle.load(fh)
    except Exception as exc:
        raise DistributedTestError(
            f"run_distributed({label}): cannot read rank {rank}'s result "
            f"({type(exc).__name__}: {exc})",
            [rank],
            {rank: str(exc)},
        ) from exc


def _kill_all(ranks: list[_RankState]) -> None:
    """Kills every rank, everything in its session and its process tree; reaps the ranks
    (whatever happened: [Note: failure handling])."""
    descendants: list[psutil.Process] = []
    for state in ranks:
        pid = state.proc.pid
        if pid is None:
            continue
        # Collected before the rank dies: its orphans would be re-parented out of reach.
        with contextlib.suppress(psutil.Error):
            descendants.extend(psutil.Process(pid).children(recursive=True))
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    for proc in descendants:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    for state in ranks:
        if state.proc.pid is not None:
            state.proc.kill()
            state.proc.join(timeout=5)


def fn_name(fn: Callable[..., Any]) -> str:
    """`module.qualname` of a function, for messages."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, offset: int) -> str:
    try:
        with open(path, errors="replace") as fh:
            fh.seek(offset)
            return fh.read().strip()
    except OSError:
        return ""
