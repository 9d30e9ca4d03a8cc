"""partita.partition: flat, padded, sharded layouts of parameter groups, buckets, and the
copies between tensors, flat buffers and shards. Pure tensor math, no processes."""

from __future__ import annotations

from partita.partition.buckets import Bucket, plan_buckets, rank_ranges
from partita.partition.flat import (
    SegmentViews,
    flatten,
    flatten_into,
    pack_shard,
    segment_views,
    shard_view,
    unflatten_into,
    unpack_shard,
    views,
)
from partita.partition.layout import (
    DEFAULT_ALIGN,
    FlatLayout,
    Piece,
    Segment,
    align_for,
    round_up,
)

__all__ = [
    "DEFAULT_ALIGN",
    "Bucket",
    "FlatLayout",
    "Piece",
    "Segment",
    "SegmentViews",
    "align_for",
    "flatten",
    "flatten_into",
    "pack_shard",
    "plan_buckets",
    "rank_ranges",
    "round_up",
    "segment_views",
    "shard_view",
    "unflatten_into",
    "unpack_shard",
    "views",
]
