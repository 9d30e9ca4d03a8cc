"""Keeps the harness's own timeouts below the test's pytest-timeout.

pytest-timeout (signal method, its default on Linux; the project sets 300 s) arms the process's
real-time interval timer for each test and, when it fires, fails the test from inside this
process only: the ranks (or the child interpreter) are killed without their stacks. The
harness's own timeout dumps every rank's stack first, so it must fire first. `budget` reads
that pending timer and leaves a margin for the dump and the clean-up; a run asked to last
longer is stopped at the budget instead, and its error says so.

Only the signal method arms a timer this process can read; under pytest-timeout's thread
method (or none) a run keeps the timeout it was given.
"""

from __future__ import annotations

import signal

__all__ = ["MARGIN_S", "budget"]

MARGIN_S = 10.0
"""Time left after the harness's deadline for its stack dumps (up to 2 s), killing and
reaping the ranks, and pytest's report; a quarter of what is left when that is less."""


def budget() -> float | None:
    """Seconds a harness call may take before it must report a timeout itself: the pending
    real-time alarm's remaining time less the margin; None when no alarm is pending."""
    if not hasattr(signal, "getitimer"):  # not POSIX
        return None
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    if left <= 0:
        return None
    return left - min(MARGIN_S, left / 4)
