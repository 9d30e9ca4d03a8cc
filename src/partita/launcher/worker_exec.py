"""Start-up shim of every worker: die with the launcher, then become the worker.

``python -m partita.launcher.worker_exec PROGRAM [ARGS...]`` asks Linux to SIGKILL this
process when its parent dies (``prctl(PR_SET_PDEATHSIG)``) and then ``exec``s PROGRAM, which
keeps that setting. The parent is the ``partita`` launcher itself (torchrun's agent runs inside
it and starts the workers from its main thread), so a launcher killed with SIGKILL, which can
clean nothing up, no longer leaves its workers running under PID 1. The workers run in their
own sessions (the agent starts them so), so nothing else would reach them.

``PARTITA_LAUNCHER_PID`` names the expected parent: if the launcher died before the request
took effect, the shim exits instead of starting an orphan. Elsewhere than Linux the shim only
execs. Imports nothing heavy: it runs once per worker start.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

from partita import env

__all__ = ["main", "set_parent_death_signal"]


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Asks the kernel to send `sig` to this process when its parent dies; False where the
    request does not exist (not Linux) or failed."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def main(argv: Sequence[str]) -> int:
    """Arms the parent-death signal and execs ``argv``; returns only on a usage error."""
    if not argv:
        print("usage: python -m partita.launcher.worker_exec PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    set_parent_death_signal()
    expected = env.launcher_pid()
    if expected and os.getppid() != int(expected):
        print(
            f"partita: launcher (pid {expected}) is gone; not starting {argv[0]}", file=sys.stderr
        )
        return 1
    os.execvp(argv[0], list(argv))
    return 1  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
