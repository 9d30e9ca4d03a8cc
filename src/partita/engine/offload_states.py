"""DeepSpeed's ``engine.offload_states()`` / ``reload_states()``: the engine's state leaves the
accelerator between an RLHF actor's training phase and its generation phase, and comes back.

[Note: offloaded storages]
The state is found by what it is, not by which stage made it: optimizer state tensors, the
tensors the optimizer steps (fp32 masters, or the parameters themselves), their gradients and
the module's parameters (at stage 3, the unit shards). Each storage of those that lives on the
engine's device is copied into a host buffer (page-locked on request) and then resized to zero
bytes; reloading resizes it back and copies the bytes in. Every tensor and view keeps pointing
at the same storage object, so flat buffers, parameter views into them and optimizer-state keys
are untouched by construction, and training after a reload is bitwise the training without
one. A storage shared by a state kind that is offloaded and one that is not (an fp32 module
without masters, whose parameters *are* the stepped tensors) stays: offloading it would take
away what the caller asked to keep.

While storages are empty nothing may read them (a zero-byte storage behind a sized tensor is
read out of bounds): forwards of the module are refused by pre-hooks placed first, the engine's
backward and step and the state accessors check `require_resident`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from partita.engine.setup import NoOptimizer

if TYPE_CHECKING:
    from partita.engine.core import Engine

logger = logging.getLogger("partita")


class OffloadStateTypeEnum(str, enum.Enum):
    """The kinds of state `offload_states` moves (DeepSpeed's names and values)."""

    optim_states = "optim_states"
    """The optimizer's per-parameter state (Adam's moments)."""
    hp_params = "hp_params"
    """The tensors the optimizer steps: fp32 masters (or the parameters without masters)."""
    lp_params = "lp_params"
    """The module's parameters (stage 3: this rank's unit shards)."""
    lp_grads = "lp_grads"
    """Gradients held now (none between steps: [Note: released gradients])."""
    contiguous_grad_buffer = "contiguous_grad_buffer"
    """DeepSpeed's persistent reduce buffer; partita pools reduce buffers only during a step,
    so there is nothing of this kind to move between phases."""


class OffloadDeviceEnum(str, enum.Enum):
    """Where `offload_states` may move state (DeepSpeed's names and values; only ``cpu``
    moves anything)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


@dataclass
class OffloadedStates:
    """What `offload_states` took away: each storage with its host copy, and the guards."""

    kinds: set[OffloadStateTypeEnum] = field(default_factory=set)
    held: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=dict)
    """StorageImpl identity -> (the emptied storage, its bytes on the host)."""
    guards: list[RemovableHandle] = field(default_factory=list)
    units: list[Any] = field(default_factory=list)
    """The stage-3 units (found before the gatherer was closed)."""

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies."""
        return sum(host.numel() for _, host in self.held.values())


def _kinds(include: Container[Any] | None) -> list[OffloadStateTypeEnum]:
    if include is None:
        return list(OffloadStateTypeEnum)
    try:
        return [OffloadStateTypeEnum(_value(k)) for k in include]  # type: ignore[attr-defined]
    except ValueError as error:
        names = [k.value for k in OffloadStateTypeEnum]
        raise ValueError(f"offload_states(include=...): {error}; known kinds: {names}") from None


def _value(item: Any) -> str:
    """An enum member's value (DeepSpeed's own enums are str enums too) or the string."""
    return str(getattr(item, "value", item))


def state_tensors(engine: Engine) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """The tensors of each kind of engine state on this rank (see [Note: offloaded storages])."""
    optimizer = engine.optimizer
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    params = list(engine.module.parameters())
    lp: list[torch.Tensor] = [*params, *(unit.flat_shard for unit in stage3_units(engine))]
    return {
        OffloadStateTypeEnum.optim_states: [
            v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ],
        OffloadStateTypeEnum.hp_params: stepped,
        OffloadStateTypeEnum.lp_params: lp,
        OffloadStateTypeEnum.lp_grads: [t.grad for t in [*stepped, *params] if t.grad is not None],
        OffloadStateTypeEnum.contiguous_grad_buffer: [],
    }


def stage3_units(engine: Engine) -> list[Any]:
    """The ZeRO-3 units holding the module's parameters (empty below stage 3), found through
    the state-access interface's gatherer."""
    offloaded: OffloadedStates | None = engine.__dict__.get("_offloaded")
    if offloaded is not None:  # the gatherer refuses while the shards are away
        return offloaded.units
    gatherer = engine.param_states.gatherer
    if gatherer is None:
        return []
    units: dict[int, Any] = {}
    for p in engine.module.parameters():
        unit = gatherer.unit_of(p)
        if unit is not None:
            units.setdefault(id(unit), unit)
    return list(units.values())


def _storages(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, Any]:
    """Non-empty storages of `tensors` on `device`, by StorageImpl identity."""
    out: dict[int, Any] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.device == device:
            out.setdefault(storage._cdata, storage)
    return out


def resident_state_bytes(engine: Engine) -> dict[str, int]:
    """Bytes of each kind of engine state held in storages on the engine's device now (a
    storage shared by two kinds counts in both), and ``host_copies``: what `offload_states`
    keeps on the host. On a CPU run the device is host memory; the figures are the engine's
    own storages either way."""
    out = {
        kind.value: sum(s.nbytes() for s in _storages(ts, engine.device).values())
        for kind, ts in state_tensors(engine).items()
    }
    offloaded: OffloadedStates | None = engine.__dict__.get("_offloaded")
    out["host_copies"] = 0 if offloaded is None else offloaded.host_bytes
    return out


def check_offload_request(engine: Engine, device: Any) -> bool:
    """Validates an `offload_states` call as DeepSpeed does; False when there is nothing to do
    (``device='none'``)."""
    where = _value(device)
    if where == OffloadDeviceEnum.none.value:
        logger.warning("offload_states(device='none'): no device given, nothing offloaded")
        return False
    if where == OffloadDeviceEnum.nvme.value:
        raise ValueError("offload_states(device='nvme') is not supported; use device='cpu'")
    if where != OffloadDeviceEnum.cpu.value:
        raise ValueError(f"offload_states(device={where!r}): expected 'cpu', 'none' or 'nvme'")
    zero = engine._config.zero_optimization
    if zero.offload_param is not None and zero.offload_param.device != "none":
        raise ValueError(
            "offload_states() cannot move parameters that zero_optimization.offload_param "
            f"(device={zero.offload_param.device!r}) already keeps off the device"
        )
    if isinstance(engine.optimizer, NoOptimizer):
        raise ValueError(
            "offload_states() needs an engine with an optimizer (this one is eval-only)"
        )
    return True


def excluded_by_config(engine: Engine) -> set[OffloadStateTypeEnum]:
    """Kinds ``offload_optimizer`` already keeps on the host (or NVMe): never moved, as in
    DeepSpeed (at stage 3 the gradients of host masters live on the host too)."""
    zero = engine._config.zero_optimization
    opt = zero.offload_optimizer
    if opt is None or opt.device == "none":
        return set()
    kinds = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
    if zero.stage == 3:
        kinds.add(OffloadStateTypeEnum.lp_grads)
    return kinds


def offload(
    engine: Engine,
    include: Container[Any] | None,
    pin_memory: bool,
    non_blocking: bool,
) -> None:
    """Moves the requested kinds of state to host memory (see `DeepSpeedEngineMethods.
    offload_states`)."""
    if "_offloaded" not in engine.__dict__:
        engine.__dict__["_offloaded"] = OffloadedStates(units=stage3_units(engine))
    state: OffloadedStates = engine.__dict__["_offloaded"]
    kinds = [k for k in _kinds(include) if k not in excluded_by_config(engine)]
    tensors = state_tensors(engine)
    device = engine.device
    wanted: dict[int, Any] = {}
    for kind in kinds:
        wanted.update(_storages(tensors[kind], device))
    for kind, ts in tensors.items():
        if kind not in kinds and kind not in state.kinds:  # kept: its storages stay too
            for key in _storages(ts, device):
                wanted.pop(key, None)
    pin = pin_memory and engine.accelerator.is_cuda
    moved: list[tuple[int, Any, torch.Tensor]] = []
    for key, storage in wanted.items():
        if key in state.held:
            continue
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
        host.copy_(source, non_blocking=non_blocking and pin)
        moved.append((key, storage, host))
    # The copies were queued on the current stream before the storages are freed, so memory
    # reused on that stream is written only after the copies have read it.
    for key, storage, host in moved:
        storage.resize_(0)
        state.held[key] = (storage, host)
    state.kinds.update(kinds)
    _close_readers(engine, state)
    if not non_blocking:
        engine.accelerator.synchronize()


def reload(engine: Engine, non_blocking: bool) -> None:
    """Brings back everything `offload` moved, into the same storages."""
    state: OffloadedStates | None = engine.__dict__.pop("_offloaded", None)
    if state is None:
        return
    for handle in state.guards:
        handle.remove()
    engine.param_states.unreadable = engine.param_states.ungatherable = None
    for storage, host in state.held.values():
        storage.resize_(host.numel())
        target = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        target.copy_(host, non_blocking=non_blocking and host.is_pinned())
    if not non_blocking:
        engine.accelerator.synchronize()


def offloaded_kinds(engine: Engine) -> list[str]:
    """Names of the kinds of state offloaded now (empty when everything is resident)."""
    state: OffloadedStates | None = engine.__dict__.get("_offloaded")
    return [] if state is None else sorted(k.value for k in state.kinds)


def _refusal(engine: Engine, what: str) -> str:
    return (
        f"{what} while the engine's states {offloaded_kinds(engine)} are offloaded "
        "(engine.offload_states()); call engine.reload_states() first"
    )


def require_resident(engine: Engine, what: str) -> None:
    """Raises when `what` (an engine call) would read state that `offload_states` moved."""
    state: OffloadedStates | None = engine.__dict__.get("_offloaded")
    if state is not None and state.held:
        raise RuntimeError(_refusal(engine, what))


def _close_readers(engine: Engine, state: OffloadedStates) -> None:
    """Makes every reader of the moved storages refuse instead of reading zero bytes: the
    state accessors and checkpoints (through `ParamStates`), and, when parameters moved,
    gathers and forwards."""
    if not state.held:
        return
    states = engine.param_states
    states.unreadable = _refusal(engine, "reading per-parameter state")
    if OffloadStateTypeEnum.lp_params in state.kinds:
        states.ungatherable = _refusal(engine, "gathering parameters")
        if not state.guards:
            state.guards = _forward_guards(engine)


def _forward_guards(engine: Engine) -> list[RemovableHandle]:
    """Pre-hooks, placed before the strategy's own, that refuse a forward of any module whose
    parameters were offloaded (generation calls the module directly, not the engine)."""

    def refuse(module: torch.nn.Module, args: Any) -> None:
        del args
        require_resident(engine, f"a forward of {type(module).__name__}")

    holders = [
        m
        for m in engine.module.modules()
        if m is engine.module or next(m.parameters(recurse=False), None) is not None
    ]
    return [m.register_forward_pre_hook(refuse, prepend=True) for m in holders]
