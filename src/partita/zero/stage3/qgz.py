"""ZeRO++'s quantized gradient reduce-scatter (qgZ): two all-to-all hops of int4 (or int8)
blocks, one inside the node, one across nodes, each summed in fp32; optional error feedback.

[Note: quantized gradient reduce-scatter]
A unit's gradient segment of ``world * c`` elements must end as its sum over every rank, rank r
keeping chunk r (the ZeRO shard layout). With the world cut into N nodes of h consecutive ranks
(rank = node * h + place), chunk j = n * h + p belongs to the rank at place p of node n.

1. Inside the node (the h ranks of this node, ``"hpz"``): the N chunks meant for place p (one
   per node) go, as one row, to this node's rank at place p: the segment viewed (N, h, c) is sent
   as h rows of N * c elements, each packed as int8 (or int4) blocks with fp32 scales
   (`partita.precision.quantize`, ``zero_quantized_gradients_bits``), one all-to-all. Each rank
   dequantizes the h rows it receives and sums them in fp32: the node's sum of its N chunks.
2. Across nodes (the N ranks at this place of every node, ``"hpz_lane"``): row n of that sum
   goes to node n's rank at this place, packed again; each rank dequantizes the N rows it
   receives and sums them in fp32: the world's sum of its own chunk.

The sums are of dequantized values in fp32 at each hop, never of int8 codes, so each hop adds
at most half a quantization step per element and per sender (``scale / 2`` of the block it was
sent in). Bytes each rank sends: ``h`` rows of ``N * c`` then ``N`` rows of ``c`` packed
elements, about ``world * c * (1 + 8 / B)`` bytes at int4 (``world * c * (2 + 8 / B)`` at int8)
against ``world * c * 4`` for an fp32 reduce-scatter, and of those only ``N * c`` cross nodes.
DeepSpeed's ZeRO++ (``all_to_all_quant_reduce``) sends int4 on both hops, with no key to change
it. partita sends int8 by default and int4 with ``zero_quantized_gradients_bits: 4``: over 300
steps of the tiny GPT-2 on the shipped text (`benchmarks/bench_zeropp.py`), int8 ended 0.03% from
plain ZeRO-3's loss, int4 5.8% (2.0% with error feedback), so half the bytes are not the default.

[Note: qgZ error feedback]
With ``zero_quantized_gradients_error_feedback`` each rank keeps, per unit segment and per hop,
what quantizing took from what it sent: ``e = x - dequant(quant(x))`` for the rows it sent (the
node hop's h rows of N * c, the lane hop's N rows of c: ``(world + N) * c`` fp32 elements per
segment, about 1 + 1/h times the unit's gradient). The next reduction of the same segment
(the next micro-batch or step) sends ``quant(x' + e)``: what one send lost, the next one carries,
so over T reductions the sum of what arrived differs from the exact sum by the last residuals
alone (at most ``scale / 2`` per element and sender), not by T independent roundings. The
rank's place in the node and its lane are fixed, so each residual goes back to the same
receiver. `ErrorFeedback.clear` drops it when a step is skipped (overflow: the gradients it
came from were discarded, and their residual would be inf or nan) and on `destroy`. It is
excluded from checkpoints: it is bounded by half a quantization step, tied to this world's node
layout (which a resharded load may change), and a resumed run starting from zeros is exactly
the first step's state. A growth of the fp16 loss scale leaves a residual in the old scale for
one reduction, a bounded error of the same size as the one it corrects.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from partita import comm
from partita.precision.quantize import pack, packed_nbytes, unpack_rows

GRAD_TAG = "grad"
NODE_HOP, LANE_HOP = 0, 1


@dataclass
class ErrorFeedback:
    """What quantizing took from each segment's last sends, per hop ([Note: qgZ error
    feedback]); owned by the reducer."""

    residuals: dict[tuple[Hashable, int], torch.Tensor] = field(default_factory=dict)

    def send(
        self, key: Hashable | None, hop: int, rows: torch.Tensor, q: NodeGroups
    ) -> torch.Tensor:
        """`rows` (fp32, one packed send each) plus the residual kept under (`key`, `hop`),
        packed; keeps the new residual. ``key=None``: no feedback (a pass with zeros)."""
        if key is None:
            return _pack_rows(rows, q.block_size, q.bits)
        kept = self.residuals.get((key, hop))
        x = rows.float() if kept is None else rows.float() + kept
        packed = _pack_rows(x, q.block_size, q.bits)
        sent = unpack_rows(packed, x.shape[0], x.shape[1], q.block_size, torch.float32, q.bits)
        self.residuals[(key, hop)] = x.sub_(sent)
        return packed

    def clear(self) -> None:
        """Drops every residual (a skipped step, or the end of training)."""
        self.residuals.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the residuals held now."""
        return sum(t.numel() * t.element_size() for t in self.residuals.values())


@dataclass(frozen=True)
class NodeGroups:
    """The two hops' groups: this rank's node (h ranks) and its lane across nodes (N ranks),
    and how gradients are quantized on them."""

    node: comm.ProcessGroup | None
    node_size: int
    lane: comm.ProcessGroup | None
    nodes: int
    block_size: int
    bits: int = 8
    """Code width on both hops (``zero_quantized_gradients_bits``)."""
    feedback: ErrorFeedback | None = None
    """Error feedback's state (``zero_quantized_gradients_error_feedback``; None: off)."""


def _pack_rows(rows: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """Each row of `rows` packed on its own, laid end to end."""
    return torch.cat([pack(row, block, bits) for row in rows])


def _send(rows: torch.Tensor, groups: NodeGroups, key: Hashable | None, hop: int) -> torch.Tensor:
    """The packed rows this rank sends on `hop`, with error feedback where it is on."""
    if groups.feedback is None:
        return _pack_rows(rows, groups.block_size, groups.bits)
    return groups.feedback.send(key, hop, rows, groups)


def _sum_rows(received: torch.Tensor, rows: int, numel: int, g: NodeGroups) -> torch.Tensor:
    """The fp32 sum of `rows` packed rows of `numel` elements."""
    return unpack_rows(received, rows, numel, g.block_size, torch.float32, g.bits).sum(dim=0)


class _TwoHops:
    """The reduction in flight: the node hop started; waiting finishes it and runs the lane
    hop, writing the world's sum of this rank's chunk into `out`."""

    def __init__(
        self,
        work: comm.Work | None,
        received: torch.Tensor,
        out: torch.Tensor,
        groups: NodeGroups,
        key: Hashable | None,
    ) -> None:
        self.work, self.received, self.out, self.groups = work, received, out, groups
        self.key = key

    def wait(self) -> bool:
        """Completes both hops (the second runs here, synchronously)."""
        g, c = self.groups, self.out.numel()
        if self.work is not None:
            self.work.wait()
        node_sum = _sum_rows(self.received, g.node_size, g.nodes * c, g)
        send = _send(node_sum.view(g.nodes, c), g, self.key, LANE_HOP)
        received = torch.empty_like(send)
        comm.all_to_all(received, send, group=g.lane, tag=GRAD_TAG)
        total = _sum_rows(received, g.nodes, c, g)
        self.out.copy_(total.view_as(self.out))
        return True


def quantized_reduce_scatter(
    out: torch.Tensor, data: torch.Tensor, groups: NodeGroups, key: Hashable | None = None
) -> _TwoHops:
    """Starts reducing `data` (every rank's ``world * out.numel()`` elements) into this rank's
    chunk `out` in two quantized hops ([Note: quantized gradient reduce-scatter]); `key` names
    the segment for error feedback (None: none, as for a pass with zeros)."""
    g, c = groups, out.numel()
    rows = data.detach().view(g.nodes, g.node_size, c).transpose(0, 1).reshape(g.node_size, -1)
    send = _send(rows, g, key, NODE_HOP)
    received = torch.empty_like(send)
    work = comm.all_to_all(received, send, group=g.node, async_op=True, tag=GRAD_TAG)
    return _TwoHops(work, received, out, g, key)


def sent_bytes(chunk_numel: int, groups: NodeGroups) -> tuple[int, int]:
    """Bytes this rank sends in each hop for one segment (node hop, lane hop), as partita's
    counters record an all-to-all (its whole input)."""
    return hop_bytes(chunk_numel, groups.node_size, groups.nodes, groups.block_size, groups.bits)


def hop_bytes(
    chunk_numel: int, node_size: int, nodes: int, block: int, bits: int
) -> tuple[int, int]:
    """`sent_bytes` from the shape alone (the estimator prices qgZ with it): ``node_size`` packed
    rows of ``nodes * chunk_numel`` elements, then ``nodes`` packed rows of ``chunk_numel``."""
    return (
        node_size * packed_nbytes(nodes * chunk_numel, block, bits),
        nodes * packed_nbytes(chunk_numel, block, bits),
    )


__all__ = [
    "GRAD_TAG",
    "LANE_HOP",
    "NODE_HOP",
    "ErrorFeedback",
    "NodeGroups",
    "hop_bytes",
    "quantized_reduce_scatter",
    "sent_bytes",
]
