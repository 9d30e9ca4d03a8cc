"""Every ZeRO-3 collective carries the identity of what it moves, checked on every rank.

[Note: rank divergence]
ZeRO-3 pairs collectives by their order alone: rank 0's n-th all-gather meets rank 1's n-th.
When ranks run different modules (a vision tower only on batches with images, generation that
stops at different lengths) the n-th gathers are for different units: with equal shard sizes
two units are silently exchanged; with different ones gloo aborts the process on one rank while
the other trains on garbage, and NCCL waits until the process-group timeout (DeepSpeed's
classic 30-minute hang).

So before each unit's all-gather and each unit's gradient reduce-scatter, and once at the end
of every backward, the ranks all-gather a 4-integer identity: (what, unit index, step, number
of the collective in the step). It is the same size on every rank, so it always pairs with
the other ranks' identity exchange; every rank receives the same table and, when its rows
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
"""

from __future__ import annotations

from collections import deque

import torch

from partita import comm

GATHER, REDUCE, END = 1, 2, 3
_WHAT = {GATHER: "gathers", REDUCE: "reduce-scatters the gradients of", END: "ends its backward"}


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
        self.seq = 0
        self.checks = 0
        """Identity exchanges so far (instrumentation for tests and benchmarks)."""
        self.schedule: list[tuple[int, int]] = []
        """(what, unit) of each collective of the last backward pass, identical on every rank
        (every one was verified by its end): see [Note: asynchronous identities]."""
        self._current: list[tuple[int, int]] = []
        self._started = 0
        """Identity exchanges started (never reset): the next one's ticket."""
        self._pending: deque[tuple[int, torch.Tensor, comm.Work | None]] = deque()
        """(ticket, table, handle) of the exchanges not verified yet, oldest first."""

    def check(self, what: int, unit: int = -1) -> int:
        """Exchanges this rank's identity for its next collective, before the collective is
        issued; raises on a mismatch. On the last pass's schedule the exchange only starts
        here and is verified by `flush` ([Note: asynchronous identities]). Returns the
        collective's ticket: pass it to `flush` before waiting for the collective."""
        key = (what, unit)
        on_schedule = what != END and self.schedule[
            len(self._current) : len(self._current) + 1
        ] == [key]
        self._current.append(key)  # recorded even when off, so a benchmark may toggle it
        if self.enabled:
            self._exchange(key, on_schedule)
        if what == END:  # also when off: the pass's record must not grow step after step
            self.schedule, self._current = self._current[:-1], []
        return self._started - 1  # off: no exchange, and a flush up to it verifies all

    def _exchange(self, key: tuple[int, int], on_schedule: bool) -> None:
        if not on_schedule:
            self.flush()
        mine = torch.tensor([*key, self.step, self.seq], dtype=torch.int64)
        self.seq += 1
        self.checks += 1
        table = torch.empty(self.world * 4, dtype=torch.int64)
        handle = comm.all_gather(
            table, mine, group=self.group, async_op=on_schedule, tag="identity"
        )
        self._pending.append((self._started, table, handle))
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
            rows = table.view(self.world, 4)
            if not bool((rows == rows[0]).all()):
                self._pending.clear()
                raise RankDivergenceError(self._message(rows.tolist()))

    def next_step(self) -> None:
        """An optimizer step was taken: identities count collectives from zero again."""
        self.step += 1
        self.seq = 0

    def _describe(self, row: list[int]) -> str:
        what, unit, step, seq = row
        target = "" if what == END else f" unit {self.names[unit]!r}"
        return f"{_WHAT[what]}{target} (step {step}, collective #{seq} of the step)"

    def _message(self, rows: list[list[int]]) -> str:
        ranks = "; ".join(f"rank {r} {self._describe(row)}" for r, row in enumerate(rows))
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
