"""Start-up shim of every worker: die with the launcher, then become the worker.

``python -m partita.launcher.worker_exec PROGRAM [ARGS...]`` asks Linux to SIGKILL this
process when its parent dies (``prctl(PR_SET_PDEATHSIG)``) and then ``exec``s PROGRAM, which
keeps that setting. The parent is the ``partita`` launcher itself (torchrun's agent runs inside
it and starts the workers from its main thread), so a launcher killed with SIGKILL, which can
clean nothing up, no longer leaves its workers running under PID 1. The workers run in their
own sessions (the agent starts them so), so nothing else would reach them.

``python -u -m partita.launcher.worker_exec --run-path SCRIPT [ARGS...]`` (``--run-module
MODULE``) does the same, then runs the Python script in this interpreter, as ``python SCRIPT``
(``python -m MODULE``) would, so that an exception ending it reaches
`partita.launcher.failures.report_failure` (see [Note: failure reports] there).

``PARTITA_LAUNCHER_PID`` names the expected parent: if the launcher died before the request
took effect, the shim exits instead of starting an orphan. Elsewhere than Linux the shim only
execs. Imports nothing heavy: it runs once per worker start.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
from collections.abc import Sequence
from types import TracebackType

from partita.launcher import failures
from partita.platform import env

__all__ = ["RUN_MODULE", "RUN_PATH", "main", "run_python", "set_parent_death_signal"]


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

#: First argument that runs a script path in this interpreter instead of exec'ing a program.
RUN_PATH = "--run-path"
#: First argument that runs a module (``python -m`` style) in this interpreter.
RUN_MODULE = "--run-module"

_USAGE = (
    "usage: python -m partita.launcher.worker_exec PROGRAM [ARGS...]\n"
    f"       python -m partita.launcher.worker_exec {RUN_PATH}|{RUN_MODULE} TARGET [ARGS...]"
)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Asks the kernel to send `sig` to this process when its parent dies; False where the
    request does not exist (not Linux) or failed."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this shim's and runpy's frames, so it reads like the one
    ``python script.py`` prints."""
    while tb is not None and (
        tb.tb_frame.f_globals is globals() or tb.tb_frame.f_globals.get("__name__") == "runpy"
    ):
        tb = tb.tb_next
    return tb


def run_python(target: str, args: Sequence[str], module: bool) -> int:
    """Runs ``target`` (a script path, or a module name when ``module``) as ``__main__`` with
    ``sys.argv = [target, *args]``; returns 0, or the status `report_failure` chose for an
    exception that ended it. ``SystemExit`` and ``KeyboardInterrupt`` pass through unchanged.
    """
    sys.argv = [target, *args]
    try:
        if module:
            # python -m puts the working directory first on sys.path, as `-m` did for this shim.
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            if not sys.flags.safe_path:
                # python SCRIPT puts the script's directory (symlink resolved) first instead.
                sys.path[0] = os.path.dirname(os.path.realpath(target))
            # Absolute, as python SCRIPT makes __main__.__file__ since 3.9.
            runpy.run_path(os.path.abspath(target), run_name="__main__")
    except Exception as exc:
        return failures.report_failure(exc.with_traceback(_script_frames(exc.__traceback__)))
    return 0


def main(argv: Sequence[str]) -> int:
    """Arms the parent-death signal, then runs or execs ``argv``; returns the worker's exit
    status when it ran in this interpreter, else only on a usage error."""
    if not argv or (argv[0] in (RUN_PATH, RUN_MODULE) and len(argv) < 2):
        print(_USAGE, file=sys.stderr)
        return 2
    set_parent_death_signal()
    in_process = argv[0] in (RUN_PATH, RUN_MODULE)
    expected = env.launcher_pid()
    if expected and os.getppid() != int(expected):
        program = argv[1] if in_process else argv[0]
        print(
            f"partita: launcher (pid {expected}) is gone; not starting {program}", file=sys.stderr
        )
        return 1
    if in_process:
        return run_python(argv[1], argv[2:], module=argv[0] == RUN_MODULE)
    os.execvp(argv[0], list(argv))
    return 1  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
