"""One ZeRO-3 unit: parameters that are gathered together, with one all-gather per segment.

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

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from partita import comm
from partita.accelerator import pin_if
from partita.offload import SwappedTensor, SwapSpace
from partita.partition import FlatLayout
from partita.zero.placeholder import mark_gathered, mark_sharded


class UnitState(enum.Enum):
    """Where a unit's parameters are."""

    SHARDED = "sharded"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"


@dataclass
class SegmentInfo:
    """One segment of a unit: the parameters of one optimizer group, or the frozen ones."""

    index: int
    group: int | None
    """Optimizer group index; None for frozen parameters."""
    params: list[torch.nn.Parameter]


class ShardedUnit:
    """A unit's layout, storage and transitions (`unshard`, `wait_for_unshard`, `reshard`)."""

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
    ) -> None:
        self.name = name
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
        self.numel = self.layout.padded_numel
        self.reshard()
        # Parameter offload to NVMe: the shard lives in a swap file between uses.
        self.shard_swap = (
            SwappedTensor(self.flat_shard, shard_space, f"param.{name}")
            if shard_space is not None and not persistent
            else None
        )
        self.evict_shard()

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
        if self.shard_swap is not None:
            self.shard_swap.fetch()

    def ensure_shard(self) -> None:
        """Makes ``flat_shard`` readable (blocking read under NVMe parameter offload)."""
        if self.shard_swap is not None:
            self.shard_swap.ensure()

    def shard_modified(self) -> None:
        """``flat_shard`` was written: the next `evict_shard` writes it back."""
        if self.shard_swap is not None:
            self.shard_swap.modified()

    def evict_shard(self) -> None:
        """Under NVMe parameter offload, writes a changed shard back and frees its memory."""
        if self.shard_swap is not None:
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
        self.ensure_shard()
        self.flat_full.untyped_storage().resize_(
            self.flat_full.numel() * self.flat_full.element_size()
        )
        with torch.autograd._unsafe_preserve_version_counter(self.flat_full):
            for i, seg in enumerate(self.layout.segments):
                if seg.padded_numel == 0:
                    continue
                out = self.flat_full[seg.flat_start : seg.flat_end]
                src = self.shard_chunk(i).to(out.device, non_blocking=True)
                handle = comm.all_gather(out, src, group=self.process_group, async_op=True, tag=tag)
                if handle is not None:
                    self._handles.append(handle)
        self.state = UnitState.UNSHARDING

    def wait_for_unshard(self, tag: str = "param") -> None:
        """Completes a started gather and points the parameters at the gathered values."""
        if self.state is UnitState.SHARDED:
            self.unshard(tag)
        if self.state is UnitState.UNSHARDING:
            for h in self._handles:
                h.wait()
            self._handles = []
            self.evict_shard()  # the gather is done with it; its file still holds it
            for p, view in zip(self.params, self.views, strict=True):
                mark_gathered(p, view)
            self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Frees the gathered storage (persistent units stay gathered)."""
        if self.persistent or self.state is not UnitState.UNSHARDED:
            return
        for p in self.params:
            mark_sharded(p, self.name)
        self.flat_full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

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
        for idx in self.masters:
            self.copy_master(idx)
        self.evict_shard()
        self.regather_if_persistent()

    @torch.no_grad()
    def load_from_full(self, params: list[torch.Tensor]) -> None:
        """Takes the gathered values of `params` (members of this unit) as their new shard
        elements and fp32 masters; other parameters' masters keep their full precision."""
        wanted = {i for i, p in enumerate(self.params) if any(p is q for q in params)}
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
    def gathered_numel(self) -> int:
        """Elements currently gathered (0 when sharded)."""
        return 0 if self.state is UnitState.SHARDED else self.numel
