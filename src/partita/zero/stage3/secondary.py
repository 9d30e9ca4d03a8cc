"""hpZ's secondary copy of one unit: this rank's 1/h of the gathered parameters, re-gathered
over its node group ([Note: ZeRO++ gathers] in `partita.zero.stage3.gather`).

[Note: secondary copy]
A segment of ``world * c`` elements is cut over h node ranks: the rank at place p keeps the
k = world / h whole shard chunks p * k ... (p + 1) * k - 1. For a segment gathered exact, it
keeps their values (module dtype). For a segment gathered quantized (qwZ), it keeps the packed
bytes those k chunks arrived as (int8 values and scales, `partita.precision.quantize`), not
their dequantized values: the node-group gather then hands every rank the very bytes the
primary gather did, so backward and later micro-batches compute with bit-identical weights to
the first forward, no second rounding is added, and the copy costs one byte per element (plus
scales) instead of the dtype's.
"""

from __future__ import annotations

from typing import Any

import torch

from partita.partition import FlatLayout
from partita.zero.stage3.gather import SecondaryGroup, gather_packed, gather_segment


class SecondaryCopy:
    """One unit's secondary copy ([Note: secondary copy])."""

    def __init__(
        self,
        group: SecondaryGroup,
        layout: FlatLayout,
        world: int,
        quantized: set[int],
        like: torch.Tensor,
    ) -> None:
        self.group, self.layout, self.world, self.quantized = group, layout, world, quantized
        exact = [i for i, seg in enumerate(layout.segments) if i not in quantized]
        self.flat = (
            torch.zeros(layout.padded_numel // group.size, dtype=like.dtype, device=like.device)
            if exact
            else None
        )
        """Values of the exact segments' slices (laid out like the full buffer, over h)."""
        self.packed: dict[int, torch.Tensor] = {}
        """Packed bytes of the quantized segments' k chunks, by segment."""
        self.valid = False
        """The copy holds the current parameters (reset when they change)."""

    def keep(self, full: torch.Tensor, packed: dict[int, torch.Tensor]) -> None:
        """Takes this rank's slice of a primary training gather: `full` the gathered buffer,
        `packed` the gathered packed bytes of each quantized segment."""
        h, place = self.group.size, self.group.rank
        k = self.world // h
        for i, seg in enumerate(self.layout.segments):
            if seg.padded_numel == 0:
                continue
            if i in self.quantized:
                row = packed[i].numel() // self.world
                self.packed[i] = packed[i][place * k * row : (place + 1) * k * row].clone()
                continue
            assert self.flat is not None
            length = seg.padded_numel // h
            start = seg.flat_start + place * length
            dest = self.flat[seg.flat_start // h : seg.flat_start // h + length]
            dest.copy_(full[start : start + length])
        self.valid = True

    def gather(self, i: int, out: torch.Tensor, block: int | None, tag: str) -> Any:
        """Starts segment `i`'s gather from the node group's copies into `out`."""
        seg, h = self.layout.segments[i], self.group.size
        if i in self.quantized:
            assert block is not None
            return gather_packed(out, self.packed[i], self.group.group, h, self.world, block, tag)
        assert self.flat is not None
        src = self.flat[seg.flat_start // h : seg.flat_end // h]
        return gather_segment(out, src, self.group.group, h, None, tag)

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds now (packed slices exist once a gather filled them)."""
        flat = 0 if self.flat is None else self.flat.numel() * self.flat.element_size()
        return flat + sum(p.numel() for p in self.packed.values())


__all__ = ["SecondaryCopy"]
