"""ZeRO-3's state layout for `partita.zero.state_access.ParamStates`.

A parameter's elements on this rank are pieces of its unit's shard; its master, gradient and
optimizer state are those of its segment's master, which starts at the segment's shard offset.
Masters swapped out to NVMe are read back in before they are read or written, and a written
gradient is stored back. A frozen parameter has no master: its value is read from the unit's
module-dtype shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from partita import comm
from partita.zero.stage3.nvme import SwappedOptimizerState
from partita.zero.stage3.unit import ShardedUnit
from partita.zero.state_access import ParamSlot


@dataclass(frozen=True)
class _Home:
    unit: ShardedUnit
    segment: int
    start: int
    """Offset of the segment (its master's element 0) in the unit's shard."""


class UnitShardLayout:
    """The state layout of stage 3 (see the module docstring)."""

    replicated = False
    shards_params = True

    def __init__(
        self,
        units: list[ShardedUnit],
        optimizer: torch.optim.Optimizer,
        swapped: SwappedOptimizerState | None,
        master_index: dict[int, int],
        process_group: comm.ProcessGroup | None,
        refresh: Callable[[], None],
    ) -> None:
        self.optimizer = optimizer
        self.process_group = process_group
        self._swapped = swapped
        self._master_index = master_index
        self._refresh = refresh
        self._slots: dict[torch.Tensor, ParamSlot] = {}
        for unit in units:
            ranges: list[list[tuple[int, int, int]]] = [[] for _ in unit.params]
            for pc in unit.layout.shard_pieces(unit.rank):
                ranges[pc.index].append((pc.param_offset, pc.shard_offset, pc.length))
            for i, p in enumerate(unit.params):
                seg = unit.segment_of_param(i).index
                master = unit.masters.get(seg)
                start = 0 if master is None else unit.layout.segments[seg].shard_offset
                shifted = [(at, src - start, n) for at, src, n in ranges[i]]
                home = _Home(unit, seg, start)
                # An expert unit is cut over its own (expert-data-parallel) group.
                own = unit.process_group is not process_group
                self._slots[p] = ParamSlot(
                    unit.views[i].shape, shifted, master, home=home,
                    group=unit.process_group, own_group=own,
                )  # fmt: skip

    def clear(self) -> None:
        """Forgets every parameter (the strategy handed them back to the module)."""
        self._slots = {}

    def slot(self, param: torch.Tensor) -> ParamSlot | None:
        """The slot of a parameter of any unit (trainable or frozen)."""
        return self._slots.get(param)

    def _resident_master(self, home: _Home, what: str) -> torch.nn.Parameter | None:
        master = home.unit.masters.get(home.segment)
        if master is not None and self._swapped is not None:
            i = self._master_index[id(master)]
            if what == "grad":
                self._swapped.ensure_grad(i)
            else:
                self._swapped.ensure_resident(i)
        return master

    def source(self, slot: ParamSlot, what: str) -> torch.Tensor | None:
        """The segment's master, its gradient or optimizer state; a frozen parameter's value
        is its unit's shard."""
        home: _Home = slot.home
        master = self._resident_master(home, what)
        if master is None:
            if what != "param":
                return None
            home.unit.ensure_shard()
            return home.unit.flat_shard
        if what == "param":
            return master
        if what == "grad":
            return master.grad
        return self.optimizer.state.get(master, {}).get(what)

    def after_write(
        self, param: torch.Tensor, slot: ParamSlot, what: str, full: torch.Tensor | None
    ) -> None:
        """A new value is cast into the module-dtype shard (the next gather sees it); a new
        gradient of a swapped master is stored back."""
        del param, full
        home: _Home = slot.home
        unit, master = home.unit, home.unit.masters.get(home.segment)
        if what == "param":
            unit.ensure_shard()
            unit.shard_modified()
            if master is not None:
                for _, at, n in slot.ranges:
                    lo = home.start + at
                    unit.flat_shard[lo : lo + n].copy_(master.detach()[at : at + n])
            unit.evict_shard()
        elif what == "grad" and self._swapped is not None and master is not None:
            self._swapped.store_grad(self._master_index[id(master)])

    def refresh_params(self) -> None:
        """Copies the masters into the parameter shards (and re-gathers persistent ones)."""
        self._refresh()
