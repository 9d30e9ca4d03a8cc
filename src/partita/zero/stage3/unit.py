"""One ZeRO-3 unit: parameters that are gathered together, with one all-gather per segment.

[Note: ZeRO-3 state map]
Who owns what, for a newcomer. Each thing has one owner; the others ask it through methods.

- `ShardedUnit` (this module): a unit's storage (``flat_shard``, ``flat_full``, the masters,
  the transient ``grad_buffer``), its `UnitState` (sharded / unsharding / unsharded), its
  `TrainingState` (where forward and backward are with it) and its per-step counters
  (``in_use``, ``forward_calls``, ``backward_calls``), changed only by its own methods.
- `UnitScheduler` (``schedule.py``): the hooks, the recorded order and its cursors, prefetch and
  the live-element bounds. It calls the unit's transitions; it keeps no per-unit lists.
- `UnitGradReducer` (``grads.py``): reduce-scatters in flight and the buffer pool.
- `FullySharded` (``strategy.py``): builds the units, owns the optimizer, steps, serves state.

Index spaces, each local to one owner:
- a parameter's index in its unit (``unit.params[i]``, ``unit.views[i]``, ``layout.offsets[i]``,
  ``unit.grad_written``): `FlatLayout`'s order, segment by segment;
- a segment's index in its unit (``unit.segments[s]``, ``layout.segments[s]``,
  ``unit.masters[s]``); ``layout.segment_of[i]`` maps a parameter to its segment;
- an optimizer group (``SegmentInfo.group``), as the user passed the parameter groups;
- a master's index among all masters (build order of the units, then segments): the
  optimizer's parameter order and `SwappedOptimizerState`'s sub-group index;
- a position in the recorded forward order (``UnitScheduler.order``, a list of units);
- element offsets: in ``flat_full`` (``layout.offsets``) and in ``flat_shard`` (``Piece``).

One parameter's state: the module's ``nn.Parameter`` (its ``.data`` is the gathered view or a
placeholder, `partita.zero.placeholder`); its elements in ``flat_full`` (while gathered) and
this rank's pieces of it in ``flat_shard``; its segment's fp32 master, the master's gradient and
optimizer state (possibly swapped to NVMe by `SwappedOptimizerState`); during backward, its
gradient in the unit's ``grad_buffer``. The strategy maps a parameter to (unit, index).

Every transition is a ``partita::<what>[<unit name>]`` range for the torch profiler (`trace`),
so a trace of one step reads as the algorithm: pre_forward, unshard, wait_for_unshard,
post_forward, reshard, pre_backward, post_backward, reduce_scatter, step, NVMe reads and writes.

[Note: unit storage]
A unit lays its parameters out in one flat buffer (`FlatLayout`, one segment per optimizer
group plus one for frozen parameters, each sharded evenly over ranks). Each rank keeps its
chunk of every segment in ``flat_shard`` (the module dtype) and, for trainable segments, an fp32
master chunk with an fp32 gradient chunk. ``flat_full`` is the gathered buffer; its storage is
resized to zero while the unit is sharded, so memory is freed even though autograd still holds
views of it, and re-grown before the next gather (the FSDP technique). While sharded, each
parameter's ``.data`` is a zero-memory NaN tensor of the right shape: code that reads a
sharded parameter outside `GatheredParameters` sees NaNs instead of plausible numbers, and
writes to it fail. Gathers run under `_unsafe_preserve_version_counter` because refilling the
buffer is not a change autograd's saved tensors need to know about.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from partita import comm
from partita.offload import SwappedTensor, SwapSpace
from partita.partition import FlatLayout
from partita.platform.accelerator import pin_if
from partita.zero.placeholder import mark_gathered, mark_sharded
from partita.zero.stage3.gather import (
    EXACT,
    TRAINING,
    DequantizingGather,
    GatherPlan,
    gather_segment,
)
from partita.zero.stage3.identity import GATHER, DivergenceCheck
from partita.zero.stage3.secondary import SecondaryCopy


class UnitState(enum.Enum):
    """Where a unit's parameters are."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    """Where the training step is with a unit (FSDP2's vocabulary): between uses (IDLE), inside
    its forward (FORWARD), its backward started (PRE_BACKWARD), its gradients handed to the
    reduce-scatter (POST_BACKWARD, until the backward is finished)."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


_NOT_TRACED = contextlib.nullcontext()


def trace(what: str, unit: str | None = None) -> contextlib.AbstractContextManager[Any]:
    """A ``partita::<what>[<unit>]`` range in a torch profiler trace. Without a running profiler
    it is a shared no-op (a `record_function` costs tens of times more even then); with one,
    keep it out of per-parameter loops."""
    if not torch._C._autograd._profiler_enabled():
        return _NOT_TRACED
    return record_function(f"partita::{what}" if unit is None else f"partita::{what}[{unit}]")


@dataclass
class SegmentInfo:
    """One segment of a unit: the parameters of one optimizer group, or the frozen ones."""

    index: int
    group: int | None
    """Optimizer group index; None for frozen parameters."""
    params: list[torch.nn.Parameter]


class ShardedUnit:
    """A unit's layout, storage and transitions (`unshard`, `wait_for_unshard`, `reshard`)."""

    training_state = TrainingState.IDLE
    in_use = 0
    """Users that need the unit gathered now: running hooks and `GatheredParameters` pins."""
    forward_calls = 0
    """Forwards with gradients this step (a unit may run more than once)."""
    backward_calls = 0
    """Of those, the backwards that have finished."""
    index = -1
    """Position among the strategy's units (the same on every rank; names it in identities)."""
    divergence: DivergenceCheck | None = None
    """Checks each gather's and reduce-scatter's identity across ranks ([Note: rank
    divergence]); set by the strategy once every unit exists."""
    _gather_ticket: int | None = None
    """The divergence check's ticket of the gather in flight ([Note: asynchronous identities])."""

    def __init__(
        self,
        name: str,
        segments: list[SegmentInfo],
        world: int,
        rank: int,
        master_dtype: torch.dtype,
        persistent: bool = False,
        group: comm.ProcessGroup | None = None,
        source: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
        state_device: torch.device | None = None,
        shard_device: torch.device | None = None,
        alias_masters: bool = True,
        shard_space: SwapSpace | None = None,
        pin_memory: tuple[bool, bool] = (False, False),
        gather_plan: GatherPlan = EXACT,
    ) -> None:
        self.name, self.world, self.gather_plan = name, world, gather_plan
        self.segments = segments
        self.params = [p for s in segments for p in s.params]
        self.persistent = persistent
        self.rank = rank
        self.process_group = group
        buckets, i = [], 0
        for s in segments:
            buckets.append(list(range(i, i + len(s.params))))
            i += len(s.params)
        self.layout = FlatLayout.build([p.numel() for p in self.params], world, buckets=buckets)
        like = self.params[0]
        self.flat_full = torch.zeros(self.layout.padded_numel, dtype=like.dtype, device=like.device)
        self.views: list[torch.Tensor] = []
        with torch.no_grad():
            for p, off in zip(self.params, self.layout.offsets, strict=True):
                view = self.flat_full[off : off + p.numel()].view_as(p)
                view.copy_(source(p) if source is not None else p.detach())
                self.views.append(view)
                mark_gathered(p, view)
        # Offload changes only placement: the shard (param offload) and the master with its
        # optimizer state (optimizer offload) may live on the host.
        shard_at = shard_device or like.device
        shard = torch.empty(self.layout.shard_numel, dtype=like.dtype, device=shard_at)
        self.flat_shard = pin_if(pin_memory[1], shard)
        self.masters: dict[int, torch.nn.Parameter] = {}
        for seg_info, seg in zip(self.segments, self.layout.segments, strict=True):
            own = self._own(seg_info.index, self.flat_full)
            self.flat_shard[seg.shard_offset : seg.shard_offset + seg.chunk_numel].copy_(own)
            if seg_info.group is not None:
                chunk = self.shard_chunk(seg_info.index)
                same_place = state_device is None or state_device == chunk.device
                if alias_masters and chunk.dtype == master_dtype and same_place:
                    # An fp32 module on the optimizer's device: the shard is the master (no copy).
                    master = torch.nn.Parameter(chunk)
                else:
                    where = state_device or like.device
                    copy = own.detach().to(device=where, dtype=master_dtype, copy=True)
                    master = torch.nn.Parameter(pin_if(pin_memory[0], copy))
                master.grad = torch.zeros_like(master)
                self.masters[seg_info.index] = master
        self.state = UnitState.UNSHARDED
        self._handles: list[comm.Work] = []
        self.grad_buffer: torch.Tensor | None = None
        self.grad_written: set[int] = set()
        """Parameters (by index) whose gradient ``grad_buffer`` holds this backward."""
        self.numel = self.layout.padded_numel
        self._make_secondary()
        self.reshard()
        # Parameter offload to NVMe: the shard lives in a swap file between uses (see
        # [Note: swapped shards]).
        self.shard_swap = (
            SwappedTensor(self.flat_shard, shard_space, f"param.{name}")
            if shard_space is not None and not persistent
            else None
        )
        self.evict_shard()

    gather_plan: GatherPlan = EXACT
    """How training gathers move the segments ([Note: ZeRO++ gathers])."""
    secondary: SecondaryCopy | None = None
    """hpZ: this rank's 1/h slice of the gathered unit, cut over its node group."""
    _from_secondary = _fill_secondary = False

    def _make_secondary(self) -> None:
        """hpZ (not for persistent units, which stay gathered): the secondary copy."""
        plan = self.gather_plan
        if plan.secondary is not None and not self.persistent:
            quantized = {i for i, s in enumerate(self.segments) if plan.quantizes(s.group is None)}
            self.secondary = SecondaryCopy(
                plan.secondary, self.layout, self.world, quantized, self.flat_full
            )
        self._packed: dict[int, torch.Tensor] = {}
        """A primary quantized training gather's packed bytes, by segment, until kept."""

    @property
    def secondary_valid(self) -> bool:
        """hpZ's secondary copy holds the current parameters."""
        return self.secondary is not None and self.secondary.valid

    def _own(self, seg_index: int, full: torch.Tensor) -> torch.Tensor:
        seg = self.layout.segments[seg_index]
        start, end = seg.shard_range(self.rank)
        return full[start:end]

    def segment_of_param(self, index: int) -> SegmentInfo:
        """The segment holding parameter `index` of this unit."""
        return self.segments[self.layout.segment_of[index]]

    def shard_chunk(self, seg_index: int) -> torch.Tensor:
        """This rank's chunk of a segment in ``flat_shard``."""
        seg = self.layout.segments[seg_index]
        return self.flat_shard[seg.shard_offset : seg.shard_offset + seg.chunk_numel]

    # --- the shard's residence (NVMe parameter offload) ---------------------------------------
    def fetch_shard(self) -> None:
        """Starts reading a swapped shard in (no-op unless offloaded to NVMe)."""
        if self.shard_swap is not None and not self.shard_swap.resident:
            with trace("nvme_read", self.name):
                self.shard_swap.fetch()

    def ensure_shard(self) -> None:
        """Makes ``flat_shard`` readable (blocking read under NVMe parameter offload)."""
        if self.shard_swap is not None:
            if self.shard_swap.resident:
                self.shard_swap.ensure()  # waits for a read `fetch_shard` started, if any
                return
            with trace("nvme_read", self.name):
                self.shard_swap.ensure()

    def shard_modified(self) -> None:
        """``flat_shard`` was written: the next `evict_shard` writes it back."""
        self.parameters_changed()
        if self.shard_swap is not None:
            self.shard_swap.modified()

    def evict_shard(self) -> None:
        """Under NVMe parameter offload, writes a changed shard back and frees its memory."""
        if self.shard_swap is not None and self.shard_swap.resident:
            with trace("nvme_write" if self.shard_swap.dirty else "nvme_free", self.name):
                self.shard_swap.evict()

    @property
    def swapped_shard_numel(self) -> int:
        """Elements of the shard when it lives in a swap file (0 when it stays in memory)."""
        return 0 if self.shard_swap is None else self.flat_shard.numel()

    @property
    def shard_bytes(self) -> int:
        """Bytes of the shard in memory (0 while swapped out)."""
        return self.flat_shard.untyped_storage().nbytes()

    # --- transitions ---------------------------------------------------------------------------
    def unshard(self, tag: str = "param") -> None:
        """Starts the all-gather of every segment (no-op unless sharded); `tag` labels the
        traffic in the comm counters (training gathers are "param")."""
        if self.state is not UnitState.SHARDED:
            return
        with trace("unshard", self.name):
            if self.divergence is not None:  # before any data moves: see [Note: rank divergence]
                self._gather_ticket = self.divergence.check(GATHER, self.index)
            self._start_gather(tag)
        self.state = UnitState.UNSHARDING

    def _start_gather(self, tag: str) -> None:
        self.ensure_shard()
        self.flat_full.untyped_storage().resize_(
            self.flat_full.numel() * self.flat_full.element_size()
        )
        secondary = tag == TRAINING and self.secondary is not None
        self._from_secondary = secondary and self.secondary_valid
        self._fill_secondary = secondary and not self.secondary_valid
        self._packed = {}
        with torch.autograd._unsafe_preserve_version_counter(self.flat_full):
            for i, seg in enumerate(self.layout.segments):
                if seg.padded_numel == 0:
                    continue
                out = self.flat_full[seg.flat_start : seg.flat_end]
                handle = self._gather_segment(i, out, tag, self._from_secondary)
                if handle is not None:
                    self._handles.append(handle)
                if self._fill_secondary and isinstance(handle, DequantizingGather):
                    self._packed[i] = handle.packed  # the secondary copy keeps these bytes

    def _gather_segment(self, i: int, out: torch.Tensor, tag: str, from_secondary: bool) -> Any:
        """Starts segment `i`'s gather into `out`: from the primary shard over the ZeRO group
        or from the secondary copy over the node group, exact or quantized ([Note: ZeRO++
        gathers])."""
        plan = self.gather_plan
        frozen = self.segments[i].group is None
        quantize = tag == TRAINING and not self.persistent and plan.quantizes(frozen)
        block = plan.block_size if quantize else None
        if from_secondary:
            assert self.secondary is not None
            return self.secondary.gather(i, out, block, tag)
        src = self.shard_chunk(i).to(out.device, non_blocking=True)
        return gather_segment(out, src, self.process_group, self.world, block, tag)

    def parameters_changed(self) -> None:
        """The shard's values changed (a step, a load): the secondary copy is stale."""
        if self.secondary is not None:
            self.secondary.valid = False

    def pass_gather(self) -> list[comm.Work]:
        """Issues the collectives of this unit's gather into scratch buffers, changing no state:
        a rank that leaves the divergence check's window issues those its peers expect
        ([Note: identity windows]). Returns the handles to wait for."""
        self.ensure_shard()
        works: list[comm.Work] = []
        from_secondary = self.secondary_valid
        for i, seg in enumerate(self.layout.segments):
            if seg.padded_numel == 0:
                continue
            out = torch.empty(  # not a view: the full buffer has no storage while sharded
                seg.flat_end - seg.flat_start,
                dtype=self.flat_full.dtype,
                device=self.flat_full.device,
            )
            handle = self._gather_segment(i, out, TRAINING, from_secondary)
            if handle is not None:
                works.append(handle)
        return works

    def wait_for_unshard(self, tag: str = "param") -> None:
        """Completes a started gather and points the parameters at the gathered values."""
        if self.state is UnitState.SHARDED:
            self.unshard(tag)
        if self.state is UnitState.UNSHARDING:
            with trace("wait_for_unshard", self.name):
                if self.divergence is not None:  # see [Note: asynchronous identities]
                    self.divergence.flush(self._gather_ticket)
                with torch.autograd._unsafe_preserve_version_counter(self.flat_full):
                    for h in self._handles:
                        h.wait()  # a quantized gather dequantizes into flat_full here
                self._handles = []
                if self._fill_secondary and self.secondary is not None:
                    self.secondary.keep(self.flat_full, self._packed)
                    self._fill_secondary, self._packed = False, {}
                self.evict_shard()  # the gather is done with it; its file still holds it
                for p, view in zip(self.params, self.views, strict=True):
                    mark_gathered(p, view)
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Frees the gathered storage (persistent units stay gathered)."""
        if self.persistent or self.state is not UnitState.UNSHARDED:
            return
        with trace("reshard", self.name):
            for p in self.params:
                mark_sharded(p, self.name)
            self.flat_full.untyped_storage().resize_(0)  # see [Note: unit storage]
        self.state = UnitState.SHARDED

    # --- uses and training state (changed only here; the scheduler and pins call these) ------
    def acquire(self) -> None:
        """One more user needs the unit gathered (a running hook, a `GatheredParameters` pin)."""
        self.in_use += 1

    def release(self) -> bool:
        """A user is done; True when nobody uses the unit any more. The count never goes
        below zero: a pin held over `finish_step` (which forgets every use) stays balanced."""
        self.in_use = max(0, self.in_use - 1)
        return self.in_use == 0

    def begin_forward(self) -> None:
        """A forward with gradients enters the unit."""
        self.acquire()
        self.forward_calls += 1
        self.training_state = TrainingState.FORWARD

    def end_forward(self) -> bool:
        """That forward left the unit; True when nobody uses it any more."""
        self.training_state = TrainingState.IDLE
        return self.release()

    def begin_backward(self) -> None:
        """The backward of one of the unit's forwards starts (gradients reached its outputs)."""
        self.acquire()
        if self.training_state is not TrainingState.POST_BACKWARD:  # reduced stays reduced
            self.training_state = TrainingState.PRE_BACKWARD

    def end_backward_call(self) -> bool:
        """One of those backwards finished; True when it was the last one, so the unit's
        gradients are complete and go to the reduce-scatter (POST_BACKWARD)."""
        self.backward_calls += 1
        self.release()
        if self.backward_calls < self.forward_calls:
            return False
        assert self.training_state is not TrainingState.POST_BACKWARD, (
            f"unit {self.name!r}: gradients reduced twice in one backward"
        )
        self.training_state = TrainingState.POST_BACKWARD
        return True

    @property
    def reduced(self) -> bool:
        """True once this step's gradients went to the reduce-scatter."""
        return self.training_state is TrainingState.POST_BACKWARD

    def finish_step(self) -> None:
        """Forgets this step's uses and calls (after backward): back to IDLE."""
        self.in_use = self.forward_calls = self.backward_calls = 0
        self.training_state = TrainingState.IDLE

    @torch.no_grad()
    def copy_master(self, idx: int) -> None:
        """Casts master `idx` into its chunk of ``flat_shard`` (a no-op when they alias)."""
        self.ensure_shard()
        master, chunk = self.masters[idx], self.shard_chunk(idx)
        if chunk.data_ptr() != master.data_ptr():
            chunk.copy_(master)
            self.shard_modified()

    def regather_if_persistent(self) -> None:
        """Persistent units stay gathered: refresh them from the updated shards."""
        if self.persistent:
            self.state = UnitState.SHARDED
            self.unshard()
            self.wait_for_unshard()

    def refresh_from_masters(self) -> None:
        """Casts every updated master into ``flat_shard``; persistent units re-gather."""
        self.parameters_changed()
        for idx in self.masters:
            self.copy_master(idx)
        self.evict_shard()
        self.regather_if_persistent()

    @torch.no_grad()
    def load_from_full(self, params: list[torch.Tensor]) -> None:
        """Takes the gathered values of `params` (members of this unit) as their new shard
        elements and fp32 masters; other parameters' masters keep their full precision."""
        wanted = {i for i, p in enumerate(self.params) if any(p is q for q in params)}
        self.parameters_changed()
        self.ensure_shard()
        self.shard_modified()
        for piece in self.layout.shard_pieces(self.rank):
            if piece.index not in wanted:
                continue
            span = slice(piece.flat_offset, piece.flat_offset + piece.length)
            self.flat_shard[piece.shard_offset : piece.shard_offset + piece.length].copy_(
                self.flat_full[span]
            )
            seg = self.layout.segment_of[piece.index]
            master = self.masters.get(seg)
            if master is not None:
                start = self.layout.segments[seg].shard_offset
                off = piece.shard_offset - start
                master[off : off + piece.length].copy_(self.flat_full[span])
        self.evict_shard()

    @torch.no_grad()
    def move_master(self, idx: int, device: torch.device) -> None:
        """Places master `idx` (and its gradient) on `device`: a copy, never its shard (partial
        optimizer offload keeps some masters with the compute)."""
        old = self.masters[idx]
        master = torch.nn.Parameter(old.detach().to(device, copy=True))
        master.grad = torch.zeros_like(master)
        self.masters[idx] = master

    @property
    def master_bytes(self) -> int:
        """Bytes of masters that are copies (a master that is the shard itself costs nothing)."""
        shard_start = self.flat_shard.data_ptr()
        shard_end = shard_start + self.flat_shard.numel() * self.flat_shard.element_size()
        return sum(
            m.untyped_storage().nbytes()  # 0 while swapped out to NVMe
            for m in self.masters.values()
            if not shard_start <= m.data_ptr() < shard_end
        )

    @property
    def secondary_bytes(self) -> int:
        """Bytes of hpZ's secondary copy (0 without hpZ)."""
        return 0 if self.secondary is None else self.secondary.nbytes

    @property
    def gathered_numel(self) -> int:
        """Elements currently gathered (0 when sharded)."""
        return 0 if self.state is UnitState.SHARDED else self.numel

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the gathered buffer while gathered or being gathered (0 when sharded)."""
        return self.gathered_numel * self.flat_full.element_size()
