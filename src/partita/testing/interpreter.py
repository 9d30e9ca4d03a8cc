"""A fresh Python interpreter for tests of process-wide, set-once state (an environment
variable read at import, an allocator installed at start-up)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_python(code: str, *, timeout: float = 120.0, **env: str) -> str:
    """Runs ``code`` with ``python -c`` in this interpreter's environment plus ``env``; returns
    its stripped stdout. A non-zero exit fails with the end of its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()
