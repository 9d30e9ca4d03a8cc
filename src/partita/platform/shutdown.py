"""One ordered shutdown at interpreter exit: partita's threads, outstanding work, the device,
then the process group.

[Note: ordered shutdown]
A job whose ranks all finished must exit 0 even when the script never calls
``destroy_process_group()`` (DeepSpeed-style scripts do not). Python runs ``atexit`` handlers
while the interpreter is still whole (after joining non-daemon threads: background
checkpoint writers and the NVMe I/O pools are done by then), so the first call that sets up
a process group installs one handler here, and each subsystem registers a stopper under a
`Phase`. At exit the stoppers run phase by phase (in a phase, the last registered first):

1. ``THREADS``: partita's own threads stop and are joined (the heartbeat of the launcher's
   hang watchdog, which also removes its file: a rank that has finished is not hung);
2. ``WORK``: outstanding asynchronous work is waited for (no stopper yet: the work partita
   runs on threads is on non-daemon ones, already joined);
3. ``DEVICE``: the device is synchronized (CUDA; nothing on the CPU);
4. ``PROCESS_GROUP``: the default process group is destroyed if it still exists (a script
   that destroyed it itself is left alone).

Then the handler releases the GIL for a moment, so that a worker thread of torch still
releasing a collective that partita did not issue can finish while the interpreter is
whole (the abort this prevents: [Note: exit abort] in `partita.comm.pins`).

Running twice is running once; a stopper that raises is logged at debug level and the
others still run: nothing here may turn a finished job into a failed one.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Phase", "install", "register", "run", "unregister"]

logger = logging.getLogger(__name__)

GRACE_S = 0.05
"""How long the exit handler releases the GIL after the stoppers: enough for a worker thread
that was about to release a finished collective to do so (a best effort for collectives
partita does not pin; its own need no time)."""


class Phase(enum.IntEnum):
    """When a stopper runs at exit; lower phases first."""

    THREADS = 1
    WORK = 2
    DEVICE = 3
    PROCESS_GROUP = 4


_stoppers: dict[str, tuple[Phase, int, Callable[[], None]]] = {}
_lock = threading.Lock()
_order = 0
_installed = False
_done = False


def register(phase: Phase, name: str, stop: Callable[[], None]) -> None:
    """Runs `stop` at exit in `phase`; a second registration under `name` replaces the first
    (so set-up code that runs again registers once). Installs the exit handler."""
    global _order
    with _lock:
        _order += 1
        _stoppers[name] = (phase, _order, stop)
    install()


def unregister(name: str) -> None:
    """Forgets the stopper registered under `name` (none: nothing happens)."""
    with _lock:
        _stoppers.pop(name, None)


def install() -> None:
    """Registers the exit handler with `atexit` once per process."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    atexit.register(run)


def run() -> None:
    """Runs every stopper once, in phase order (the ``atexit`` handler; callable earlier, e.g.
    by a test). Never raises."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        # Within a phase the latest registered stops first, as atexit itself orders.
        stoppers = sorted(_stoppers.items(), key=lambda kv: (kv[1][0], -kv[1][1]))
    for name, (_, _, stop) in stoppers:
        try:
            stop()
        except BaseException as e:  # exit must go on: see [Note: ordered shutdown]
            logger.debug("partita shutdown: %s failed: %s: %s", name, type(e).__name__, e)
    time.sleep(GRACE_S)
