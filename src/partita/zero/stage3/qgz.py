"""ZeRO++'s quantized gradient reduce-scatter (qgZ): two all-to-all hops of int8 blocks, one
inside the node, one across nodes, each summed in fp32.

[Note: quantized gradient reduce-scatter]
A unit's gradient segment of ``world * c`` elements must end as its sum over every rank, rank r
keeping chunk r (the ZeRO shard layout). With the world cut into N nodes of h consecutive ranks
(rank = node * h + place), chunk j = n * h + p belongs to the rank at place p of node n.

1. Inside the node (the h ranks of this node, ``"hpz"``): the N chunks meant for place p (one
   per node) go, as one row, to this node's rank at place p: the segment viewed (N, h, c) is sent
   as h rows of N * c elements, each packed as int8 blocks with fp32 scales
   (`partita.precision.quantize`), one all-to-all. Each rank dequantizes the h rows it receives
   and sums them in fp32: the node's sum of its N chunks.
2. Across nodes (the N ranks at this place of every node, ``"hpz_lane"``): row n of that sum
   goes to node n's rank at this place, packed again; each rank dequantizes the N rows it
   receives and sums them in fp32: the world's sum of its own chunk.

The sums are of dequantized values in fp32 at each hop, never of int8 codes, so each hop adds
at most half a quantization step per element and per sender (``scale / 2`` of the block it was
sent in); nothing is carried over between steps (DeepSpeed's optional error feedback is not
implemented). Bytes each rank sends: ``h`` rows of ``N * c`` then ``N`` rows of ``c`` packed
elements, about ``world * c * (2 + 8 / B)`` bytes against ``world * c * 4`` for an fp32
reduce-scatter, and of those only ``N * c`` cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from partita import comm
from partita.precision.quantize import pack, packed_nbytes, unpack_rows

GRAD_TAG = "grad"


@dataclass(frozen=True)
class NodeGroups:
    """The two hops' groups: this rank's node (h ranks) and its lane across nodes (N ranks)."""

    node: comm.ProcessGroup | None
    node_size: int
    lane: comm.ProcessGroup | None
    nodes: int
    block_size: int


def _pack_rows(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Each row of `rows` packed on its own, laid end to end."""
    return torch.cat([pack(row, block) for row in rows])


def _sum_rows(received: torch.Tensor, rows: int, numel: int, block: int) -> torch.Tensor:
    """The fp32 sum of `rows` packed rows of `numel` elements."""
    return unpack_rows(received, rows, numel, block, torch.float32).sum(dim=0)


class _TwoHops:
    """The reduction in flight: the node hop started; waiting finishes it and runs the lane
    hop, writing the world's sum of this rank's chunk into `out`."""

    def __init__(
        self, work: comm.Work | None, received: torch.Tensor, out: torch.Tensor, groups: NodeGroups
    ) -> None:
        self.work, self.received, self.out, self.groups = work, received, out, groups

    def wait(self) -> bool:
        """Completes both hops (the second runs here, synchronously)."""
        g, c = self.groups, self.out.numel()
        if self.work is not None:
            self.work.wait()
        node_sum = _sum_rows(self.received, g.node_size, g.nodes * c, g.block_size)
        send = _pack_rows(node_sum.view(g.nodes, c), g.block_size)
        received = torch.empty_like(send)
        comm.all_to_all(received, send, group=g.lane, tag=GRAD_TAG)
        total = _sum_rows(received, g.nodes, c, g.block_size)
        self.out.copy_(total.view_as(self.out))
        return True


def quantized_reduce_scatter(out: torch.Tensor, data: torch.Tensor, groups: NodeGroups) -> _TwoHops:
    """Starts reducing `data` (every rank's ``world * out.numel()`` elements) into this rank's
    chunk `out` in two quantized hops ([Note: quantized gradient reduce-scatter])."""
    g, c = groups, out.numel()
    rows = data.detach().view(g.nodes, g.node_size, c).transpose(0, 1).reshape(g.node_size, -1)
    send = _pack_rows(rows, g.block_size)
    received = torch.empty_like(send)
    work = comm.all_to_all(received, send, group=g.node, async_op=True, tag=GRAD_TAG)
    return _TwoHops(work, received, out, g)


def sent_bytes(chunk_numel: int, groups: NodeGroups) -> tuple[int, int]:
    """Bytes this rank sends in each hop for one segment (node hop, lane hop), as partita's
    counters record an all-to-all (its whole input)."""
    g = groups
    return (
        g.node_size * packed_nbytes(g.nodes * chunk_numel, g.block_size),
        g.nodes * packed_nbytes(chunk_numel, g.block_size),
    )


__all__ = ["GRAD_TAG", "NodeGroups", "quantized_reduce_scatter", "sent_bytes"]
