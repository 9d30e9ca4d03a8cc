"""Flat, padded, sharded layout of a parameter group: where each tensor lives, which rank owns what.

Pure integer arithmetic (no tensors, no processes): the same layout describes every buffer that
mirrors the group (16-bit parameters, their gradients, the fp32 master copy, optimizer state),
because offsets are counted in elements, not bytes.

[Note: layout invariants]
The flat buffer is a sequence of *segments* (one per bucket; a single segment when no buckets
are given). Inside a segment the tensors sit back to back in the given order, each start rounded
up to a multiple of ``align`` elements; the segment is then padded to a multiple of
``world_size * align``. Every rank owns the same ``chunk_numel = padded_numel // world_size``
elements of *every* segment: rank r owns ``[flat_start + r * chunk, flat_start + (r + 1) * chunk)``.
A rank's *shard buffer* is the concatenation of its chunks, segment after segment, so:

- a segment is one contiguous range of the flat buffer, so one ``reduce_scatter`` (gradients)
  or one ``all_gather`` (parameters) per segment works in place, without staging copies;
- every rank's shard has the same size and every chunk start is aligned;
- gaps (alignment and tail padding) belong to no tensor; helpers keep them at zero, so they add
  nothing to gradient norms and a zero parameter with a zero gradient stays zero under Adam/SGD.

With one segment this is the plain ZeRO-1 layout: rank r's shard is one flat range,
``shard_range(r)``.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

#: Default alignment in elements: 32 bytes for 16-bit, 64 bytes for fp32 buffers, enough for
#: vectorised kernels and NCCL's preferred chunk alignment, at a cost of < 16 elements a tensor.
DEFAULT_ALIGN = 16


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value`` (``multiple`` >= 1)."""
    return -(-value // multiple) * multiple


def align_for(alignment_bytes: int, dtypes: Iterable[torch.dtype]) -> int:
    """Element alignment that puts every aligned offset on an ``alignment_bytes`` boundary for
    each of ``dtypes`` (e.g. 16 bytes for bf16 and fp32 -> 8 elements)."""
    if alignment_bytes < 1:
        raise ValueError(f"alignment_bytes must be >= 1, got {alignment_bytes}")
    align = 1
    for dtype in dtypes:
        item = torch.empty((), dtype=dtype).element_size()
        align = math.lcm(align, alignment_bytes // math.gcd(alignment_bytes, item))
    return align


@dataclass(frozen=True)
class Piece:
    """The part of tensor ``index`` that one rank owns: ``length`` elements starting at element
    ``param_offset`` of the flattened tensor, at ``flat_offset`` in the flat buffer and at
    ``shard_offset`` in that rank's shard buffer."""

    index: int
    param_offset: int
    flat_offset: int
    shard_offset: int
    length: int


@dataclass(frozen=True)
class Segment:
    """One contiguous, padded range of the flat buffer, sharded evenly over all ranks.

    ``indices`` and ``offsets`` list its tensors in layout order (offsets ascending, absolute in
    the flat buffer). ``shard_offset`` is where this segment's chunk starts in every rank's shard
    buffer. A segment with ``padded_numel == 0`` holds only zero-size tensors (or none): skip its
    collectives.
    """

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    flat_start: int
    padded_numel: int
    shard_offset: int
    world_size: int

    @property
    def flat_end(self) -> int:
        """End (exclusive) of this segment in the flat buffer."""
        return self.flat_start + self.padded_numel

    @property
    def chunk_numel(self) -> int:
        """Elements of this segment each rank owns (equal on every rank)."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat range ``[start, end)`` of ``rank``'s chunk of this segment."""
        start = self.flat_start + rank * self.chunk_numel
        return start, start + self.chunk_numel


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of a group's tensors in one flat buffer and the even split of it over ranks.

    Build with :meth:`build`; see [Note: layout invariants].
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    world_size: int
    align: int
    segments: tuple[Segment, ...]
    segment_of: tuple[int, ...]
    padded_numel: int
    shard_numel: int

    @classmethod
    def build(
        cls,
        numels: Sequence[int],
        world_size: int,
        align: int = DEFAULT_ALIGN,
        buckets: Sequence[Sequence[int]] | None = None,
    ) -> FlatLayout:
        """Lays out tensors of sizes ``numels`` for ``world_size`` ranks.

        ``buckets`` (e.g. ``[b.indices for b in plan_buckets(...)]``) must use every tensor
        index exactly once; each bucket becomes a segment, in the given order, its tensors in
        the given order. Without it, one segment holds all tensors in index order.
        """
        numels = tuple(int(n) for n in numels)
        _check_args(numels, world_size, align)
        groups = (
            [tuple(range(len(numels)))] if buckets is None else _check_buckets(buckets, len(numels))
        )
        offsets = [0] * len(numels)
        segment_of = [0] * len(numels)
        segments: list[Segment] = []
        flat_pos = shard_pos = 0
        for seg_id, indices in enumerate(groups):
            pos = flat_pos
            seg_offsets = []
            for i in indices:
                pos = round_up(pos, align)
                offsets[i] = pos
                segment_of[i] = seg_id
                seg_offsets.append(pos)
                pos += numels[i]
            # Equal, aligned chunks on every rank: [Note: layout invariants].
            padded = round_up(pos - flat_pos, world_size * align)
            segments.append(
                Segment(indices, tuple(seg_offsets), flat_pos, padded, shard_pos, world_size)
            )
            flat_pos += padded
            shard_pos += padded // world_size
        return cls(
            numels=numels,
            offsets=tuple(offsets),
            world_size=world_size,
            align=align,
            segments=tuple(segments),
            segment_of=tuple(segment_of),
            padded_numel=flat_pos,
            shard_numel=shard_pos,
        )

    @property
    def total_numel(self) -> int:
        """Elements that belong to tensors (no padding)."""
        return sum(self.numels)

    @property
    def padding_numel(self) -> int:
        """Elements of the flat buffer that belong to no tensor (alignment gaps and tails)."""
        return self.padded_numel - self.total_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat range ``[start, end)`` of ``rank``'s shard; only for a single-segment layout
        (with buckets, a rank owns one chunk per segment: see :meth:`Segment.shard_range`)."""
        self.check_rank(rank)
        if len(self.segments) != 1:
            raise ValueError(
                f"shard_range needs a single-segment layout; this one has {len(self.segments)} "
                "segments (use segments[k].shard_range(rank) per segment)"
            )
        return self.segments[0].shard_range(rank)

    def shard_pieces(self, rank: int) -> list[Piece]:
        """The parts of tensors that ``rank`` owns, in shard order (shard offsets ascending)."""
        self.check_rank(rank)
        pieces: list[Piece] = []
        for seg in self.segments:
            lo, hi = seg.shard_range(rank)
            # First tensor that may overlap [lo, hi): the last one starting at or before lo.
            k = max(bisect.bisect_right(seg.offsets, lo) - 1, 0)
            for pos in range(k, len(seg.indices)):
                start = seg.offsets[pos]
                if start >= hi:
                    break
                i = seg.indices[pos]
                begin, end = max(start, lo), min(start + self.numels[i], hi)
                if begin < end:
                    shard_off = seg.shard_offset + begin - lo
                    pieces.append(Piece(i, begin - start, begin, shard_off, end - begin))
        return pieces

    def tensor_pieces(self, index: int) -> list[tuple[int, Piece]]:
        """``(rank, piece)`` for every rank that owns part of tensor ``index``, rank ascending."""
        if not 0 <= index < len(self.numels):
            raise IndexError(f"tensor index {index} out of range [0, {len(self.numels)})")
        seg = self.segments[self.segment_of[index]]
        start, numel = self.offsets[index], self.numels[index]
        if numel == 0:
            return []
        chunk = seg.chunk_numel
        first = (start - seg.flat_start) // chunk
        last = (start + numel - 1 - seg.flat_start) // chunk
        out = []
        for rank in range(first, last + 1):
            lo, hi = seg.shard_range(rank)
            begin, end = max(start, lo), min(start + numel, hi)
            piece = Piece(index, begin - start, begin, seg.shard_offset + begin - lo, end - begin)
            out.append((rank, piece))
        return out

    def shard_padding(self, rank: int) -> int:
        """Elements of ``rank``'s shard that belong to no tensor."""
        return self.shard_numel - sum(p.length for p in self.shard_pieces(rank))

    def gaps(self) -> list[tuple[int, int]]:
        """Flat ranges ``[start, end)`` that belong to no tensor, ascending (kept at zero by
        their users: see [Note: layout invariants])."""
        out: list[tuple[int, int]] = []
        for seg in self.segments:
            pos = seg.flat_start
            for i, start in zip(seg.indices, seg.offsets, strict=True):
                if start > pos:
                    out.append((pos, start))
                pos = max(pos, start + self.numels[i])
            if seg.flat_end > pos:
                out.append((pos, seg.flat_end))
        return out

    def flat_span(self, indices: Sequence[int]) -> tuple[int, int] | None:
        """Flat range ``[start, end)`` covering tensors ``indices`` if they are neighbours in one
        segment (in any order; alignment gaps between them allowed), else None."""
        if not indices:
            return None
        seg_ids = {self.segment_of[i] for i in indices}
        if len(seg_ids) != 1:
            return None
        seg = self.segments[seg_ids.pop()]
        positions = sorted(seg.indices.index(i) for i in indices)
        if positions != list(range(positions[0], positions[0] + len(positions))):
            return None
        first, last = seg.indices[positions[0]], seg.indices[positions[-1]]
        return self.offsets[first], self.offsets[last] + self.numels[last]

    def check_rank(self, rank: int) -> None:
        """Raises ValueError unless 0 <= rank < world_size."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")


def _check_args(numels: tuple[int, ...], world_size: int, align: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1 element, got {align}")
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"numels[{i}] must be >= 0, got {n}")


def _check_buckets(buckets: Sequence[Sequence[int]], count: int) -> list[tuple[int, ...]]:
    """Buckets as tuples, after checking they use each of ``range(count)`` exactly once."""
    groups = [tuple(int(i) for i in b) for b in buckets]
    uses = Counter(i for g in groups for i in g)
    if len(uses) != count or any(not 0 <= i < count or n != 1 for i, n in uses.items()):
        missing = sorted(set(range(count)) - set(uses))
        extra = sorted(i for i, n in uses.items() if not 0 <= i < count or n != 1)
        raise ValueError(
            f"buckets must use each tensor index 0..{count - 1} exactly once; "
            f"missing {missing[:10]}, out of range or repeated {extra[:10]}"
        )
    return groups
