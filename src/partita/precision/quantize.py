"""Block-wise symmetric int8 and int4 quantization (pure tensor math; ZeRO++'s qwZ moves weights
as int8, its qgZ gradients as int4 or int8).

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

[Note: int4 blocks]
With ``bits=4`` the same scheme keeps 4-bit codes: scale ``max|x| / 7``, codes
``round(x / scale)`` in [-7, 7] (-8 unused, symmetric as above). The analytic bound is the same
form: each element is off by at most ``scale / 2 = max|x| / 14`` over its block, because
rounding to the nearest integer moves ``x / scale`` by at most 1/2 and the clamp never bites
(``|x| / scale <= 7``); the fp32 product adds one rounding of the result. On the wire two codes
share a byte, each stored as ``code + 8`` (1..15) in a nibble, the earlier element in the low
nibble; an odd count ends with a nibble of 8 (code 0) that unpacking drops. So ``n`` elements
take ``ceil(n / 2) + 4 * ceil(n / B)`` bytes (`packed_nbytes` with ``bits=4``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT8_MAX = 127
"""Largest magnitude of an int8 quantized value (symmetric range)."""
INT4_MAX = 7
"""Largest magnitude of an int4 quantized value (symmetric range: [Note: int4 blocks])."""
BITS = (4, 8)
"""The code widths `pack` knows."""
_NIBBLE_OFFSET = 8
"""Added to an int4 code on the wire so that a nibble holds it unsigned ([Note: int4 blocks])."""
SCALE_BYTES = 4
"""Bytes of one block's scale (fp32)."""


class Quantized(NamedTuple):
    """A quantized tensor: int8-held codes (whole blocks) and one fp32 scale per block."""

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


def check_bits(bits: int) -> int:
    """`bits` unless it is not a width `pack` knows (4 or 8); then ValueError naming it."""
    if bits not in BITS:
        raise ValueError(f"quantization to {bits!r} bits is not supported; use 4 or 8")
    return bits


def code_max(bits: int) -> int:
    """Largest magnitude of a `bits`-bit symmetric code: 127 for int8, 7 for int4."""
    return INT8_MAX if check_bits(bits) == 8 else INT4_MAX


def quantize_blocks(x: torch.Tensor, block_size: int, bits: int = 8) -> Quantized:
    """`x` (any float dtype, any shape, read flat) as `bits`-bit codes (held as int8) in blocks
    of `block_size` elements with their scales ([Note: block quantization], [Note: int4
    blocks]). `block_size` must divide ``x.numel()``."""
    check_block_size(x.numel(), block_size)
    qmax = code_max(bits)
    blocks = x.detach().reshape(-1, block_size).to(torch.float32)
    scales = blocks.abs().amax(dim=1) / qmax
    # A zero block divides by one instead of zero: its values round to 0 either way.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / divisor.unsqueeze(1)).clamp_(-qmax, qmax)
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


def value_nbytes(numel: int, bits: int = 8) -> int:
    """Bytes of `numel` `bits`-bit codes on the wire (int4: two a byte, rounded up)."""
    return numel if check_bits(bits) == 8 else -(-numel // 2)


def packed_nbytes(numel: int, block_size: int, bits: int = 8) -> int:
    """Bytes of `pack`'s buffer for `numel` elements: their codes (a byte each for int8, half a
    byte for int4) plus one fp32 scale per block."""
    return value_nbytes(numel, bits) + SCALE_BYTES * blocks_for(numel, block_size)


def _split(numel: int, block_size: int) -> tuple[int, int]:
    """Elements in whole blocks, and in the shorter last block (0 when none)."""
    whole = numel - numel % block_size
    return whole, numel - whole


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (held as int8) two a byte, the earlier in the low nibble ([Note: int4
    blocks])."""
    unsigned = (codes.to(torch.int16) + _NIBBLE_OFFSET).to(torch.uint8)
    if unsigned.numel() % 2:
        unsigned = torch.cat([unsigned, unsigned.new_full((1,), _NIBBLE_OFFSET)])
    pairs = unsigned.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _codes(table: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """The (rows, numel) codes, as fp32, of the value bytes `table` (rows, value_nbytes)."""
    if bits == 8:
        return table.contiguous().view(torch.int8).to(torch.float32)
    low, high = table & 0x0F, table >> 4
    codes = torch.stack([low, high], dim=2).reshape(table.shape[0], -1)[:, :numel]
    return codes.to(torch.float32) - _NIBBLE_OFFSET


def pack(x: torch.Tensor, block_size: int, bits: int = 8) -> torch.Tensor:
    """`x` (read flat) quantized into one uint8 buffer: its `bits`-bit codes, then the fp32
    scales' bytes, blocks of `block_size` elements with a shorter last block when it does not
    divide ([Note: block quantization], [Note: int4 blocks])."""
    flat = x.detach().reshape(-1)
    whole, tail = _split(flat.numel(), block_size)
    parts = [quantize_blocks(flat[:whole], block_size, bits)] if whole else []
    if tail:
        parts.append(quantize_blocks(flat[whole:], tail, bits))
    codes = torch.cat([q.values for q in parts])
    values = codes.view(torch.uint8) if bits == 8 else _nibbles(codes)
    scales = torch.cat([q.scales for q in parts]).view(torch.uint8)
    return torch.cat([values, scales])


def unpack(
    buffer: torch.Tensor, numel: int, block_size: int, dtype: torch.dtype, bits: int = 8
) -> torch.Tensor:
    """The `numel` values of a `pack` buffer, dequantized into `dtype`."""
    return unpack_rows(buffer, 1, numel, block_size, dtype, bits).reshape(-1)


def unpack_rows(
    buffer: torch.Tensor,
    rows: int,
    numel: int,
    block_size: int,
    dtype: torch.dtype,
    bits: int = 8,
) -> torch.Tensor:
    """`rows` `pack` buffers of `numel` elements each, laid end to end in `buffer` (what an
    all-gather of packed chunks leaves), dequantized into a (rows, numel) tensor of `dtype`."""
    size, codes_end = packed_nbytes(numel, block_size, bits), value_nbytes(numel, bits)
    if buffer.numel() != rows * size:
        raise ValueError(
            f"{rows} packed buffer(s) of {numel} elements in blocks of {block_size} at {bits} "
            f"bits have {rows * size} bytes, got {buffer.numel()}"
        )
    whole, tail = _split(numel, block_size)
    table = buffer.reshape(rows, size)
    values = _codes(table[:, :codes_end], numel, bits)
    # A fresh contiguous copy: a slice of a byte buffer is not aligned for fp32.
    scale_bytes = torch.empty(rows, size - codes_end, dtype=torch.uint8, device=buffer.device)
    scales = scale_bytes.copy_(table[:, codes_end:]).view(torch.float32)
    out = torch.empty(rows, numel, dtype=torch.float32, device=buffer.device)
    n_whole = whole // block_size
    if whole:
        main = values[:, :whole].reshape(rows, n_whole, block_size)
        out[:, :whole] = (main * scales[:, :n_whole].unsqueeze(2)).reshape(rows, whole)
    if tail:
        out[:, whole:] = values[:, whole:] * scales[:, n_whole:]
    return out.to(dtype)


__all__ = [
    "BITS",
    "INT4_MAX",
    "INT8_MAX",
    "SCALE_BYTES",
    "Quantized",
    "blocks_for",
    "check_bits",
    "check_block_size",
    "code_max",
    "dequantize_blocks",
    "pack",
    "packed_nbytes",
    "quantize_blocks",
    "unpack",
    "unpack_rows",
    "value_nbytes",
]
