"""ZeRO++'s price: bytes per step per link and the memory qwZ, hpZ and qgZ add (stage 3).

[Note: ZeRO++ pricing]
From the units partita's stage 3 builds (`ModelShape.units`, one trainable segment each, laid
out by `FlatLayout.build` over the world: chunk ``c`` per rank) and the engine's own byte
functions, so the figures are the ones partita's counters record ([Note: links] in
`partita.comm.counters`), per rank and per step of ``gas`` micro-batches:

- gathers: every unit is gathered in each micro-batch's forward and again in its backward
  (``stage3_max_reuse_distance`` 0; a reused unit is gathered less, so this is an upper
  bound), ``world * c`` elements each in the module dtype, or packed int8 with a 4-byte scale
  per block under qwZ (`payload_bytes`). Without hpZ all go over the world's group, which spans
  nodes (``inter``). With hpZ the first forward's gather of each unit uses the world's group
  and every later one the node's (``intra``): the secondary copy serves them ([Note: secondary
  copy]);
  A unit whose weights a second module also uses in forward (a tied embedding read again by
  the LM head: `tied_units`) is gathered once more per micro-batch: it was released after the
  embedding and the head needs it again;
- gradients: each unit's segment is reduced once per micro-batch: a reduce-scatter of
  ``world * c`` elements in the reduce dtype over the world's group (``inter``), or under qgZ
  the two all-to-all hops of `hop_bytes`: the node hop ``intra``, the lane across nodes
  ``inter``.

The node is hpZ's group (``zero_hpz_partition_size``), as qgZ requires; without hpZ a job
on several nodes still sends the world group's bytes across them, which this counts as inter
node whole, as the counters do. Memory per rank: hpZ's secondary copy (1/h of each unit, in
the module dtype or as packed int8 under qwZ), qgZ's error-feedback residuals (``(world + N) *
c`` fp32 elements per segment) and the transient packed buffers of one reduction in flight
(its send and receive on the node hop).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from partita.partition.layout import FlatLayout
from partita.precision.quantize import packed_nbytes
from partita.zero.stage3.gather import DEFAULT_BLOCK_SIZE, payload_bytes
from partita.zero.stage3.qgz import hop_bytes

WORLD_GROUP, NODE_GROUP, LANE_GROUP = "", "hpz", "hpz_lane"
"""The names partita's counters give the world's group, hpZ's node group and qgZ's lane."""
LINK_OF = {WORLD_GROUP: "inter", NODE_GROUP: "intra", LANE_GROUP: "inter"}
"""Which link each group's bytes use when a node holds ``zero_hpz_partition_size`` ranks."""


@dataclass(frozen=True)
class ZeroPP:
    """The ZeRO++ options priced (the ``zero_optimization`` keys of the same names)."""

    quantized_weights: bool = False
    quantized_gradients: bool = False
    gradient_bits: int = 8
    error_feedback: bool = False
    hpz: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def label(self) -> str:
        """Short name for a table row: ``qwZ hpZ8 qgZ4+ef``."""
        parts = ["qwZ"] if self.quantized_weights else []
        parts += [f"hpZ{self.hpz}"] if self.hpz > 1 else []
        if self.quantized_gradients:
            parts.append(f"qgZ{self.gradient_bits}" + ("+ef" if self.error_feedback else ""))
        return " ".join(parts)

    @property
    def any(self) -> bool:
        """Whether any option is on (ZeroPP() prices plain stage 3)."""
        return self.quantized_weights or self.quantized_gradients or self.hpz > 1


@dataclass(frozen=True)
class Price:
    """One rank's ZeRO++ figures for one step ([Note: ZeRO++ pricing])."""

    gather: dict[str, int]
    """Parameter gathers' bytes by group name."""
    reduce: dict[str, int]
    """Gradient reductions' bytes by group name."""
    secondary_bytes: int
    """hpZ's secondary copy held between steps."""
    feedback_bytes: int
    """qgZ's error-feedback residuals held between steps."""
    transient_bytes: int
    """qgZ's packed send and receive buffers of the largest reduction in flight."""

    def link_bytes(self, link: str) -> int:
        """Bytes per step on `link` ("intra" or "inter" node)."""
        both = list(self.gather.items()) + list(self.reduce.items())
        return sum(n for group, n in both if LINK_OF[group] == link)


def _chunks(units: tuple[tuple[int, ...], ...], world: int) -> list[int]:
    """Each unit's per-rank chunk, as stage 3 lays it out."""
    return [FlatLayout.build(list(u), world).segments[0].chunk_numel for u in units]


def tied_units(module: torch.nn.Module) -> tuple[tuple[int, ...], ...]:
    """The trainable parameter sizes of the stage-3 units holding a parameter that more than
    one module holds (tied weights: the forward reads the unit twice)."""
    from partita.zero.stage3.strategy import default_unit_modules, plan_units

    holders: Counter[int] = Counter()
    for m in module.modules():
        holders.update(id(p) for p in m.parameters(recurse=False))
    plan, _ = plan_units(module, default_unit_modules(module), 0)
    return tuple(
        tuple(p.numel() for p in params if p.requires_grad)
        for _name, _m, params in plan
        if any(holders[id(p)] > 1 for p in params)
    )


def _gathers(
    chunks: list[int], tied: list[int], world: int, opts: ZeroPP, dtype_bytes: int, gas: int
) -> dict[str, int]:
    block = opts.block_size if opts.quantized_weights else None
    one = sum(payload_bytes(c, world, block, dtype_bytes) for c in chunks)
    again = gas * sum(payload_bytes(c, world, block, dtype_bytes) for c in tied)
    if opts.hpz > 1:
        return {WORLD_GROUP: one, NODE_GROUP: one * (2 * gas - 1) + again}
    return {WORLD_GROUP: one * 2 * gas + again}


def _reductions(chunks: list[int], world: int, opts: ZeroPP, reduce_bytes: int, gas: int) -> dict:
    if not opts.quantized_gradients:
        return {WORLD_GROUP: gas * sum(world * c * reduce_bytes for c in chunks)}
    nodes = world // opts.hpz
    hops = [hop_bytes(c, opts.hpz, nodes, opts.block_size, opts.gradient_bits) for c in chunks]
    return {NODE_GROUP: gas * sum(a for a, _ in hops), LANE_GROUP: gas * sum(b for _, b in hops)}


def _secondary(chunks: list[int], world: int, opts: ZeroPP, dtype_bytes: int) -> int:
    if opts.hpz <= 1:
        return 0
    if opts.quantized_weights:
        return sum(world // opts.hpz * packed_nbytes(c, opts.block_size) for c in chunks)
    return sum(world * c // opts.hpz * dtype_bytes for c in chunks)


def price(
    units: tuple[tuple[int, ...], ...],
    world: int,
    opts: ZeroPP,
    dtype_bytes: int = 4,
    reduce_bytes: int = 4,
    gas: int = 1,
    tied: tuple[tuple[int, ...], ...] = (),
) -> Price:
    """ZeRO++'s bytes per step by group and its memory per rank, for stage-3 `units` (each
    unit's trainable parameter sizes, `ModelShape.units`) on `world` ranks, `gas` micro-batches
    a step; `tied`: the units the forward reads twice (`tied_units`) ([Note: ZeRO++
    pricing])."""
    if opts.hpz < 1 or world % opts.hpz:
        raise ValueError(f"hpZ size {opts.hpz} must be a positive divisor of the world {world}")
    if opts.quantized_gradients and opts.hpz <= 1:
        raise ValueError("qgZ needs a node dimension: hpZ size > 1")
    chunks = _chunks(units, world)
    nodes = world // max(opts.hpz, 1)
    feedback = transient = 0
    if opts.quantized_gradients:
        if opts.error_feedback:
            feedback = sum((world + nodes) * c * 4 for c in chunks)
        largest = max(chunks, default=0)
        transient = 2 * hop_bytes(largest, opts.hpz, nodes, opts.block_size, opts.gradient_bits)[0]
    return Price(
        gather=_gathers(chunks, _chunks(tied, world), world, opts, dtype_bytes, gas),
        reduce=_reductions(chunks, world, opts, reduce_bytes, gas),
        secondary_bytes=_secondary(chunks, world, opts, dtype_bytes),
        feedback_bytes=feedback,
        transient_bytes=transient,
    )


def group_sizes(world: int, opts: ZeroPP) -> dict[str, int]:
    """Ranks in each group `price` names: the world, hpZ's node group, qgZ's lane."""
    return {WORLD_GROUP: world, NODE_GROUP: opts.hpz, LANE_GROUP: world // max(opts.hpz, 1)}


__all__ = ["LINK_OF", "Price", "ZeroPP", "group_sizes", "price", "tied_units"]
