"""Flat sharded layouts, buckets and flat-buffer copies (partita.partition): no processes."""

from __future__ import annotations

import random

import pytest
import torch

from partita.partition import (
    Bucket,
    FlatLayout,
    Piece,
    align_for,
    flatten,
    flatten_into,
    pack_shard,
    plan_buckets,
    rank_ranges,
    round_up,
    segment_views,
    shard_view,
    unflatten_into,
    unpack_shard,
    views,
)

WORLD_SIZES = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 64]


def _random_numels(rng: random.Random) -> list[int]:
    """Sizes that stress the edges: empty, tiny (< world size), odd, and a few large."""
    kinds = [lambda: 0, lambda: rng.randint(1, 3), lambda: rng.randint(1, 700), lambda: 5003]
    weights = [1, 3, 6, 1]
    return [rng.choices(kinds, weights)[0]() for _ in range(rng.randint(0, 14))]


def _random_layout(rng: random.Random) -> FlatLayout:
    numels = _random_numels(rng)
    world, align = rng.choice(WORLD_SIZES), rng.choice([1, 2, 4, 8, 16])
    if rng.random() < 0.5:
        return FlatLayout.build(numels, world, align)
    order = list(range(len(numels)))
    rng.choice([order.reverse, lambda: rng.shuffle(order), lambda: None])()
    plan = plan_buckets(numels, rng.randint(1, 2000), order)
    return FlatLayout.build(numels, world, align, buckets=[b.indices for b in plan])


def _check_invariants(layout: FlatLayout) -> None:
    """Everything the zero/ code relies on, checked element by element."""
    world, align = layout.world_size, layout.align
    assert layout.shard_numel * world == layout.padded_numel
    flat_pos = shard_pos = 0
    for seg in layout.segments:
        # Segments tile the flat buffer and the shard buffer, each aligned and evenly split.
        assert (seg.flat_start, seg.shard_offset) == (flat_pos, shard_pos)
        assert seg.padded_numel % (world * align) == 0
        assert seg.chunk_numel % align == 0
        flat_pos, shard_pos = seg.flat_end, shard_pos + seg.chunk_numel
        ends = [off + layout.numels[i] for i, off in zip(seg.indices, seg.offsets, strict=True)]
        assert list(seg.offsets) == sorted(seg.offsets)
        assert all(a <= b for a, b in zip(ends, seg.offsets[1:], strict=False))  # no overlap
        assert all(
            seg.flat_start <= o and e <= seg.flat_end
            for o, e in zip(seg.offsets, ends, strict=True)
        )
        assert all(layout.offsets[i] == o for i, o in zip(seg.indices, seg.offsets, strict=True))
    assert (flat_pos, shard_pos) == (layout.padded_numel, layout.shard_numel)
    assert all(o % align == 0 for o in layout.offsets)

    # Every flat element belongs to exactly one rank; tensors plus gaps cover it exactly once.
    owners = torch.zeros(layout.padded_numel, dtype=torch.int64)
    for seg in layout.segments:
        for rank in range(world):
            lo, hi = seg.shard_range(rank)
            owners[lo:hi] += 1
    assert bool((owners == 1).all())
    used = torch.zeros(layout.padded_numel, dtype=torch.int64)
    for off, n in zip(layout.offsets, layout.numels, strict=True):
        used[off : off + n] += 1
    for start, end in layout.gaps():
        assert start < end
        used[start:end] += 1
    assert bool((used == 1).all())

    # Pieces of every rank reconstruct every tensor exactly once, consistently with the flat
    # and shard coordinates, and agree with tensor_pieces.
    covered = [torch.zeros(n, dtype=torch.int64) for n in layout.numels]
    by_tensor: dict[int, list[tuple[int, Piece]]] = {i: [] for i in range(len(layout.numels))}
    for rank in range(world):
        pieces = layout.shard_pieces(rank)
        assert [p.shard_offset for p in pieces] == sorted(p.shard_offset for p in pieces)
        for p in pieces:
            assert p.length > 0
            assert p.flat_offset == layout.offsets[p.index] + p.param_offset
            seg = layout.segments[layout.segment_of[p.index]]
            lo, hi = seg.shard_range(rank)
            assert lo <= p.flat_offset and p.flat_offset + p.length <= hi
            assert p.shard_offset == seg.shard_offset + p.flat_offset - lo
            covered[p.index][p.param_offset : p.param_offset + p.length] += 1
            by_tensor[p.index].append((rank, p))
        assert layout.shard_padding(rank) == layout.shard_numel - sum(p.length for p in pieces)
    assert all(bool((c == 1).all()) for c in covered)
    for i, expected in by_tensor.items():
        assert layout.tensor_pieces(i) == expected


def test_random_layouts_keep_every_invariant() -> None:
    rng = random.Random(20240611)
    for _ in range(150):
        _check_invariants(_random_layout(rng))


@pytest.mark.parametrize("world", range(1, 65))
def test_every_world_size_up_to_64(world: int) -> None:
    numels = [7, 0, 1, 130, 3, 64, 2]
    for align in (1, 16):
        layout = FlatLayout.build(numels, world, align)
        _check_invariants(layout)
        assert layout.padded_numel == round_up(layout.padded_numel, world * align)
        last_end = max(o + n for o, n in zip(layout.offsets, numels, strict=True))
        assert layout.padded_numel - last_end < world * align  # no more padding than needed


def test_uneven_sizes_exact_pieces() -> None:
    layout = FlatLayout.build([3, 5, 7], world_size=4, align=1)
    assert (layout.total_numel, layout.padded_numel, layout.shard_numel) == (15, 16, 4)
    assert layout.offsets == (0, 3, 8)
    assert [layout.shard_range(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert layout.shard_pieces(0) == [Piece(0, 0, 0, 0, 3), Piece(1, 0, 3, 3, 1)]
    assert layout.shard_pieces(1) == [Piece(1, 1, 4, 0, 4)]
    assert layout.shard_pieces(2) == [Piece(2, 0, 8, 0, 4)]
    assert layout.shard_pieces(3) == [Piece(2, 4, 12, 0, 3)]
    assert [layout.shard_padding(r) for r in range(4)] == [0, 0, 0, 1]
    assert layout.tensor_pieces(2) == [(2, Piece(2, 0, 8, 0, 4)), (3, Piece(2, 4, 12, 0, 3))]
    assert layout.gaps() == [(15, 16)]


def test_alignment_puts_gaps_between_tensors() -> None:
    layout = FlatLayout.build([3, 5], world_size=2, align=4)
    assert layout.offsets == (0, 4)
    assert (layout.padded_numel, layout.shard_numel, layout.padding_numel) == (16, 8, 8)
    assert layout.gaps() == [(3, 4), (9, 16)]
    assert layout.shard_pieces(1) == [Piece(1, 4, 8, 0, 1)]


def test_tiny_group_on_many_ranks() -> None:
    layout = FlatLayout.build([1], world_size=64, align=1)
    assert (layout.padded_numel, layout.shard_numel) == (64, 1)
    assert layout.shard_pieces(0) == [Piece(0, 0, 0, 0, 1)]
    assert all(layout.shard_pieces(r) == [] for r in range(1, 64))
    assert all(layout.shard_padding(r) == 1 for r in range(1, 64))


@pytest.mark.parametrize("numels", [[], [0], [0, 0, 0]])
def test_empty_groups(numels: list[int]) -> None:
    layout = FlatLayout.build(numels, world_size=8)
    assert (layout.total_numel, layout.padded_numel, layout.shard_numel) == (0, 0, 0)
    assert len(layout.segments) == 1 and layout.segments[0].padded_numel == 0
    assert all(layout.shard_pieces(r) == [] for r in range(8))
    assert layout.shard_range(5) == (0, 0)
    assert layout.gaps() == []
    assert all(layout.tensor_pieces(i) == [] for i in range(len(numels)))
    tensors = [torch.empty(0) for _ in numels]
    flat = flatten(tensors, layout)
    assert flat.numel() == 0
    assert [v.shape for v in views(flat, layout, [(0,)] * len(numels))] == [(0,)] * len(numels)
    assert shard_view(flat, layout, 7).numel() == 0
    assert plan_buckets(numels, 4) == ([Bucket(tuple(range(len(numels))), 0)] if numels else [])


def test_buckets_become_segments_in_their_order() -> None:
    numels = [10, 20, 30, 40]
    plan = plan_buckets(numels, 50, order=[3, 2, 1, 0])
    assert plan == [Bucket((3,), 40), Bucket((2, 1), 50), Bucket((0,), 10)]
    layout = FlatLayout.build(numels, 3, align=2, buckets=[b.indices for b in plan])
    assert [s.indices for s in layout.segments] == [(3,), (2, 1), (0,)]
    assert [(s.flat_start, s.padded_numel) for s in layout.segments] == [
        (0, 42),
        (42, 54),
        (96, 12),
    ]
    assert layout.offsets == (96, 72, 42, 0)
    assert [s.shard_offset for s in layout.segments] == [0, 14, 32]
    assert layout.shard_numel == 36
    _check_invariants(layout)
    with pytest.raises(ValueError, match="single-segment"):
        layout.shard_range(0)


def test_flat_span() -> None:
    layout = FlatLayout.build([3, 5, 7, 2], world_size=2, align=4, buckets=[[0, 1, 2], [3]])
    assert layout.flat_span([1, 0]) == (0, 9)
    assert layout.flat_span([1, 2]) == (4, 19)
    assert layout.flat_span([0, 2]) is None
    assert layout.flat_span([2, 3]) is None
    assert layout.flat_span([]) is None


def test_align_for() -> None:
    assert align_for(16, [torch.bfloat16, torch.float32]) == 8
    assert align_for(16, [torch.float32]) == 4
    assert align_for(16, [torch.float64]) == 2
    assert align_for(1, [torch.float16]) == 1
    assert align_for(6, [torch.float32]) == 3  # 3 * 4 bytes = 12, a multiple of 6
    with pytest.raises(ValueError, match="alignment_bytes"):
        align_for(0, [torch.float32])


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        FlatLayout.build([1], 0)
    with pytest.raises(ValueError, match="align must be >= 1 element, got 0"):
        FlatLayout.build([1], 2, align=0)
    with pytest.raises(ValueError, match=r"numels\[1\] must be >= 0, got -3"):
        FlatLayout.build([1, -3], 2)
    with pytest.raises(ValueError, match=r"missing \[2\]"):
        FlatLayout.build([1, 1, 1], 2, buckets=[[0], [1]])
    with pytest.raises(ValueError, match=r"repeated \[1\]"):
        FlatLayout.build([1, 1, 1], 2, buckets=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"repeated \[5\]"):
        FlatLayout.build([1, 1], 2, buckets=[[0, 1, 5]])
    layout = FlatLayout.build([4], 2)
    with pytest.raises(ValueError, match="rank 2 out of range for world_size 2"):
        layout.shard_pieces(2)
    with pytest.raises(IndexError, match="tensor index 1"):
        layout.tensor_pieces(1)


def _tensors(numels_shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in numels_shapes]


SHAPES = [(3, 4), (), (0,), (5,), (2, 0, 3), (7, 1, 3), (1,)]


@pytest.mark.parametrize("buckets", [None, [[6, 5], [4, 3, 2], [1, 0]]])
def test_flatten_views_round_trip(buckets: list[list[int]] | None) -> None:
    tensors = _tensors(SHAPES, seed=0)
    layout = FlatLayout.build([t.numel() for t in tensors], 3, align=4, buckets=buckets)
    flat = torch.full((layout.padded_numel,), float("nan"))
    flatten_into(tensors, flat, layout)
    for start, end in layout.gaps():  # stale values in the padding are cleared
        assert bool((flat[start:end] == 0).all())
    aliases = views(flat, layout, [t.shape for t in tensors])
    assert all(torch.equal(a, t) for a, t in zip(aliases, tensors, strict=True))
    aliases[0].fill_(2.0)  # views write through to the flat buffer
    assert bool((flat[layout.offsets[0] : layout.offsets[0] + 12] == 2.0).all())

    out = [torch.zeros_like(t) for t in tensors]
    unflatten_into(flat, layout, out)
    assert torch.equal(out[0], torch.full((3, 4), 2.0))
    assert all(torch.equal(o, t) for o, t in zip(out[1:], tensors[1:], strict=True))
    copy = flatten(tensors, layout, dtype=torch.float64)
    assert copy.dtype == torch.float64 and copy.numel() == layout.padded_numel


def test_pack_and_unpack_shards() -> None:
    tensors = _tensors(SHAPES, seed=1)
    numels = [t.numel() for t in tensors]
    for buckets in (None, [b.indices for b in plan_buckets(numels, 12, reversed(range(7)))]):
        layout = FlatLayout.build(numels, 4, align=2, buckets=buckets)
        flat = flatten(tensors, layout)
        rebuilt = [torch.zeros_like(t) for t in tensors]
        for rank in range(4):
            shard = torch.full((layout.shard_numel,), float("nan"))
            pack_shard(tensors, shard, layout, rank)
            chunks = [
                segment_views(flat, shard, layout, k, rank) for k in range(len(layout.segments))
            ]
            expected = [
                c.full[rank * s.chunk_numel : (rank + 1) * s.chunk_numel]
                for c, s in zip(chunks, layout.segments, strict=True)
            ]
            assert torch.equal(shard, torch.cat(expected))
            if buckets is None:
                assert torch.equal(shard, shard_view(flat, layout, rank))
            unpack_shard(shard, layout, rank, rebuilt)
        assert all(torch.equal(r, t) for r, t in zip(rebuilt, tensors, strict=True))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_bucketed_reduce_scatter_and_all_gather(world: int) -> None:
    """The ZeRO-2 scheme: one in-place reduce-scatter per bucket gives every rank the summed
    gradients of exactly its shard; one all-gather per bucket rebuilds the full buffer."""
    shapes = [(33,), (4, 5), (1,), (0,), (17, 3), (2,), (129,)]
    numels = [torch.Size(s).numel() for s in shapes]
    plan = plan_buckets(numels, 60, order=reversed(range(len(shapes))))
    layout = FlatLayout.build(numels, world, align=4, buckets=[b.indices for b in plan])
    # Integer-valued grads keep the sums exact whatever the summation order.
    grads = [[torch.randint(-9, 9, s).float() for s in shapes] for _ in range(world)]
    flats = [flatten(g, layout) for g in grads]
    shards = [torch.full((layout.shard_numel,), float("nan")) for _ in range(world)]
    for k, seg in enumerate(layout.segments):
        ins = [segment_views(flats[r], shards[r], layout, k, r) for r in range(world)]
        total = torch.stack([v.full for v in ins]).sum(0).view(world, seg.chunk_numel)
        for r in range(world):  # what reduce_scatter(output=shard, input=full) leaves on rank r
            ins[r].shard.copy_(total[r])
    summed = [torch.stack(ts).sum(0) for ts in zip(*grads, strict=True)]
    for r in range(world):
        expected = torch.empty(layout.shard_numel)
        pack_shard(summed, expected, layout, r)
        assert torch.equal(shards[r], expected)

    gathered = torch.full((layout.padded_numel,), float("nan"))
    for k, seg in enumerate(layout.segments):
        for r in range(world):  # what all_gather(output=full, input=shard) writes for rank r
            v = segment_views(gathered, shards[r], layout, k, r)
            v.full.view(world, seg.chunk_numel)[r].copy_(v.shard)
    params = views(gathered, layout, shapes)
    assert all(torch.equal(p, s) for p, s in zip(params, summed, strict=True))


def test_buffer_checks() -> None:
    layout = FlatLayout.build([3, 5], 2, align=1)
    with pytest.raises(ValueError, match="flat buffer must be a contiguous 1-D tensor of 8"):
        flatten_into([torch.zeros(3), torch.zeros(5)], torch.zeros(9), layout)
    with pytest.raises(ValueError, match="tensor 1 has 4 elements, layout says 5"):
        flatten_into([torch.zeros(3), torch.zeros(4)], torch.zeros(8), layout)
    with pytest.raises(ValueError, match=r"shape \(2, 2\) of tensor 1 has 4 elements"):
        views(torch.zeros(8), layout, [(3,), (2, 2)])
    with pytest.raises(ValueError, match="shard buffer must be"):
        pack_shard([torch.zeros(3), torch.zeros(5)], torch.zeros(5), layout, 0)
    with pytest.raises(ValueError, match="contiguous"):
        shard_view(torch.zeros(16)[::2], layout, 0)


def test_plan_buckets_respects_limit_and_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        numels = _random_numels(rng)
        order = list(range(len(numels)))
        rng.shuffle(order)
        limit = rng.randint(1, 1500)
        plan = plan_buckets(numels, limit, order)
        assert [i for b in plan for i in b.indices] == order
        for k, b in enumerate(plan):
            assert b.numel == sum(numels[i] for i in b.indices)
            assert b.numel <= limit or len([i for i in b.indices if numels[i]]) == 1
            if k + 1 < len(plan):  # greedy: the next bucket's first tensor did not fit here
                assert b.numel + numels[plan[k + 1].indices[0]] > limit


def test_plan_buckets_edges() -> None:
    assert plan_buckets([], 10) == []
    assert plan_buckets([5, 0, 5, 11, 0, 3], 10) == [
        Bucket((0, 1, 2), 10),
        Bucket((3, 4), 11),
        Bucket((5,), 3),
    ]
    with pytest.raises(ValueError, match="bucket_numel must be >= 1, got 0"):
        plan_buckets([1], 0)
    with pytest.raises(ValueError, match=r"order must be a permutation of 0\.\.1"):
        plan_buckets([1, 2], 4, order=[0, 0])


def test_rank_ranges_split_a_range_by_owner() -> None:
    rng = random.Random(3)
    for _ in range(100):
        layout = FlatLayout.build(_random_numels(rng), rng.choice(WORLD_SIZES), rng.choice([1, 4]))
        start = rng.randint(0, layout.padded_numel)
        end = rng.randint(start, layout.padded_numel)
        parts = rank_ranges(layout, start, end)
        assert [p[0] for p in parts] == sorted({p[0] for p in parts})
        pos = start
        for rank, lo, hi in parts:  # consecutive, non-empty, inside the owner's shard
            s_lo, s_hi = layout.shard_range(rank)
            assert lo == pos and lo < hi and s_lo <= lo and hi <= s_hi
            pos = hi
        assert pos == end
    with pytest.raises(ValueError, match=r"range \[3, 99\)"):
        rank_ranges(FlatLayout.build([10], 2), 3, 99)
