"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_*`` accessors for master weights, gradients and
optimizer state, whatever the ZeRO stage.

"Full" functions return a parameter-shaped fp32 tensor on every rank and are collective under
ZeRO 1-2 (every rank must call them, in the same order). "Local" functions return the 1-D part
this rank owns (the whole flattened parameter in stage 0; possibly empty). Gradients are
available between the boundary backward and `engine.step()`, as in DeepSpeed.
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


def _owner(param: torch.Tensor) -> ParamStates:
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


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The full fp32 master value of `param` (collective under ZeRO)."""
    return _owner(param).full_state(param, "param")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Sets the fp32 master (and the module weight) of `param` from a full value."""
    _owner(param).set_full_state(param, "param", value)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full reduced fp32 gradient of `param` (collective under ZeRO)."""
    return _owner(param).full_state(param, "grad")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replaces the reduced gradient of `param` (before `engine.step()`)."""
    _owner(param).set_full_state(param, "grad", value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state `optim_state_key` (e.g. "exp_avg") of `param`."""
    return _owner(param).full_state(param, optim_state_key)


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Sets optimizer state `optim_state_key` of `param` from a full value."""
    _owner(param).set_full_state(param, optim_state_key, value)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the fp32 master of `param` (1-D)."""
    return _owner(param).local_state(param, "param")


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Sets this rank's part of the fp32 master of `param` (the module weight follows at the
    next step's all-gather)."""
    _owner(param).set_local_state(param, "param", value)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the reduced gradient of `param` (1-D)."""
    return _owner(param).local_state(param, "grad")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Sets this rank's part of the reduced gradient of `param`."""
    _owner(param).set_local_state(param, "grad", value)


def safe_get_local_optimizer_state(
    param: torch.Tensor, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's part of optimizer state `optim_state_key` of `param` (1-D)."""
    return _owner(param).local_state(param, optim_state_key)


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Sets this rank's part of optimizer state `optim_state_key` of `param`."""
    _owner(param).set_local_state(param, optim_state_key, value)


__all__ = [
    "Presence",
    "ZeroParamView",
    "find",
    "register",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "unregister",
    "zero3_view",
]
