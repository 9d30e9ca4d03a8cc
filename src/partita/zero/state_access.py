"""Per-parameter state access, written once for every ZeRO stage.

DeepSpeed's ``safe_get/set_*`` accessors, checkpoint save and load, and reshard-on-load all ask
the same questions of a strategy: which elements of this parameter does this rank hold, what are
their values (master weight, reduced gradient, an optimizer state entry), and how are they
replaced. `ParamStates` answers them for every stage over a `StateLayout`, the one thing a stage
describes: for each parameter, a `ParamSlot` saying where its elements sit in the tensors the
stage keeps, and which tensor holds each kind of state.

- Stage 0: one range covering the whole parameter, in its fp32 master (or the parameter itself).
- Stages 1-2: the pieces of this rank's flat shard (`FlatLayout.shard_pieces`).
- Stage 3: the pieces of the parameter's unit shard, in the master of its segment.

"Local" values are 1-D, this rank's elements in `owned_ranges` order; "full" values are
parameter-shaped and assembled with one all-reduce over the data-parallel group unless the
layout is replicated (every rank already holds everything).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from partita import comm
from partita.precision import full_dtype


@dataclass
class ParamSlot:
    """Where this rank holds one parameter's state."""

    shape: torch.Size
    """The parameter's full shape (a stage-3 parameter's own shape is a placeholder's)."""
    ranges: list[tuple[int, int, int]]
    """(offset in the flattened parameter, offset in the source tensor, length) of each run of
    elements this rank holds, ascending in both."""
    stepped: torch.Tensor | None
    """The tensor the optimizer steps for this parameter (optimizer state is keyed by it);
    None for a frozen parameter (only its value is held)."""
    home: Any = field(default=None, compare=False)
    """Whatever the layout needs to find the sources again (a group, a unit and segment)."""
    group: Any = field(default=None, compare=False)
    """The process group this parameter's pieces are spread over, where it is not the
    layout's (expert parameters: [Note: expert parallelism] in `partita.comm.dims`);
    meaningful only with `own_group`."""
    own_group: bool = field(default=False, compare=False)

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return self.shape.numel()


class StateLayout(Protocol):
    """What a ZeRO stage describes so that `ParamStates` can serve its state."""

    optimizer: torch.optim.Optimizer
    replicated: bool
    """True when every rank holds every parameter's whole state (stage 0)."""
    shards_params: bool
    """True when the module's parameters themselves are sharded (stage 3)."""
    process_group: comm.ProcessGroup | None

    def slot(self, param: torch.Tensor) -> ParamSlot | None:
        """`param`'s slot, or None when the strategy does not hold it."""
        ...

    def source(self, slot: ParamSlot, what: str) -> torch.Tensor | None:
        """The tensor `slot.ranges` index into for `what` ("param", "grad" or an optimizer
        state key; None when absent), made resident first if it was swapped out."""
        ...

    def after_write(
        self, param: torch.Tensor, slot: ParamSlot, what: str, full: torch.Tensor | None
    ) -> None:
        """Propagates a write of `what` (the module's weight, a stored swapped gradient);
        `full` is the parameter-shaped value when the whole value was given."""
        ...

    def refresh_params(self) -> None:
        """Brings the module's weights in line with the masters (after loading)."""
        ...


class UnitGatherer(Protocol):
    """What `GatheredParameters` needs of a strategy that shards parameters (stage 3)."""

    def modifier_group_of(self, unit: Any) -> Any:
        """Every rank holding `unit`'s parameters (a process group; None: the default group):
        a modifier rank's values are broadcast over it."""
        ...

    def unit_of(self, param: torch.Tensor) -> Any:
        """The unit holding `param`, or None."""
        ...

    def pin(self, unit: Any) -> None:
        """Gathers `unit` and keeps it gathered until `unpin`."""
        ...

    def unpin(self, unit: Any) -> None:
        """Releases a `pin`."""
        ...

    def load_gathered(self, unit: Any, params: list[torch.Tensor]) -> None:
        """`unit`'s gathered values of `params` become its shards and masters."""
        ...


class ParamStates:
    """The state-access interface of a strategy: the accessors (`partita.compat.accessors`),
    checkpoints and `GatheredParameters` use this, never a stage's internals."""

    def __init__(self, layout: StateLayout, gatherer: UnitGatherer | None = None) -> None:
        self.layout = layout
        self._gatherer = gatherer
        self.unreadable: str | None = None
        """Why the state cannot be read now (``engine.offload_states()`` moved it off the
        device and left zero-byte storages): every read or write raises it."""
        self.ungatherable: str | None = None
        """Likewise for gathering parameters (their shards were moved)."""

    @property
    def gatherer(self) -> UnitGatherer | None:
        """Stage 3: gathers and pins the units of parameters (`GatheredParameters`)."""
        if self.ungatherable is not None:
            raise RuntimeError(self.ungatherable)
        return self._gatherer

    @property
    def replicated(self) -> bool:
        """True when every rank holds every parameter's whole state (checkpoints save it once)."""
        return self.layout.replicated

    @property
    def shards_params(self) -> bool:
        """True when the module's parameters themselves are sharded (stage 3)."""
        return self.layout.shards_params

    def _slot(self, param: torch.Tensor) -> ParamSlot:
        if self.unreadable is not None:
            raise RuntimeError(self.unreadable)
        slot = self.layout.slot(param)
        if slot is None:
            raise ValueError(
                f"parameter of shape {tuple(param.shape)} is not managed by this engine"
            )
        return slot

    def holds(self, param: torch.Tensor) -> bool:
        """True for every parameter this strategy holds, trainable or frozen."""
        return self.layout.slot(param) is not None

    def owns(self, param: torch.Tensor) -> bool:
        """True for the trainable parameters this strategy steps."""
        slot = self.layout.slot(param)
        return slot is not None and slot.stepped is not None

    def owned_ranges(self, param: torch.Tensor) -> list[tuple[int, int]]:
        """(offset, length) ranges of the flattened `param` whose state this rank holds."""
        return [(at, n) for at, _, n in self._slot(param).ranges]

    def optimizer_state_keys(self) -> list[str]:
        """Names of the optimizer's per-parameter state entries (e.g. exp_avg, step)."""
        return sorted({k for st in self.layout.optimizer.state.values() for k in st})

    def local_state(self, param: torch.Tensor, what: str) -> torch.Tensor | None:
        """This rank's elements of `what` (1-D fp32, `owned_ranges` order); scalar optimizer
        state (Adam's ``step``) as a 0-dim copy; None when absent."""
        slot = self._slot(param)
        src = self.layout.source(slot, what)
        if src is None or src.dim() == 0:
            return None if src is None else src.detach().clone()
        flat = src.detach().view(-1)
        parts = [flat[at : at + n] for _, at, n in slot.ranges]
        return torch.cat(parts).to(full_dtype(src)) if parts else flat.new_zeros(0)

    def local_state_view(self, param: torch.Tensor, what: str) -> torch.Tensor | None:
        """What `local_state` returns, as a view of the strategy's own tensor when that needs
        no copy (one run of elements, already in their full dtype, on the host); None when
        it would (use `local_state`). For a reader that is done with it before the strategy
        runs again (a synchronous checkpoint write): never written to, never kept."""
        slot = self._slot(param)
        src = self.layout.source(slot, what)
        if src is None or src.dim() == 0 or len(slot.ranges) != 1:
            return None
        if src.dtype != full_dtype(src) or src.device.type != "cpu" or not src.is_contiguous():
            return None
        _, at, n = slot.ranges[0]
        return src.detach().view(-1)[at : at + n]

    def local_state_spec(
        self, param: torch.Tensor, what: str
    ) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """dtype and shape of what `local_state` returns, without copying; None when absent
        (lets a checkpoint write its header before producing the values)."""
        slot = self._slot(param)
        src = self.layout.source(slot, what)
        if src is None or src.dim() == 0:
            return None if src is None else (src.dtype, ())
        if not slot.ranges:
            return src.dtype, (0,)
        return full_dtype(src), (sum(n for _, _, n in slot.ranges),)

    def full_state(self, param: torch.Tensor, what: str) -> torch.Tensor | None:
        """Parameter-shaped fp32 value of `what` (collective unless replicated: every rank of
        the data-parallel group must call it, in the same order)."""
        slot = self._slot(param)
        local = self.local_state(param, what)
        if local is None or local.dim() == 0:
            return local
        if self.layout.replicated:
            return local.view(slot.shape)
        out = torch.zeros(slot.numel, dtype=local.dtype, device=local.device)
        offset = 0
        for at, _, n in slot.ranges:
            out[at : at + n] = local[offset : offset + n]
            offset += n
        group = slot.group if slot.own_group else self.layout.process_group
        comm.all_reduce(out, group=group, tag="accessor")
        return out.view(slot.shape)

    def set_local_state(self, param: torch.Tensor, what: str, value: torch.Tensor) -> None:
        """Writes this rank's elements (1-D, `owned_ranges` order); missing optimizer state is
        created. For "param" the module weight follows (at once, or at the next gather)."""
        self._write(param, self._slot(param), what, value, None)

    def set_full_state(self, param: torch.Tensor, what: str, value: torch.Tensor) -> None:
        """Writes this rank's part of a parameter-shaped value (the same on every rank)."""
        slot = self._slot(param)
        if value.dim() == 0:
            self._write(param, slot, what, value, None)
            return
        flat = value.reshape(-1)
        parts = [flat[at : at + n] for at, _, n in slot.ranges]
        local = torch.cat(parts) if parts else flat[:0]
        self._write(param, slot, what, local, value)

    @torch.no_grad()
    def _write(
        self,
        param: torch.Tensor,
        slot: ParamSlot,
        what: str,
        local: torch.Tensor,
        full: torch.Tensor | None,
    ) -> None:
        dst = self.layout.source(slot, what)
        if dst is None:
            if what in ("param", "grad") or slot.stepped is None:
                raise ValueError(f"parameter has no {what!r} state yet (run a backward first)")
            dst = ensure_state(self.layout.optimizer, slot.stepped, what, local)
        if dst.dim() == 0:
            dst.copy_(local)
            return
        flat = dst.view(-1)
        offset = 0
        for _, at, n in slot.ranges:
            flat[at : at + n].copy_(local[offset : offset + n])
            offset += n
        self.layout.after_write(param, slot, what, full)

    def refresh_params(self) -> None:
        """Brings the module's weights in line with the masters (after loading state)."""
        self.layout.refresh_params()


def ensure_state(
    optimizer: torch.optim.Optimizer, stepped: torch.Tensor, what: str, value: torch.Tensor
) -> torch.Tensor:
    """The optimizer's state tensor `what` for `stepped`, created when absent (a checkpoint
    loaded into a fresh optimizer): element-wise keys get zeros shaped like `stepped`, scalar
    keys (such as Adam's ``step``) a 0-dim tensor of `value`'s dtype."""
    state = optimizer.state[stepped]
    if what not in state:
        if value.dim() == 0:
            state[what] = torch.zeros((), dtype=value.dtype, device=stepped.device)
        else:
            state[what] = torch.zeros_like(stepped, memory_format=torch.contiguous_format)
    return state[what]
