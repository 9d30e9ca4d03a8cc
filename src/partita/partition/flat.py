"""Moving data between a group's tensors, its flat buffer and a rank's shard buffer.

Every function takes the :class:`FlatLayout` that describes the buffers; the flat buffer is a
1-D tensor of ``layout.padded_numel`` elements, a shard buffer a 1-D tensor of
``layout.shard_numel`` elements (any dtype, any device: the layout counts elements).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from partita.partition.layout import FlatLayout, Segment


class SegmentViews(NamedTuple):
    """The two sides of one segment's collective: ``full`` (the segment in the flat buffer,
    ``world_size * chunk`` elements) and ``shard`` (this rank's chunk in its shard buffer).
    Gradients: ``reduce_scatter(output=shard, input=full)``; parameters:
    ``all_gather(output=full, input=shard)``."""

    full: torch.Tensor
    shard: torch.Tensor


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, layout: FlatLayout) -> None:
    """Copies ``tensors`` into their places in ``flat`` and zeroes every gap, so the padding
    never carries stale values into a reduction or a norm."""
    _check_tensors(tensors, layout)
    _check_buffer(flat, layout.padded_numel, "flat buffer")
    with torch.no_grad():
        for t, off, n in zip(tensors, layout.offsets, layout.numels, strict=True):
            if n:
                flat[off : off + n].copy_(t.reshape(-1))
        for start, end in layout.gaps():
            flat[start:end].zero_()


def flatten(
    tensors: Sequence[torch.Tensor],
    layout: FlatLayout,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A new flat buffer holding ``tensors`` (dtype and device default to the first tensor's,
    else float32 on CPU)."""
    like = tensors[0] if tensors else None
    dtype = dtype or (like.dtype if like is not None else torch.float32)
    device = device or (like.device if like is not None else "cpu")
    flat = torch.empty(layout.padded_numel, dtype=dtype, device=device)
    flatten_into(tensors, flat, layout)
    return flat


def views(
    flat: torch.Tensor, layout: FlatLayout, shapes: Sequence[torch.Size | Sequence[int]]
) -> list[torch.Tensor]:
    """Views of each tensor inside ``flat`` with the given ``shapes``: make parameters or
    gradients alias one flat storage (writes through a view land in ``flat``)."""
    _check_buffer(flat, layout.padded_numel, "flat buffer")
    if len(shapes) != len(layout.numels):
        raise ValueError(f"got {len(shapes)} shapes for a layout of {len(layout.numels)} tensors")
    out = []
    for i, (shape, off, n) in enumerate(zip(shapes, layout.offsets, layout.numels, strict=True)):
        size = torch.Size(shape)
        if size.numel() != n:
            raise ValueError(
                f"shape {tuple(size)} of tensor {i} has {size.numel()} elements, layout says {n}"
            )
        out.append(flat[off : off + n].view(size))
    return out


def unflatten_into(flat: torch.Tensor, layout: FlatLayout, tensors: Sequence[torch.Tensor]) -> None:
    """Copies each tensor's range of ``flat`` back into ``tensors`` (when they do not alias it)."""
    _check_tensors(tensors, layout)
    _check_buffer(flat, layout.padded_numel, "flat buffer")
    with torch.no_grad():
        for t, off, n in zip(tensors, layout.offsets, layout.numels, strict=True):
            if n:
                t.copy_(flat[off : off + n].view_as(t))


def shard_view(flat: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    """``rank``'s shard as a view of ``flat`` (single-segment layouts only; with buckets the
    shard is one chunk per segment: :func:`segment_views`)."""
    _check_buffer(flat, layout.padded_numel, "flat buffer")
    start, end = layout.shard_range(rank)
    return flat[start:end]


def segment_views(
    flat: torch.Tensor, shard: torch.Tensor, layout: FlatLayout, segment: int | Segment, rank: int
) -> SegmentViews:
    """The in-place input and output of one segment's collective on ``rank``."""
    _check_buffer(flat, layout.padded_numel, "flat buffer")
    _check_buffer(shard, layout.shard_numel, "shard buffer")
    layout.check_rank(rank)
    seg = layout.segments[segment] if isinstance(segment, int) else segment
    chunk = shard[seg.shard_offset : seg.shard_offset + seg.chunk_numel]
    return SegmentViews(flat[seg.flat_start : seg.flat_end], chunk)


def pack_shard(
    tensors: Sequence[torch.Tensor], shard: torch.Tensor, layout: FlatLayout, rank: int
) -> None:
    """Copies the parts of full ``tensors`` that ``rank`` owns into its ``shard`` buffer and
    zeroes the rest (e.g. an fp32 master shard from replicated parameters)."""
    _check_tensors(tensors, layout)
    _check_buffer(shard, layout.shard_numel, "shard buffer")
    with torch.no_grad():
        shard.zero_()
        for p in layout.shard_pieces(rank):
            src = tensors[p.index].reshape(-1)[p.param_offset : p.param_offset + p.length]
            shard[p.shard_offset : p.shard_offset + p.length].copy_(src)


def unpack_shard(
    shard: torch.Tensor, layout: FlatLayout, rank: int, tensors: Sequence[torch.Tensor]
) -> None:
    """Copies ``rank``'s ``shard`` into the parts of full ``tensors`` it owns (contiguous
    tensors: the writes must reach their storage)."""
    _check_tensors(tensors, layout)
    _check_buffer(shard, layout.shard_numel, "shard buffer")
    with torch.no_grad():
        for p in layout.shard_pieces(rank):
            dst = tensors[p.index].view(-1)[p.param_offset : p.param_offset + p.length]
            dst.copy_(shard[p.shard_offset : p.shard_offset + p.length])


def _check_tensors(tensors: Sequence[torch.Tensor], layout: FlatLayout) -> None:
    if len(tensors) != len(layout.numels):
        raise ValueError(f"got {len(tensors)} tensors for a layout of {len(layout.numels)}")
    for i, (t, n) in enumerate(zip(tensors, layout.numels, strict=True)):
        if t.numel() != n:
            raise ValueError(f"tensor {i} has {t.numel()} elements, layout says {n}")


def _check_buffer(buf: torch.Tensor, numel: int, what: str) -> None:
    if buf.dim() != 1 or buf.numel() != numel or not buf.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous 1-D tensor of {numel} elements, "
            f"got shape {tuple(buf.shape)}, stride {buf.stride()}"
        )
