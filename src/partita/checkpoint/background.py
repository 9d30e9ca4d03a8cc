"""Asynchronous saves: the write, fsync and commit of a checkpoint on a background thread.

[Note: asynchronous saves]
``save_checkpoint(..., async_save=True)`` runs a save's first phases (arrival, tag, staging
folder) as usual, copies this rank's states to host memory (the only stall), and hands the
rest (write the shard file, fsync, report, rank 0's manifest and commit, `latest`) to a
writer thread, which agrees with the other ranks' writer threads over a process group of its
own (`writer_group`), so its collectives never interleave with training's. `latest` moves only
after the commit, so a process killed meanwhile leaves the previous checkpoint loadable.

The next `save_checkpoint`, `load_checkpoint` and ``Engine.destroy`` wait for the writer
(`wait_for`); so does process exit (the writer is not a daemon thread). A failure is agreed by
the writers (each phase is a `gather_agreed`, and a last exchange carries every rank's error),
so every rank holds the same error naming the file; it is raised by those calls, or by
``Engine.step`` (`at_step`) at one micro step every rank agrees on:

The writers' last exchange also carries each rank's micro-step count, read just before it
(under `_Job.lock`); the report step is their maximum + 2. A rank's `at_step` waits for the
exchange once its count reaches its own read value + 2, so no rank passes the report step
without knowing it, and ranks are never more than one step apart (every step has collectives);
so every rank finishes the same step, then raises, and none is left waiting in a collective.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from partita import comm
from partita.checkpoint.arrival import WHOLE_JOB
from partita.checkpoint.manifest import CheckpointError
from partita.checkpoint.subject import CheckpointSubject

logger = logging.getLogger("partita")
REPORT_DELAY = 2
"""Micro steps after the largest step count the writers saw at which a failure is raised."""


@dataclass
class _Job:
    """One background save of one engine."""

    what: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    seen: int | None = None
    """This rank's micro-step count when its writer reached the last exchange."""
    report_at: int = 0
    error: CheckpointError | None = None
    thread: threading.Thread | None = None


_jobs: weakref.WeakKeyDictionary[Any, _Job] = weakref.WeakKeyDictionary()
_group: dict[str, Any] = {}


def writer_group() -> comm.ProcessGroup | None:
    """The process group background writers agree over (all ranks of the job, created on the
    first asynchronous save: every rank must be in that save, which the arrival phase has
    checked). One job-wide group is cached; a new one replaces it after the default group was
    re-created."""
    if comm.get_world_size(WHOLE_JOB) == 1:
        return WHOLE_JOB
    group = _group.get("writers")
    if group is not None:
        try:
            if comm.get_world_size(group) == comm.get_world_size(WHOLE_JOB):
                return group
        except (RuntimeError, ValueError):  # a group of a destroyed default group
            pass
    group = comm.new_group(list(range(comm.get_world_size(WHOLE_JOB))))
    _group["writers"] = group
    return group


def start(engine: CheckpointSubject, what: str, work: Callable[[], None], group: Any) -> None:
    """Runs `work` (the rest of a save, its collectives over `group`) on a writer thread; its
    outcome is reported as the module note says. `what` names the checkpoint in messages."""
    job = _Job(what)

    def run() -> None:
        error = None
        try:
            work()
        except Exception as e:  # reported on every rank, see the module note
            error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        _finish(engine, job, error, group)

    job.thread = threading.Thread(target=run, name=f"partita-save {what}", daemon=False)
    _jobs[engine] = job
    job.thread.start()


def _finish(engine: CheckpointSubject, job: _Job, error: str | None, group: Any) -> None:
    """The writers' last exchange: every rank's error and micro-step count."""
    with job.lock:
        job.seen = engine.micro_steps
    try:
        gathered = comm.all_gather_object((job.seen, error), group=group)
        errors = list(dict.fromkeys(e for _, e in gathered if e))  # the same text once
        job.report_at = max(s for s, _ in gathered) + REPORT_DELAY
    except Exception as e:  # a peer died: report here, at once
        errors = [error or "", f"the other ranks' outcome is unknown ({type(e).__name__}: {e})"]
        job.report_at = job.seen
    if any(errors):
        text = "; ".join(e for e in errors if e)
        job.error = CheckpointError(f"asynchronous save of {job.what} failed: {text}")
        logger.error("%s", job.error)
    job.done.set()


def at_step(engine: CheckpointSubject) -> None:
    """Called by ``Engine.step`` after counting the micro step: raises a background save's
    failure at the agreed step, or forgets a finished save (see the module note)."""
    job = _jobs.get(engine)
    if job is None:
        return
    if not job.done.is_set():
        with job.lock:
            seen = job.seen
        if seen is None or engine.micro_steps < seen + REPORT_DELAY:
            return
        job.done.wait()  # the last exchange is under way: every writer is at it or near
    if engine.micro_steps >= job.report_at:
        _reap(engine, job)


def wait_for(engine: CheckpointSubject) -> None:
    """Waits for `engine`'s background save, if any; raises its failure (on every rank: the
    writers agreed on it). Called by save, load and ``Engine.destroy``."""
    job = _jobs.get(engine)
    if job is not None:
        _reap(engine, job)


def pending(engine: CheckpointSubject) -> bool:
    """True while `engine` has a background save not yet waited for."""
    return engine in _jobs


def _reap(engine: CheckpointSubject, job: _Job) -> None:
    _jobs.pop(engine, None)
    assert job.thread is not None
    job.thread.join()
    if job.error is not None:
        raise job.error


__all__ = ["REPORT_DELAY", "at_step", "pending", "start", "wait_for", "writer_group"]
