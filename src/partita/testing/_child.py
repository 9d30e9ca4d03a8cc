"""The rank side of the multi-process harness: what each spawned process runs.

A rank process talks to the parent only through files in the run's temporary directory (see
`RunFiles`): a ready marker once its process group is up, a pickled result or an error report
when it ends, and a stack file that faulthandler writes into when the parent sends SIGUSR1.
Files rather than a multiprocessing queue: a queue's feeder thread can block a rank's exit on a
large result, and a rank killed mid-write must not corrupt what the others report.

This module must not import torch at its top: the spawned interpreter imports it before the
stack-dump handler is installed, and torch's import is the slowest part of start-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, TextIO

_PR_SET_PDEATHSIG = 1

# Kept referenced for the life of the process: faulthandler writes to its file descriptor.
_stack_file: TextIO | None = None


@dataclass(frozen=True)
class RunFiles:
    """Where one run's ranks and parent exchange state (all under `run_dir`)."""

    run_dir: str

    @property
    def store(self) -> str:
        """The FileStore file used for the process-group rendezvous."""
        return os.path.join(self.run_dir, "store")

    def ready(self, rank: int) -> str:
        """Marker written once `rank`'s process group exists."""
        return os.path.join(self.run_dir, f"ready.{rank}")

    def result(self, rank: int) -> str:
        """Pickled return value of `rank`."""
        return os.path.join(self.run_dir, f"result.{rank}.pkl")

    def error(self, rank: int) -> str:
        """JSON error report (traceback text and time) of `rank`."""
        return os.path.join(self.run_dir, f"error.{rank}.json")

    def stack(self, rank: int) -> str:
        """File faulthandler writes `rank`'s thread stacks into."""
        return os.path.join(self.run_dir, f"stack.{rank}.txt")

    def case_result(self, case: int, rank: int) -> str:
        """Pickled result of grid case `case` on `rank` (written as each case completes)."""
        return os.path.join(self.run_dir, f"case.{case}.{rank}.pkl")


@dataclass(frozen=True)
class ChildSpec:
    """Everything one rank process needs, sent to it at spawn (plain data: cheap to unpickle)."""

    rank: int
    world_size: int
    run_dir: str
    payload: bytes
    """pickle of (fn, args, kwargs); unpickled only after the stack-dump handler is installed."""
    env: dict[str, str]
    """The rank's whole environment (it replaces what the process started with)."""
    num_threads: int
    pg_timeout_s: float
    parent_pid: int
    """The rank's parent: the harness process, or its fork server (`partita.testing._start`)."""
    stdio: Any = None
    """`_start.InheritedStdio` of the harness process (on the rank's side: what `install`s it)."""


def write_atomic(path: str, data: bytes) -> None:
    """Writes `data` to `path` so that a reader sees either nothing or all of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def child_main(spec: ChildSpec) -> None:
    """Entry point of a rank process: set up, run the function, report, exit."""
    global _stack_file
    if spec.stdio is not None:
        spec.stdio.install()
    files = RunFiles(spec.run_dir)
    # Own session: the parent can kill this rank and anything it started with one killpg, even
    # after this process itself has exited.
    with contextlib.suppress(OSError):
        os.setsid()
    _stack_file = open(files.stack(spec.rank), "w")  # noqa: SIM115 (must stay open)
    faulthandler.enable(file=_stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    _die_with_parent(spec.parent_pid)
    # Replaced, not updated: a rank forked from the fork server must not keep the server's
    # environment from when it started (an earlier test's variables).
    os.environ.clear()
    os.environ.update(spec.env)
    try:
        result = _run(spec, files)
        data = pickle.dumps(result)
    except BaseException:
        report = {"time": time.time(), "traceback": traceback.format_exc()}
        write_atomic(files.error(spec.rank), json.dumps(report).encode())
        _exit(1)
    write_atomic(files.result(spec.rank), data)
    _exit(0)


def _run(spec: ChildSpec, files: RunFiles) -> Any:
    import torch

    from partita import comm

    # Oversubscribed intra-op threads make a 4-rank test on 2 cores many times slower.
    torch.set_num_threads(spec.num_threads)
    fn, args, kwargs = pickle.loads(spec.payload)
    store = torch.distributed.FileStore(files.store, spec.world_size)
    comm.init_distributed(
        dist_backend="gloo",
        rank=spec.rank,
        world_size=spec.world_size,
        store=store,
        timeout=spec.pg_timeout_s,
    )
    write_atomic(files.ready(spec.rank), b"")
    result = fn(*args, **kwargs)
    comm.destroy_process_group()
    return result


def _exit(code: int) -> None:
    """Exits now: skips atexit handlers and waits on threads the test function left running."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _die_with_parent(parent_pid: int) -> None:
    """Makes this rank end if the parent dies (so a killed pytest leaves no ranks behind)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        _exit(1)
    if not armed:  # not Linux: poll instead
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    _exit(1)
