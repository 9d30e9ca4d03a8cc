"""Tensors handed to a collective keep their Python objects until torch's worker lets go.

[Note: exit abort]
The cause of the SIGABRT ("terminate called without an active exception") that sometimes
ended a finished job at exit, seen in a core of a rank: gloo runs each collective on one of
its worker threads (``ProcessGroupGloo::runLoop``), which still holds the finished work, and
with it the work's tensors, for a moment after ``wait()`` returned on the main thread. If the
script has dropped its Python tensor in that moment (a temporary, a view, a copy), the last
reference is gloo's, and releasing it destroys the tensor's Python object from the worker
thread: torch checks ``Py_IsInitialized()``, then takes the GIL. When the main thread begins
finalizing the interpreter in between (the script has just ended), CPython 3.11 ends the
waiting thread with ``pthread_exit``, whose forced unwind meets the ``noexcept`` destructor
``~AsyncWork``: ``std::terminate``. Once the interpreter has marked itself uninitialized,
torch leaks the object instead, so only a release in that narrow window aborts; it is likelier
on a loaded machine, where the worker is descheduled right after finishing.

So every collective in `partita.comm` pins the tensors it passes to torch here, with their
reference counts before the call. A pin is dropped, at a later collective, once the tensor's
count is back to what it was (torch's worker and the work handle let go), so the last
reference is always the main thread's. What is still pinned when the script ends stays
pinned until the interpreter tears its modules down, after it marked itself uninitialized,
where a late release by a worker is a leak, not an abort. Tensors that torch itself creates
(inside ``all_gather_object``) and collectives a script issues on ``torch.distributed``
directly are not covered; `partita.platform.shutdown` gives those a moment at exit.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

__all__ = ["MAX_PINS", "hold", "pinned"]

MAX_PINS = 256
"""Pins kept at most: the oldest goes first (during the run, when dropping it is safe) if a
pinned tensor gained owners and its count never comes back."""

_pins: deque[tuple[torch.Tensor, int]] = deque()
_lock = threading.Lock()  # background checkpoint writers issue collectives too


def _count(t: torch.Tensor) -> int:
    # TensorImpl's reference count: the Python object holds one, each C++ owner (a work's
    # tensor list, an autograd node) one more.
    return int(t._use_count())  # type: ignore[attr-defined]


def hold(*tensors: torch.Tensor) -> None:
    """Pins `tensors` before they go to a collective, and drops the pins of earlier ones that
    torch has let go of (see [Note: exit abort])."""
    with _lock:
        kept = [(t, n) for t, n in _pins if _count(t) > n]
        _pins.clear()
        _pins.extend(kept[-(MAX_PINS - len(tensors)) :] if len(tensors) < MAX_PINS else [])
        _pins.extend((t, _count(t)) for t in tensors)


def pinned() -> int:
    """How many tensors are pinned now (for tests)."""
    with _lock:
        return len(_pins)
