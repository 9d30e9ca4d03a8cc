"""Multi-process test harness: run a function on N CPU ranks joined by a gloo process group.

- `run_distributed(fn, world_size, *args, timeout=..., env=..., **kwargs)`: per-rank results
  in rank order; fail-fast `DistributedTestError` naming failed ranks with their tracebacks;
  `DistributedTimeoutError` with every live rank's stack on a hang.
- `run_distributed_grid(fn, world_size, cases)`: many `fn(**case)` sub-cases in one spawn.
- `GridCache`: one spawn per grid shared by many pytest test ids (fixture `distributed_grid`).
- `run_python(code, **env)`: ``code`` in a fresh interpreter, its stdout.
- `start_process(target, *args)`: a process started as ranks are (torch already imported when
  it forks from the harness's fork server), for tests that manage their own processes.

Under pytest-timeout every timeout here ends before the test's own (`deadline`), so the
harness, not pytest, reports a hang, with the stacks.

Importing this package does not import torch (the ranks import it after start-up set-up).
"""

from __future__ import annotations

from partita.testing._start import start_process
from partita.testing.distributed import (
    FAIL_FAST_GRACE_S,
    STARTUP_TIMEOUT_S,
    DistributedTestError,
    DistributedTimeoutError,
    rank_threads,
    run_distributed,
)
from partita.testing.grid import GridCache, GridCaseError, run_distributed_grid
from partita.testing.interpreter import run_python

__all__ = [
    "FAIL_FAST_GRACE_S",
    "STARTUP_TIMEOUT_S",
    "DistributedTestError",
    "DistributedTimeoutError",
    "GridCache",
    "GridCaseError",
    "rank_threads",
    "run_distributed",
    "run_distributed_grid",
    "run_python",
    "start_process",
]
