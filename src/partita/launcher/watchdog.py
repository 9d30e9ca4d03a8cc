"""The launcher's hang watchdog: ends a job whose ranks stopped making progress.

Each rank writes a heartbeat file (`partita.comm.heartbeat`; see [Note: hang watchdog] there).
A thread in the launcher reads them every poll and applies `find_hang`:

1. a rank whose heartbeat is older than the bound is stopped or frozen: it is the culprit;
2. else a rank blocked in one collective for longer than the bound is waiting for a rank that
   never came: the culprits are the ranks of this node that are in no collective (stuck
   outside one), or, when every rank here waits, all of them (the missing rank is elsewhere,
   or the ranks disagree on the order of collectives).

It prints one message naming the culprits and every local rank's last collective, then
SIGKILLs the culprits; torchrun's agent sees a failed worker, stops the others (or restarts
the group under ``--max_restarts``) and the launcher exits non-zero. Ranks that never started
a heartbeat (scripts that do not use partita's process group) are not watched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from partita.comm.heartbeat import Beat, read_beats
from partita.platform.env import DEFAULT_HANG_TIMEOUT, HANG_TIMEOUT
from partita.platform.env import hang_timeout as hang_timeout_from_env

__all__ = [
    "DEFAULT_HANG_TIMEOUT",
    "Hang",
    "Watchdog",
    "find_hang",
    "hang_timeout_from_env",
    "heartbeat_interval",
]


def heartbeat_interval(timeout: float) -> float:
    """Seconds between heartbeats for a bound: a tenth of it, within [0.2, 5] s (a few files
    a second at most, and many beats within any bound)."""
    return min(5.0, max(0.2, timeout / 10))


@dataclass(frozen=True)
class Hang:
    """A hang `find_hang` found: the ranks to stop (and their pids) and what to tell the user."""

    culprits: list[int]
    pids: list[int]
    message: str


def _describe(beat: Beat, now: float, timeout: float) -> str:
    if beat.seq == 0:
        state = "no collective yet"
    else:
        state = f"last collective {beat.op} #{beat.seq} (tag '{beat.tag}')"
    if beat.waiting_since is not None:
        state += f", waiting {now - beat.waiting_since:.1f} s"
    elif beat.done_at is not None:
        state += f", finished {now - beat.done_at:.1f} s ago"
    if now - beat.beat > timeout:
        state += f" (as of its last heartbeat, {now - beat.beat:.1f} s ago)"
    return f"  rank {beat.rank}: {state}"


def _ranks(beats: Sequence[Beat]) -> str:
    return ", ".join(str(b.rank) for b in beats)


def _headline(beats: Sequence[Beat], now: float, timeout: float) -> tuple[list[Beat], str] | None:
    stale = [b for b in beats if now - b.beat > timeout]
    if stale:
        what = "; ".join(
            f"rank {b.rank} (pid {b.pid}) sent no heartbeat for {now - b.beat:.1f} s" for b in stale
        )
        return stale, f"{what} (stopped, or frozen holding the GIL)"
    waiting = [b for b in beats if b.waiting_since is not None and now - b.waiting_since > timeout]
    if not waiting:
        return None
    first = min(waiting, key=lambda b: b.waiting_since or 0.0)
    wait = f"rank {first.rank} has waited {now - (first.waiting_since or now):.1f} s in "
    wait += f"{first.op} #{first.seq} (tag '{first.tag}')"
    outside = [b for b in beats if b.waiting_since is None]
    if outside:
        return outside, f"{wait} while rank(s) {_ranks(outside)} are in no collective"
    return waiting, (
        f"{wait} and no rank on this node is outside a collective: the rank it waits for is on "
        "another node, or the ranks disagree on the order of their collectives"
    )


def find_hang(beats: Sequence[Beat], now: float, timeout: float) -> Hang | None:
    """Applies the watchdog's rules (module docstring; [Note: hang watchdog] in
    `partita.comm.heartbeat`) to this node's heartbeats at ``now``."""
    beats = sorted(beats, key=lambda b: b.rank)
    found = _headline(beats, now, timeout)
    if found is None:
        return None
    culprits, headline = found
    lines = [
        f"partita: hang: {headline}; stopping rank(s) {_ranks(culprits)} "
        f"(hang timeout {timeout:g} s: --hang_timeout or {HANG_TIMEOUT.name}).",
        "Last collective of each rank on this node:",
        *(_describe(b, now, timeout) for b in beats),
    ]
    return Hang([b.rank for b in culprits], [b.pid for b in culprits], "\n".join(lines))


class Watchdog:
    """A daemon thread of the launcher that applies `find_hang` to the heartbeats in
    ``directory`` every ``poll`` seconds and stops the culprits of any hang it finds."""

    def __init__(self, directory: Path, timeout: float, poll: float) -> None:
        self.directory = directory
        self.timeout = timeout
        self.poll = poll
        self.reports: list[str] = []
        self._stopped: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="partita-watchdog", daemon=True)

    def start(self) -> None:
        """Starts watching."""
        self._thread.start()

    def stop(self) -> None:
        """Stops watching (the job is over)."""
        self._stop.set()
        self._thread.join()

    def check(self) -> Hang | None:
        """One poll: finds a hang among this launcher's live workers and stops its culprits."""
        live = _live_descendants() - self._stopped
        beats = [b for b in read_beats(self.directory) if b.pid in live]
        hang = find_hang(beats, time.monotonic(), self.timeout)
        if hang is None:
            return None
        print(hang.message, file=sys.stderr, flush=True)
        self.reports.append(hang.message)
        # The agent now stops (or restarts) the whole group: the survivors, left waiting for
        # the culprits, are not a second hang. Workers of a restart have new pids.
        self._stopped |= live
        for pid in hang.pids:
            # SIGKILL: a stopped rank would not act on SIGTERM until continued.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return hang

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.check()
            except Exception as err:  # the watchdog must never take the launcher down
                print(f"partita: hang watchdog error (ignored): {err!r}", file=sys.stderr)


def _live_descendants() -> set[int]:
    """Pids of this process's running descendants: heartbeats of finished ranks, of an earlier
    restart, or of a recycled pid are not this job's."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids
