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
differ, every rank raises `RankDivergenceError` naming each rank's unit and step, before the
data collective is issued (so a mismatched gather never runs and the process group stays
usable). The end-of-backward identity catches a rank that has finished its work while another
still gathers: it meets the other rank's gather. The check waits for its exchange (a
round-trip of a few bytes, on the host: a gloo group beside NCCL, so it never waits for the
device's stream); ``zero_optimization.stage3_check_divergence`` false turns it off.
"""

from __future__ import annotations

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

    def check(self, what: int, unit: int = -1) -> None:
        """Exchanges this rank's identity for its next collective; raises on a mismatch."""
        if not self.enabled:
            return
        mine = torch.tensor([what, unit, self.step, self.seq], dtype=torch.int64)
        self.seq += 1
        self.checks += 1
        table = torch.empty(self.world * 4, dtype=torch.int64)
        comm.all_gather(table, mine, group=self.group, tag="identity")
        rows = table.view(self.world, 4)
        if not bool((rows == rows[0]).all()):
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
