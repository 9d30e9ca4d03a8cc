"""Block-wise symmetric int8 quantization (pure tensor math; ZeRO++'s qwZ moves weights so).

[Note: block quantization]
A 1-D tensor is cut into blocks of ``block_size`` consecutive elements; each block keeps one
fp32 scale, ``max|x| / 127`` over the block, and each element ``round(x / scale)`` as an int8
in [-127, 127] (symmetric: -128 is never used, so negation is exact). Dequantizing multiplies
back, so every element is off by at most half a quantization step, ``scale / 2`` (plus the
rounding of the fp32 product and of the final cast to the caller's dtype). A block of zeros
has scale 0 and dequantizes to zeros exactly. The arithmetic runs in fp32 whatever the input
dtype, so quantizing the same values gives the same bytes on every rank and device.

On the wire a chunk travels as one uint8 buffer (`pack`): its int8 values, then its fp32 scales
as bytes, so one all-gather carries both and the payload of ``n`` elements is
``n + 4 * ceil(n / B)`` bytes (`packed_nbytes`). A chunk that ``B`` does not divide ends in one
shorter block with its own scale (the same bound holds for it), so no bytes go to padding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT8_MAX = 127
"""Largest magnitude of a quantized value (symmetric range)."""
SCALE_BYTES = 4
"""Bytes of one block's scale (fp32)."""


class Quantized(NamedTuple):
    """A quantized tensor: int8 values (whole blocks) and one fp32 scale per block."""

    values: torch.Tensor
    scales: torch.Tensor


def check_block_size(numel: int, block_size: int, what: str = "tensor") -> None:
    """Raises ValueError naming `block_size` unless it is positive and divides `numel`."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block size {block_size!r} must be a positive integer")
    if numel % block_size:
        raise ValueError(
            f"block size {block_size} does not divide the {what}'s {numel} elements "
            f"({numel % block_size} left over); pad to a multiple of {block_size} or pick a "
            "divisor"
        )


def quantize_blocks(x: torch.Tensor, block_size: int) -> Quantized:
    """`x` (any float dtype, any shape, read flat) as int8 blocks of `block_size` elements with
    their scales ([Note: block quantization]). `block_size` must divide ``x.numel()``."""
    check_block_size(x.numel(), block_size)
    blocks = x.detach().reshape(-1, block_size).to(torch.float32)
    scales = blocks.abs().amax(dim=1) / INT8_MAX
    # A zero block divides by one instead of zero: its values round to 0 either way.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / divisor.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX)
    return Quantized(values.to(torch.int8).reshape(-1), scales)


def dequantize_blocks(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values `quantize_blocks` encoded, flat, in `dtype` (the block size is
    ``values.numel() // scales.numel()``, which must be whole)."""
    if scales.numel() == 0 or values.numel() % scales.numel():
        raise ValueError(
            f"{values.numel()} quantized values do not split into {scales.numel()} blocks"
        )
    blocks = values.reshape(scales.numel(), -1).to(torch.float32) * scales.unsqueeze(1)
    return blocks.reshape(-1).to(dtype)


def blocks_for(numel: int, block_size: int) -> int:
    """Blocks that hold `numel` elements (the last one may be shorter)."""
    return -(-numel // block_size)


def packed_nbytes(numel: int, block_size: int) -> int:
    """Bytes of `pack`'s buffer for `numel` elements: one int8 per element plus one fp32 scale
    per block."""
    return numel + SCALE_BYTES * blocks_for(numel, block_size)


def _split(numel: int, block_size: int) -> tuple[int, int]:
    """Elements in whole blocks, and in the shorter last block (0 when none)."""
    whole = numel - numel % block_size
    return whole, numel - whole


def pack(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """`x` (read flat) quantized into one uint8 buffer: its int8 values, then the fp32 scales'
    bytes, blocks of `block_size` elements with a shorter last block when it does not divide
    ([Note: block quantization])."""
    flat = x.detach().reshape(-1)
    whole, tail = _split(flat.numel(), block_size)
    parts = [quantize_blocks(flat[:whole], block_size)] if whole else []
    if tail:
        parts.append(quantize_blocks(flat[whole:], tail))
    values = torch.cat([q.values for q in parts]).view(torch.uint8)
    scales = torch.cat([q.scales for q in parts]).view(torch.uint8)
    return torch.cat([values, scales])


def unpack(buffer: torch.Tensor, numel: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The `numel` values of a `pack` buffer, dequantized into `dtype`."""
    return unpack_rows(buffer, 1, numel, block_size, dtype).reshape(-1)


def unpack_rows(
    buffer: torch.Tensor, rows: int, numel: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """`rows` `pack` buffers of `numel` elements each, laid end to end in `buffer` (what an
    all-gather of packed chunks leaves), dequantized into a (rows, numel) tensor of `dtype`."""
    size = packed_nbytes(numel, block_size)
    if buffer.numel() != rows * size:
        raise ValueError(
            f"{rows} packed buffer(s) of {numel} elements in blocks of {block_size} have "
            f"{rows * size} bytes, got {buffer.numel()}"
        )
    whole, tail = _split(numel, block_size)
    table = buffer.reshape(rows, size)
    values = table[:, :numel].contiguous().view(torch.int8).to(torch.float32)
    # A fresh contiguous copy: a slice of a byte buffer is not aligned for fp32.
    scale_bytes = torch.empty(rows, size - numel, dtype=torch.uint8, device=buffer.device)
    scales = scale_bytes.copy_(table[:, numel:]).view(torch.float32)
    out = torch.empty(rows, numel, dtype=torch.float32, device=buffer.device)
    n_whole = whole // block_size
    if whole:
        main = values[:, :whole].reshape(rows, n_whole, block_size)
        out[:, :whole] = (main * scales[:, :n_whole].unsqueeze(2)).reshape(rows, whole)
    if tail:
        out[:, whole:] = values[:, whole:] * scales[:, n_whole:]
    return out.to(dtype)


__all__ = [
    "INT8_MAX",
    "SCALE_BYTES",
    "Quantized",
    "blocks_for",
    "check_block_size",
    "dequantize_blocks",
    "pack",
    "packed_nbytes",
    "quantize_blocks",
    "unpack",
    "unpack_rows",
]
