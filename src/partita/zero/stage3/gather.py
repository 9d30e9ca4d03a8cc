"""How a unit's segments travel when it is gathered: ZeRO++'s quantized weights (qwZ) and
hierarchical secondary partition (hpZ).

[Note: ZeRO++ gathers]
A training gather (tag "param") of one segment moves this rank's chunk to every rank of a group.
Two choices, each made per gather and the same on every rank:

- what travels: the chunk in the module dtype (exact), or, with ``zero_quantized_weights`` (and,
  with ``zero_quantized_nontrainable_weights``, for the frozen segment), the chunk as int8 blocks
  with one fp32 scale per block, packed in one uint8 buffer ([Note: block quantization] in
  `partita.precision.quantize`), dequantized into the gathered buffer on arrival. The shard,
  the fp32 masters and the optimizer state never see quantized values; only the gathered
  parameters the forward and backward compute with do. The same shard quantizes to the same
  bytes on every gather, so backward's re-gather hands autograd the weights forward used.
- where from: the primary shard over the ZeRO group (every rank), or, with
  ``zero_hpz_partition_size`` = h, a secondary copy cut over the h consecutive ranks of this
  rank's node group. The first training gather after the parameters change (a step, a load)
  takes the primary path and leaves each rank its 1/h slice of it (under qwZ the packed bytes,
  [Note: secondary copy] in `partita.zero.stage3.secondary`); every later training
  gather of the unit until the next change (backward's re-gather, further micro-batches of
  gradient accumulation, recomputation) reads the secondary copies over the node group, so it
  never crosses nodes, and hands the same weights the first gather did. Memory: each rank holds
  1/h of every non-persistent unit beside its 1/world shard, in the module dtype (one byte per
  element plus scales where quantized).

Gathers for anything else (``GatheredParameters``, saving, persistent units' refresh after the
step) stay exact and primary, as DeepSpeed's are: a saved model never holds quantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from partita import comm
from partita.comm.dims import node_block_group, node_lane_group
from partita.config.errors import config_error
from partita.precision.quantize import check_block_size, pack, packed_nbytes, unpack_rows
from partita.zero.stage3.qgz import ErrorFeedback, NodeGroups
from partita.zero.stage3.settings import Stage3Settings

DEFAULT_BLOCK_SIZE = 2048
"""Elements per quantization block (one fp32 scale each: 0.2% more bytes than int8 alone)."""

TRAINING = "param"
"""The tag of training gathers, the only ones ZeRO++ changes ([Note: ZeRO++ gathers])."""


@dataclass(frozen=True)
class SecondaryGroup:
    """hpZ's node group: the ranks a secondary copy is cut over."""

    group: comm.ProcessGroup | None
    size: int
    """h, ``zero_hpz_partition_size``."""
    rank: int
    """This rank's place in the group."""


@dataclass(frozen=True)
class GatherPlan:
    """How training gathers move a unit's segments ([Note: ZeRO++ gathers])."""

    quantize_trainable: bool = False
    """``zero_quantized_weights``: every segment travels as int8 blocks."""
    quantize_frozen: bool = False
    """``zero_quantized_nontrainable_weights`` (or the above): the frozen segment does."""
    block_size: int = DEFAULT_BLOCK_SIZE
    secondary: SecondaryGroup | None = None
    """hpZ's node group (None: off)."""

    def __post_init__(self) -> None:
        check_block_size(0, self.block_size)  # positive integer (0 elements: any size divides)

    def quantizes(self, frozen: bool) -> bool:
        """Whether a training gather of a trainable (`frozen` False) or frozen segment is
        quantized."""
        return self.quantize_trainable or (frozen and self.quantize_frozen)


EXACT = GatherPlan()
"""Plain ZeRO-3: every gather exact, from the primary shard."""


class DequantizingGather:
    """A gather of packed chunks in flight: waiting dequantizes them into `out`, one row of
    ``out.numel() // ranks`` elements per rank."""

    def __init__(
        self,
        work: comm.Work | None,
        packed: torch.Tensor,
        out: torch.Tensor,
        ranks: int,
        block: int,
    ) -> None:
        self.work, self.packed, self.out = work, packed, out
        self.ranks, self.block = ranks, block

    def wait(self) -> bool:
        """Completes the gather and dequantizes every rank's chunk into `out`."""
        if self.work is not None:
            self.work.wait()
        chunk = self.out.numel() // self.ranks
        rows = unpack_rows(self.packed, self.ranks, chunk, self.block, self.out.dtype)
        self.out.view(self.ranks, chunk).copy_(rows)
        return True


def gather_segment(
    out: torch.Tensor,
    src: torch.Tensor,
    group: comm.ProcessGroup | None,
    ranks: int,
    block: int | None,
    tag: str,
) -> comm.Work | DequantizingGather | None:
    """Starts gathering every rank's `src` (one chunk of `out.numel() // ranks` elements) into
    `out` over `group` of `ranks` ranks: exact when `block` is None, else as packed int8 blocks
    of `block` elements dequantized when the returned handle is waited for."""
    if block is None:
        return comm.all_gather(out, src, group=group, async_op=True, tag=tag)
    packed = pack(src.to(out.device), block)
    gathered = torch.empty(ranks * packed.numel(), dtype=torch.uint8, device=out.device)
    work = comm.all_gather(gathered, packed, group=group, async_op=True, tag=tag)
    return DequantizingGather(work, gathered, out, ranks, block)


def gather_packed(
    out: torch.Tensor,
    packed: torch.Tensor,
    group: comm.ProcessGroup | None,
    ranks: int,
    chunks: int,
    block: int,
    tag: str,
) -> DequantizingGather:
    """Starts gathering every rank's `packed` bytes (each holding ``chunks / ranks`` packed
    chunks, hpZ's quantized secondary slices) over `group` of `ranks` ranks, dequantized into
    `out` (``chunks`` chunks) when waited for."""
    gathered = torch.empty(ranks * packed.numel(), dtype=torch.uint8, device=out.device)
    work = comm.all_gather(gathered, packed.to(out.device), group=group, async_op=True, tag=tag)
    return DequantizingGather(work, gathered, out, chunks, block)


def payload_bytes(chunk_numel: int, ranks: int, block: int | None, element_size: int) -> int:
    """Bytes one gather of a segment moves as partita's counters record it (the gathered
    output): `ranks` chunks of `chunk_numel` elements, exact or packed."""
    if block is None:
        return ranks * chunk_numel * element_size
    return ranks * packed_nbytes(chunk_numel, block)


HPZ_KEY = "zero_optimization.zero_hpz_partition_size"


def check_hpz_size(size: int, world: int, zero_world: int) -> None:
    """Raises the config error naming ``zero_hpz_partition_size`` unless `size` divides the
    `world` and ZeRO shards over the whole world (`zero_world` ranks). No collective: every
    rank raises alike."""
    if size < 1 or size > world or world % size:
        raise config_error(
            HPZ_KEY,
            f"{size} must be a positive divisor of the world size {world} (node groups of equal "
            "size, consecutive ranks)",
        )
    if zero_world != world:
        raise config_error(
            HPZ_KEY,
            f"{size}: hpZ needs ZeRO sharded over every rank; here it shards over {zero_world} "
            f"of {world} ranks (an mpu, sequence parallelism or mics_shard_size); use 1",
        )


def plan_from_config(zero: Stage3Settings, group: comm.ProcessGroup | None) -> GatherPlan:
    """The training gathers' plan for stage 3 from its settings: qwZ's quantization and
    hpZ's node group (made here, collectively, after its size is checked on every rank)."""
    size = zero.hpz_partition_size
    secondary = None
    if size > 1:
        check_hpz_size(size, comm.get_world_size(), comm.get_world_size(group))
        node, _ = node_block_group(size, "hpz")
        secondary = SecondaryGroup(node, size, comm.get_rank(group) % size)
    weights = zero.quantized_weights
    return GatherPlan(
        quantize_trainable=weights,
        quantize_frozen=weights or zero.quantized_nontrainable_weights,
        secondary=secondary,
    )


QGZ_KEY = "zero_optimization.zero_quantized_gradients"


def reduce_groups_from_config(zero: Stage3Settings, plan: GatherPlan) -> NodeGroups | None:
    """qgZ's two hops (``zero_quantized_gradients``; None when off): hpZ's node group, and the
    lane across nodes made here (collectively). The node dimension is hpZ's: without
    ``zero_hpz_partition_size`` > 1 partita knows no nodes, and refuses naming the key."""
    if not zero.quantized_gradients:
        return None
    if plan.secondary is None:
        raise config_error(
            QGZ_KEY,
            "true needs a node dimension: set zero_optimization.zero_hpz_partition_size to the "
            "ranks of one node (qgZ reduces inside each node of that many consecutive ranks, "
            "then across nodes)",
        )
    size = plan.secondary.size
    lane, ranks = node_lane_group(size, "hpz_lane")
    feedback = ErrorFeedback() if zero.quantized_gradients_error_feedback else None
    return NodeGroups(
        plan.secondary.group, size, lane, len(ranks), plan.block_size,
        bits=zero.quantized_gradients_bits, feedback=feedback,
    )  # fmt: skip


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "EXACT",
    "HPZ_KEY",
    "QGZ_KEY",
    "TRAINING",
    "DequantizingGather",
    "GatherPlan",
    "SecondaryGroup",
    "check_hpz_size",
    "gather_packed",
    "gather_segment",
    "payload_bytes",
    "plan_from_config",
    "reduce_groups_from_config",
]
