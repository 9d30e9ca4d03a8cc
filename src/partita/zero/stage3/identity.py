"""Every ZeRO-3 collective carries the identity of what it moves, checked on every rank.

[Note: rank divergence]
ZeRO-3 pairs collectives by their order alone: rank 0's n-th all-gather meets rank 1's n-th.
When ranks run different modules (a vision tower only on batches with images, generation that
stops at different lengths) the n-th gathers are for different units: with equal shard sizes
two units are silently exchanged; with different ones gloo aborts the process on one rank while
the other trains on garbage, and NCCL waits until the process-group timeout (DeepSpeed's
classic 30-minute hang).

So before each unit's all-gather and each unit's gradient reduce-scatter (or once for a
window of them on the schedule: [Note: identity windows]), and once at the end of every
backward, the ranks all-gather a 5-integer identity: (what, unit index, step, number of the
collective in the pass, where the rank left a window). It is the same size on every rank, so
it always pairs with the other ranks' identity exchange; every rank receives the same table and, when its rows
differ, every rank raises `RankDivergenceError` naming each rank's unit and step, before it
uses any data the mismatched collective moved and before a collective of a size the other
ranks do not expect is issued (see below). The end-of-backward identity catches a rank that
has finished its work while another still gathers: it meets the other rank's gather. The
exchange is a few bytes on the host (a gloo group beside NCCL, so it never waits for the
device's stream); ``zero_optimization.stage3_check_divergence`` false turns it off. After the
error the process group may hold a collective that nobody will complete: start a new job.

[Note: asynchronous identities]
Waiting for each exchange before its collective would make every prefetch and every
reduce-scatter launch a meeting point of the ranks, and on a loaded machine a rank would then
often wait for its peer's scheduler (measured: step time +6.6% on 2 shared CPU cores under
load). So the wait happens only off the beaten path. Every backward pass ends with verified
identities, so the sequence of (what, unit) of the last pass, the schedule, is the same on
every rank. A collective at the position the schedule predicts starts its identity exchange and
its data collective at once; `check` returns the collective's ticket (its place in this rank's
order of exchanges), and before this rank waits for that collective it verifies
(`flush(ticket)`) the identity of that collective and of every collective started before it,
not of those started after it. Verifying those too (a prefetch issued since, a reduce-scatter
launched since) would make the ranks meet at the latest collective either has started instead
of at the one this rank needs: one more meeting per unit in every backward, where a
reduce-scatter is launched between a gather's start and its wait (with that rule the check cost
1.05-1.06 times the step time on an idle machine: bench_zero --check_pair, 23M GPT-2, 2 ranks).
A collective off the schedule verifies every started identity, then waits for its own before
its data is issued; the end-of-backward identity is never on the schedule, so it verifies all
of them before the step.

This is safe. Identities are all the same size, and the data collectives between them are
those of the units they name, so when identity k and all before it matched on every rank,
every rank issued collective k for the same unit (the same sizes) after the same collectives:
waiting for it completes, and its data is that unit's. Two ranks that both follow the schedule
issue the same unit's collective; a rank that leaves it meets the other's identity exchange
with its own, raises, and issues no data. The other sees the same table: it raises when it
verifies that identity, when it waits for that collective or a later one or, at the latest, at
its end-of-backward exchange; until then it waits only for collectives whose identities
matched, which the raising rank had issued. Only the first pass, and a pass after a change of
the order, wait.

[Note: identity windows]
One exchange per collective made every checked step on 2 shared CPU cores 1-5% slower (31 of
them a step for the 23M GPT-2: posting one costs about what posting a data collective does,
0.3-4 ms there). So one exchange covers a window: a collective on the schedule that starts no
window of its own opens one over the next `WINDOW` collectives of the schedule, and the
collectives inside it exchange nothing (their ticket is the window's). Entering a window binds
the rank: it issues every collective of the window. A rank whose next collective inside a
window is not the scheduled one leaves it: it issues the window's remaining collectives for the
units the schedule names (`fulfil`: a gather of its real shard, a reduce-scatter of zeros,
into scratch buffers, nothing kept) and waits for them, then exchanges its own identity
synchronously, marked with the position where it left. The other ranks, which follow the
schedule, get the same units' collectives they issue, so none of them hangs and no two units
are paired; at the window's end they exchange their next identity, which meets the marked
one: every rank raises, before any optimizer step uses what the window reduced (its data came
from the schedule's units, and zeros are no rank's gradients). Ranks that leave the same
window at the same position for the same collective match and go on, as before. A rank thus
learns of a divergence within WINDOW collectives of its peers, not at the very collective.
Windows open only when the last two passes ran the same collectives: an order that changes
on every rank (the first step records without prefetch, the second prefetches) costs the
exchanges of the first pass again, not a window of redundant collectives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from partita import comm

GATHER, REDUCE, END = 1, 2, 3
WINDOW = 16
"""Most collectives one identity exchange covers on the schedule ([Note: identity windows]):
16 makes 3 exchanges a step of the 23M GPT-2's 31 collectives; a divergence is found when the
other ranks reach the window's end."""
_WHAT = {GATHER: "gathers", REDUCE: "reduce-scatters the gradients of", END: "ends its backward"}


_ROW = 5
"""An identity: what, unit, step, position in the pass, position where the rank left a window
(-1: it did not)."""


class RankDivergenceError(RuntimeError):
    """Ranks reached different ZeRO-3 collectives (see [Note: rank divergence])."""


class DivergenceCheck:
    """The identity exchange of one strategy's units over its data-parallel group."""

    def __init__(
        self, names: list[str], group: comm.ProcessGroup | None, enabled: bool = True
    ) -> None:
        self.names = names
        """Unit names by index (the same on every rank: units are built in module order)."""
        self.world = comm.get_world_size(group)
        self.enabled = enabled and self.world > 1 and comm.is_initialized()
        self.group = _host_group(group) if self.enabled else None
        self.step = 0
        self.checks = 0
        """Identity exchanges so far (instrumentation for tests and benchmarks)."""
        self.fulfil: Callable[[int, int], list[comm.Work]] | None = None
        """Issues unit `unit`'s collective `what` without using it, returning its handles (set
        by the strategy); None: every collective exchanges its own identity ([Note: identity
        windows])."""
        self.schedule: list[tuple[int, int]] = []
        """(what, unit) of each collective of the last backward pass, identical on every rank
        (every one was verified by its end): see [Note: asynchronous identities]."""
        self._current: list[tuple[int, int]] = []
        self._window_end = 0
        """Positions of this pass before it are covered by the identity `_window_ticket`."""
        self._window_ticket = -1
        self._stable = False
        """Whether the last two passes ran the same collectives: windows open only then."""
        self._started = 0
        """Identity exchanges started (never reset): the next one's ticket."""
        self._pending: deque[tuple[int, torch.Tensor, comm.Work | None]] = deque()
        """(ticket, table, handle) of the exchanges not verified yet, oldest first."""

    def check(self, what: int, unit: int = -1) -> int:
        """Exchanges this rank's identity for its next collective, before the collective is
        issued; raises on a mismatch. On the last pass's schedule the exchange only starts
        here, or was started by the window's first collective, and is verified by `flush`
        ([Note: asynchronous identities], [Note: identity windows]). Returns the
        collective's ticket: pass it to `flush` before waiting for the collective."""
        key = (what, unit)
        pos, left = len(self._current), -1
        if self.enabled and pos < self._window_end:
            if self.schedule[pos] == key:
                self._current.append(key)
                return self._window_ticket
            left = pos
            self._leave_window(pos)
            pos = len(self._current)
        on_schedule = left < 0 and what != END and self.schedule[pos : pos + 1] == [key]
        self._current.append(key)  # recorded even when off, so a benchmark may toggle it
        if self.enabled:
            self._exchange(key, pos, on_schedule, left)
        if what == END:  # also when off: the pass's record must not grow step after step
            self._stable = self._current[:-1] == self.schedule
            self.schedule, self._current, self._window_end = self._current[:-1], [], 0
        return self._started - 1  # off: no exchange, and a flush up to it verifies all

    def _leave_window(self, pos: int) -> None:
        """Issues the window's collectives from `pos` on for the scheduled units, waiting for
        each (one unit's scratch at a time): the other ranks' collectives complete ([Note:
        identity windows])."""
        assert self.fulfil is not None
        for what, unit in self.schedule[pos : self._window_end]:
            for work in self.fulfil(what, unit):
                work.wait()
            self._current.append((what, unit))

    def _exchange(self, key: tuple[int, int], pos: int, on_schedule: bool, left: int) -> None:
        if not on_schedule:
            self.flush()
        # A rank that left a window names the collective it wanted where it left.
        mine = torch.tensor([*key, self.step, pos if left < 0 else left, left], dtype=torch.int64)
        self.checks += 1
        table = torch.empty(self.world * _ROW, dtype=torch.int64)
        handle = comm.all_gather(
            table, mine, group=self.group, async_op=on_schedule, tag="identity"
        )
        self._pending.append((self._started, table, handle))
        self._window_ticket = self._started
        self._window_end = pos + 1
        if on_schedule and self.fulfil is not None and self._stable:
            self._window_end = min(len(self.schedule), pos + WINDOW)
        self._started += 1
        if not on_schedule:
            self.flush()

    def flush(self, ticket: int | None = None) -> None:
        """Verifies the identity exchanges started up to and including `ticket` (a `check`'s
        return; None: all of them). Call it with a collective's ticket before waiting for
        that collective. Raises `RankDivergenceError` on a mismatch."""
        while self._pending and (ticket is None or self._pending[0][0] <= ticket):
            _, table, handle = self._pending.popleft()
            if handle is not None:
                handle.wait()
            rows = table.view(self.world, _ROW)
            if not bool((rows == rows[0]).all()):
                self._pending.clear()
                raise RankDivergenceError(self._message(rows.tolist()))

    def next_step(self) -> None:
        """An optimizer step was taken: identities name the next step."""
        self.step += 1

    def _describe(self, row: list[int], left: int) -> str:
        what, unit, step, seq, _ = row
        if row[4] < 0 <= left:  # it followed the schedule where another rank left it
            (what, unit), seq = self.schedule[left], left
        target = "" if what == END else f" unit {self.names[unit]!r}"
        return f"{_WHAT[what]}{target} (step {step}, collective #{seq} of the pass)"

    def _message(self, rows: list[list[int]]) -> str:
        left = min((row[4] for row in rows if row[4] >= 0), default=-1)
        ranks = "; ".join(f"rank {r} {self._describe(row, left)}" for r, row in enumerate(rows))
        steps = sorted({row[2] for row in rows})
        at = f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))
        return (
            f"ZeRO-3 ranks diverged at {at}: {ranks}. Every rank must gather the same units "
            "in the same order. A module that runs on some ranks only (a vision tower used "
            "with images, ...) must be declared so that it is gathered with its parent on "
            'every rank: zero_optimization.leaf_module {"names": [...]} or '
            "deepspeed.utils.set_z3_leaf_modules(model, [its class])."
        )


def _host_group(group: comm.ProcessGroup | None) -> comm.ProcessGroup | None:
    """`group` when it runs on the host (gloo); else a gloo group of the same ranks, so the
    check's round-trip never waits for the device's stream."""
    if comm.get_backend(group) == "gloo":
        return group
    ranks = [comm.get_global_rank(group, r) for r in range(comm.get_world_size(group))]
    return comm.new_group(ranks, backend="gloo")
