"""`GatheredParameters`: read or modify full ZeRO-3 parameters outside forward and backward.

Inside the block the listed parameters hold their full values on every rank (their units are
gathered and pinned so hooks do not release them). With ``modifier_rank=r``, the values of
rank r of the parameters' data-parallel group (every rank holding them: under hybrid sharding
every replica too) at exit are broadcast and become every rank's new shards, fp32 masters included; without it, changes are discarded. Parameters not sharded by
stage 3 are left as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from partita import comm
from partita.zero import registry
from partita.zero.init import PRE_SHARDED, materialized


class GatheredParameters:
    """Context manager gathering `params` (one tensor or an iterable) on every rank."""

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        del fwd_module  # DeepSpeed registers external parameters with it; not needed here
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[tuple[Any, Any]] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        seen: set[int] = set()
        for p in self.params:
            states = registry.find(p, sharded=True)
            owner = None if states is None else states.gatherer
            unit = None if owner is None else owner.unit_of(p)
            if unit is not None and id(unit) not in seen:
                seen.add(id(unit))
                self._units.append((owner, unit))
        for owner, unit in self._units:
            owner.pin(unit)
        pre = [p for p in self.params if p in PRE_SHARDED]
        if pre:
            self._stack.enter_context(materialized(pre, self.modifier_rank))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                with torch.no_grad():
                    for owner, unit in self._units:
                        # modifier_rank is a rank of the data-parallel group holding the
                        # unit (as in DeepSpeed; with replicas, every replica, which DeepSpeed's
                        # MiCS leaves out; an expert unit's expert-data-parallel group); the
                        # broadcast names its source globally.
                        group = owner.modifier_group_of(unit)
                        src = comm.get_global_rank(group, self.modifier_rank)
                        comm.broadcast(unit.flat_full, src=src, group=group, tag="gathered")
                        owner.load_gathered(unit, self.params)
        finally:
            for owner, unit in self._units:
                owner.unpin(unit)
            self._units = []
            self._stack.close()
