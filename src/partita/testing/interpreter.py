"""A fresh Python interpreter for tests of process-wide, set-once state (an environment
variable read at import, an allocator installed at start-up)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from partita.testing import deadline

_DUMP_WAIT_S = 5.0


def run_python(code: str, *, timeout: float = 120.0, **env: str) -> str:
    """Runs ``code`` with ``python -c`` in this interpreter's environment plus ``env``; returns
    its stripped stdout. A non-zero exit fails with the end of its stderr.

    ``timeout`` is cut to end before a pending pytest-timeout (`partita.testing.deadline`);
    when it passes, the interpreter's Python stack (faulthandler, on SIGABRT) is in the
    failure."""
    cap = deadline.budget()
    limit = timeout if cap is None else max(0.0, min(timeout, cap))
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack
        try:
            out, err = proc.communicate(timeout=_DUMP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        why = f"timed out after {limit:.1f} s"
        if limit < timeout:
            why = f"stopped after {limit:.1f} s (asked: {timeout:g} s), before pytest's timeout"
        raise AssertionError(f"run_python: {why}; its stderr:\n{err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return out.strip()
