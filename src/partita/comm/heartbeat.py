"""Each rank's last collective, and the heartbeat file the launcher's hang watchdog reads.

[Note: hang watchdog]
A rank that stops (SIGSTOP, frozen holding the GIL) or deadlocks outside any collective leaves
the other ranks waiting inside one until the process group's timeout (30 minutes). To notice
it sooner, every collective in `partita.comm` records itself in `LAST_COLLECTIVE` (its name,
number and tag, and since when this rank has been blocked in it), and, when the ``partita``
launcher asked for it (`partita.platform.cluster_env.heartbeat_settings`), a daemon thread
writes that record with a timestamp to ``<dir>/rank<R>.json`` every few seconds. The launcher's watchdog
(`partita.launcher.watchdog`) reads the files: a file that stops changing means a stopped
rank; a rank blocked in a collective for longer than the bound while another rank is in none
means the other rank is stuck outside. Times are ``time.monotonic()``, which on Linux is one
clock for every process of the machine, so the launcher can compare them with its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from partita.platform import cluster_env

__all__ = [
    "LAST_COLLECTIVE",
    "Beat",
    "CollectiveLog",
    "Heartbeat",
    "read_beats",
    "start_heartbeat",
    "stop_heartbeat",
]


@dataclass(frozen=True)
class Beat:
    """One heartbeat of one rank, as written to its file."""

    rank: int
    pid: int
    beat: float
    """``time.monotonic()`` when this heartbeat was written."""
    seq: int
    """Collectives this rank has issued (0: none yet); the last one is ``op`` with ``tag``."""
    op: str
    tag: str
    waiting_since: float | None
    """When this rank started blocking in a collective, or None when it is in none."""
    done_at: float | None
    """When this rank last came out of a collective (None: never)."""


class CollectiveLog:
    """This process's last collective and whether it is blocked in one.

    Written by the thread issuing collectives, read by the heartbeat thread: each field is one
    attribute assignment, which the heartbeat reads whole.
    """

    def __init__(self) -> None:
        self.last: tuple[int, str, str] = (0, "", "")
        self.waiting_since: float | None = None
        self.done_at: float | None = None

    def issued(self, op: str, tag: str) -> None:
        """Counts a collective (``op`` as the caller named it, e.g. ``reduce_scatter``)."""
        self.last = (self.last[0] + 1, op, tag)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Marks this rank as blocked in a collective for the duration of the block."""
        outer = self.waiting_since is None  # a wait inside a wait keeps the first start time
        if outer:
            self.waiting_since = time.monotonic()
        try:
            yield
        finally:
            if outer:
                self.done_at = time.monotonic()
                self.waiting_since = None


LAST_COLLECTIVE = CollectiveLog()
"""The process-wide record every collective in `partita.comm` writes to."""


class Heartbeat:
    """A daemon thread that writes `log` as a `Beat` to ``path`` every ``interval`` seconds."""

    def __init__(self, path: Path, rank: int, interval: float, log: CollectiveLog) -> None:
        self.path = path
        self.rank = rank
        self.interval = interval
        self.log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="partita-heartbeat", daemon=True)

    def beat(self) -> Beat:
        """The current state of this rank (``time.monotonic()`` times, comparable across the
        machine's processes: [Note: hang watchdog])."""
        seq, op, tag = self.log.last
        return Beat(
            rank=self.rank,
            pid=os.getpid(),
            beat=time.monotonic(),
            seq=seq,
            op=op,
            tag=tag,
            waiting_since=self.log.waiting_since,
            done_at=self.log.done_at,
        )

    def write(self) -> None:
        """Writes one heartbeat; a rename, so the watchdog never reads half a file."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self.beat())))
        os.replace(tmp, self.path)

    def start(self) -> None:
        """Writes the first heartbeat now, then one every interval from a daemon thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread and removes the file: a rank that left the process group is not
        hung, whatever it does next."""
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            # A full or vanished disk must not kill training; the watchdog then sees a stale
            # heartbeat and names this rank, which points at the problem too.
            with contextlib.suppress(OSError):
                self.write()


_ACTIVE: Heartbeat | None = None


def start_heartbeat(rank: int) -> None:
    """Starts this rank's heartbeat if the launcher asked for one (idempotent; see [Note: hang
    watchdog])."""
    global _ACTIVE
    settings = cluster_env.heartbeat_settings()
    if settings is None or _ACTIVE is not None:
        return
    path = Path(settings.directory) / f"rank{rank}.json"
    _ACTIVE = Heartbeat(path, rank, settings.interval, LAST_COLLECTIVE)
    _ACTIVE.start()


def stop_heartbeat() -> None:
    """Stops this rank's heartbeat, if one runs."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop()
        _ACTIVE = None


def read_beats(directory: str | os.PathLike[str]) -> list[Beat]:
    """Every rank's latest heartbeat in ``directory`` (files that cannot be read are skipped:
    a rank's file can vanish while the directory is listed)."""
    beats = []
    for path in sorted(Path(directory).glob("rank*.json")):
        try:
            beats.append(Beat(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return beats
