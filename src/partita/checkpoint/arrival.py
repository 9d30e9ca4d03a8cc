"""Every rank must call save/load: detecting ranks that did not, and failing together.

[Note: arrival markers]
A collective entered by only some ranks blocks until the process group's timeout and then
fails without saying who is missing. Before its first collective, a checkpoint call therefore
drops an arrival marker ``<dir>/.partita-calls/<op>-<seq>-rankNNNNN`` (seq counts this
process's checkpoint calls, so it agrees across ranks of one job) and waits, polling the
folder, until every rank's marker for the same call is there. After `timeout_s()` it removes its
own marker and raises `CheckpointError` naming the missing ranks; no collective was entered, so
nothing hangs. Each rank removes its marker once a later collective proves every rank has seen
it (`Arrival.depart`). A marker is written under a temporary name carrying the writer's pid
and host, then renamed, so a process killed while writing it leaves a temporary file its name
identifies (removed like a dead process's marker), never an empty marker nobody can claim. Markers left by a killed job (its process is gone) or by this job's
earlier calls are removed by the next save; another live job's markers are left alone. The folder is
the checkpoint directory itself, which every rank must reach anyway; where it cannot be written
(a read-only load directory) the check is skipped and the process group's timeout applies.

[Note: agreeing on failure]
Each phase of a save or load runs in `gather_agreed`: an all-gather of every rank's error (or None).
If any rank failed, every rank raises the same `CheckpointError`, so a corrupt file found by
rank 1 fails rank 0 too, within seconds, instead of leaving it waiting in the next collective.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from partita import comm
from partita.checkpoint.manifest import CheckpointError
from partita.platform import env

CALLS_DIR = ".partita-calls"
TIMEOUT_ENV = env.CHECKPOINT_TIMEOUT.name
_state = {"seq": 0}

WHOLE_JOB: comm.ProcessGroup | None = None
"""The group checkpoint phases agree over: every rank of the job (all replicas), since every
rank must call save and load."""
T = TypeVar("T")


def timeout_s() -> float:
    """Seconds a rank waits for the others to call save/load: ``$PARTITA_CHECKPOINT_TIMEOUT_S``,
    else the process group's default timeout (30 minutes, as DeepSpeed)."""
    try:
        seconds = env.checkpoint_timeout_s()
    except ValueError as exc:  # names the variable and its value
        raise CheckpointError(str(exc)) from None
    return comm.DEFAULT_TIMEOUT.total_seconds() if seconds is None else seconds


_PARTIAL = ".partial-"
"""Infix of a marker being written: ``<marker>.partial-<pid>-<host>``."""


def _marker(folder: str, op: str, seq: int, rank: int) -> str:
    return os.path.join(folder, CALLS_DIR, f"{op}-{seq:08d}-rank{rank:05d}")


class Arrival:
    """This rank's marker for one checkpoint call (see [Note: arrival markers])."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def depart(self) -> None:
        """Removes the marker (call after a collective every rank has passed)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None


def arrive(folder: str, op: str) -> Arrival:
    """Waits until every rank of the job has started the same `op` call on `folder`; raises
    `CheckpointError` naming the (global) ranks that did not within `timeout_s()`."""
    _state["seq"] += 1
    world, rank = comm.get_world_size(WHOLE_JOB), comm.get_rank(WHOLE_JOB)
    if world == 1:
        return Arrival(None)
    seq = _state["seq"]
    mine = _marker(folder, op, seq, rank)
    host, pid = job_member()
    partial = f"{mine}{_PARTIAL}{pid}-{host}"
    try:
        os.makedirs(os.path.dirname(mine), exist_ok=True)
        with open(partial, "w", encoding="utf-8") as f:
            f.write(f"{host} pid {pid}\n")
        os.rename(partial, mine)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        return Arrival(None)
    limit = timeout_s()
    deadline = time.monotonic() + limit
    delay = 0.005
    while True:
        missing = [r for r in range(world) if not os.path.exists(_marker(folder, op, seq, r))]
        if not missing:
            return Arrival(mine)
        if time.monotonic() >= deadline:
            Arrival(mine).depart()
            raise CheckpointError(
                f"{op}_checkpoint({folder!r}): rank(s) {missing} of {world} did not call "
                f"{op}_checkpoint within {limit:g} s (rank {rank} waited; this is checkpoint "
                f"call #{seq} of this process); every rank must call it, with the same "
                f"directory ({TIMEOUT_ENV} sets the wait)"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.1)


def job_member() -> tuple[str, int]:
    """(host, pid) of this process, as its arrival markers record it."""
    return socket.gethostname(), os.getpid()


def remove_stale_markers(folder: str, members: list[tuple[str, int]]) -> None:
    """Removes markers of earlier calls written by this job's ranks (`members`, see
    `job_member`) or by dead processes (killed jobs); rank 0 calls it during a save after every
    rank has arrived. A marker of another live job sharing the folder, or of a process on
    another host that is not one of `members` (liveness unknown), is left alone."""
    calls = os.path.join(folder, CALLS_DIR)
    current = f"-{_state['seq']:08d}-"
    try:
        names = os.listdir(calls)
    except OSError:
        return
    for name in names:
        path = os.path.join(calls, name)
        if current not in name and _removable(path, members):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _writer(marker: str) -> tuple[str, str]:
    """(host, pid) of a marker's writer: from a partial marker's name, else its content;
    raises ValueError or OSError when neither says."""
    name = os.path.basename(marker)
    if _PARTIAL in name:
        pid, _, host = name.split(_PARTIAL, 1)[1].partition("-")
        return host, pid
    with open(marker, encoding="utf-8") as f:
        host, _, pid = f.read().split()
    return host, pid


def _removable(marker: str, members: list[tuple[str, int]]) -> bool:
    """True when `marker` ("<host> pid <pid>", or a partial one named after its writer) was
    written by one of `members` or by a process of this host that no longer exists."""
    try:
        host, pid = _writer(marker)
    except (OSError, ValueError):
        return False
    if not pid.isdigit():
        return False
    if (host, int(pid)) in members:
        return True
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def gather_agreed(fn: Callable[[], T], group: comm.ProcessGroup | None) -> list[T]:
    """Runs `fn` on every rank of `group` and returns every rank's result (rank order); if it
    fails on any rank, every rank raises the same `CheckpointError` (the failing rank chains
    its own exception as the cause). See [Note: agreeing on failure]."""
    try:
        value: T | None = fn()
        error: str | None = None
        cause: BaseException | None = None
    except Exception as e:  # reported to every rank, then raised here with its cause
        value, cause = None, e
        error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    gathered = comm.all_gather_object((error, value), group=group)
    failed = [(r, err) for r, (err, _) in enumerate(gathered) if err]
    if failed:
        text = "; ".join(f"rank {r}: {err}" for r, err in failed[:4])
        more = f" (and {len(failed) - 4} more ranks)" if len(failed) > 4 else ""
        raise CheckpointError(text + more) from cause
    return [v for _, v in gathered]


def run_agreed(fn: Callable[[], T], group: comm.ProcessGroup | None) -> T:
    """`gather_agreed` returning only this rank's result."""
    return gather_agreed(fn, group)[comm.get_rank(group)]


__all__ = [
    "CALLS_DIR",
    "TIMEOUT_ENV",
    "WHOLE_JOB",
    "Arrival",
    "arrive",
    "gather_agreed",
    "job_member",
    "remove_stale_markers",
    "run_agreed",
    "timeout_s",
]
