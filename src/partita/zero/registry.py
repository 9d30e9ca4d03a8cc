"""Which live engine's state holds a parameter, and what ZeRO-3 knows of one it manages.

The engine registers its strategy's state (`register`) when built and forgets it when destroyed;
DeepSpeed's ``safe_get_*`` / ``safe_set_*`` accessors (`partita.compat.accessors`),
`GatheredParameters` and the ``ds_*`` attribute views (`zero3_view`) find a parameter's state
here.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

import torch

from partita.zero.state_access import ParamStates

_STATES: weakref.WeakSet[ParamStates] = weakref.WeakSet()


def register(states: ParamStates) -> None:
    """Makes the parameters of a strategy's state reachable from the accessors and from
    `GatheredParameters` (the engine calls this)."""
    _STATES.add(states)


def unregister(states: ParamStates) -> None:
    """Forgets a strategy's state (its engine was destroyed)."""
    _STATES.discard(states)


def find(param: torch.Tensor, sharded: bool = False) -> ParamStates | None:
    """The state of the live engine holding `param` (trainable or frozen), or None; with
    `sharded`, only a state whose strategy shards parameters (stage 3)."""
    for states in list(_STATES):
        if states.holds(param) and (states.gatherer is not None or not sharded):
            return states
    return None


def owner(param: torch.Tensor) -> ParamStates:
    """The state of the live engine that trains `param`; raises ValueError naming its shape
    when none does."""
    for states in list(_STATES):
        if states.owns(param):
            return states
    raise ValueError(
        f"parameter of shape {tuple(param.shape)} is not trained by any partita engine "
        "(frozen, or initialize() was not called with it)"
    )


class Presence(enum.Enum):
    """Where a ZeRO-3 parameter's full value is, seen from this rank."""

    PRESENT = "present"
    """Gathered, persistent, or materialized inside `GatheredParameters`."""
    ARRIVING = "arriving"
    """Its unit's all-gather is in flight."""
    ABSENT = "absent"
    """Only this rank's shard is here; the module holds a placeholder."""


@dataclass(frozen=True)
class ZeroParamView:
    """What ZeRO-3 knows of one parameter it manages, for read-only views of it (the
    DeepSpeed compatibility layer's ``ds_*`` attributes); a snapshot taken when asked."""

    ident: int
    """Given when ZeRO-3 first managed it, in build order: the same on every rank."""
    presence: Presence
    numel: int
    shape: torch.Size
    persistent: bool
    """Kept gathered between uses (below ``stage3_param_persistence_threshold``)."""
    local: torch.Tensor
    """This rank's elements of it, flattened, in the module's dtype (possibly empty)."""


def _unit_view(param: torch.Tensor, ident: int) -> ZeroParamView | None:
    from partita.zero.stage3.unit import UnitState

    states = find(param, sharded=True)
    unit = None if states is None or states.gatherer is None else states.gatherer.unit_of(param)
    if unit is None:
        return None
    index = next(i for i, p in enumerate(unit.params) if p is param)
    pieces = [pc for pc in unit.layout.shard_pieces(unit.rank) if pc.index == index]
    if unit.shard_swap is not None:  # the shard lives in a swap file: read a copy
        was_resident = unit.shard_swap.resident
        unit.ensure_shard()
        local = torch.cat(
            [unit.flat_shard[pc.shard_offset : pc.shard_offset + pc.length] for pc in pieces]
            or [unit.flat_shard[:0]]
        ).clone()
        if not was_resident:  # leave it as found: a resident shard is in use
            unit.evict_shard()
    else:  # one rank's elements of a parameter are one run of its shard (FlatLayout)
        parts = [unit.flat_shard[pc.shard_offset : pc.shard_offset + pc.length] for pc in pieces]
        local = parts[0] if len(parts) == 1 else torch.cat(parts or [unit.flat_shard[:0]])
    return ZeroParamView(
        ident=ident,
        presence={UnitState.SHARDED: Presence.ABSENT, UnitState.UNSHARDING: Presence.ARRIVING}.get(
            unit.state, Presence.PRESENT
        ),
        numel=param.numel(),
        shape=param.shape,
        persistent=bool(unit.persistent),
        local=local.detach(),
    )


def zero3_view(param: torch.Tensor) -> ZeroParamView | None:
    """The view of a parameter a live stage-3 engine holds or ``zero.Init`` built, else None
    (stages 0-2, plain parameters, a destroyed engine's persistent parameters)."""
    from partita.zero.init import PRE_SHARDED
    from partita.zero.placeholder import zero_param_id

    ident = zero_param_id(param)
    if ident is None:
        return None
    view = _unit_view(param, ident)
    if view is not None:
        return view
    shard = PRE_SHARDED.get(param)
    if shard is None:
        return None
    return ZeroParamView(
        ident=ident,
        presence=Presence.PRESENT if shard.gathered else Presence.ABSENT,
        numel=shard.numel,
        shape=param.shape,
        persistent=False,
        local=shard.value().detach(),
    )


__all__ = [
    "Presence",
    "ZeroParamView",
    "find",
    "owner",
    "register",
    "unregister",
    "zero3_view",
]
