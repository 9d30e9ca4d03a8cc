"""Buckets: runs of tensors, in the order their gradients become ready, reduced together.

Recommended use for ZeRO-2 (and ZeRO-1/3 alike): plan buckets over the backward order, then
give them to :meth:`FlatLayout.build` so each bucket becomes its own padded segment. Each rank
owns an equal, aligned chunk of *every* segment, so a ready bucket is reduced by one in-place
``reduce_scatter(output=shard chunk, input=flat segment)`` (see ``flat.segment_views``):

    plan = plan_buckets(numels, bucket_numel, order=reversed(range(len(numels))))
    layout = FlatLayout.build(numels, world_size, buckets=[b.indices for b in plan])

:func:`rank_ranges` serves the other scheme, whole-tensor buckets over a single-segment layout,
where a bucket's flat range falls unevenly on the ranks' shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from partita.partition.layout import FlatLayout


@dataclass(frozen=True)
class Bucket:
    """Tensor ``indices`` reduced together, in readiness order, and their total ``numel``."""

    indices: tuple[int, ...]
    numel: int


def plan_buckets(
    numels: Sequence[int], bucket_numel: int, order: Iterable[int] | None = None
) -> list[Bucket]:
    """Groups tensors, walked in ``order`` (default: index order), into consecutive runs whose
    total numel is at most ``bucket_numel``; a tensor larger than that gets a bucket of its own.

    Zero-size tensors join the current bucket. ``order`` must be a permutation of the indices;
    for gradient buckets pass the order gradients become ready (reverse registration order is
    the usual first guess). The limit counts tensor elements only; the padding the layout adds
    (under ``align`` per tensor, under ``world_size * align`` per bucket) is not counted.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    walk = list(range(len(numels))) if order is None else [int(i) for i in order]
    if sorted(walk) != list(range(len(numels))):
        raise ValueError(
            f"order must be a permutation of 0..{len(numels) - 1}; got {len(walk)} indices "
            f"(first ones: {walk[:10]})"
        )
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    for i in walk:
        n = int(numels[i])
        if n < 0:
            raise ValueError(f"numels[{i}] must be >= 0, got {n}")
        if n and current and size + n > bucket_numel:
            buckets.append(Bucket(tuple(current), size))
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(Bucket(tuple(current), size))
    return buckets


def rank_ranges(layout: FlatLayout, start: int, end: int) -> list[tuple[int, int, int]]:
    """``(rank, flat_start, flat_end)`` for each rank whose shard meets flat range
    ``[start, end)`` of a single-segment layout, rank ascending (empty ranges left out).

    This is what the whole-tensor bucket scheme has to reduce: each part to its owner (one
    ``reduce`` per part) or all of it (``all_reduce``), since the parts differ in size.
    """
    if not 0 <= start <= end <= layout.padded_numel:
        raise ValueError(f"range [{start}, {end}) is not inside [0, {layout.padded_numel})")
    if start == end:
        return []
    chunk = layout.shard_numel
    out = []
    for rank in range(start // chunk, (end - 1) // chunk + 1):
        lo, hi = layout.shard_range(rank)
        out.append((rank, max(lo, start), min(hi, end)))
    return out
