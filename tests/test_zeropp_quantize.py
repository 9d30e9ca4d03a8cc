"""Block-wise int8 quantization (`partita.precision.quantize`, [Note: block quantization]): each
block's round trip within its analytic bound, the packed wire format, and the errors."""

from __future__ import annotations

import pytest
import torch

from partita.precision.quantize import (
    INT4_MAX,
    INT8_MAX,
    check_block_size,
    dequantize_blocks,
    pack,
    packed_nbytes,
    quantize_blocks,
    unpack,
    unpack_rows,
)


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(4096, generator=g)
    spread = normal * torch.logspace(-6, 3, 4096)  # magnitudes over nine decades
    zeros_in = normal.clone()
    zeros_in[256:512] = 0.0  # a whole block of zeros
    return [normal, spread, zeros_in, torch.full((512,), -3.5)]


@pytest.mark.parametrize("block_size", [1, 16, 256, 512])
def test_each_block_round_trips_within_half_a_quantization_step(block_size: int) -> None:
    """|x - dequant(quant(x))| <= scale / 2 per element, scale = max|x| / 127 over its block
    (the fp32 product adds at most one rounding of the result, hence the relative 2^-23)."""
    for x in _samples():
        values, scales = quantize_blocks(x, block_size)
        assert values.dtype == torch.int8 and scales.dtype == torch.float32
        assert int(values.abs().max()) <= INT8_MAX
        blocks = x.reshape(-1, block_size)
        want_scale = blocks.abs().amax(dim=1) / INT8_MAX
        assert torch.equal(scales, want_scale)
        error = (dequantize_blocks(values, scales) - x).reshape(-1, block_size).abs()
        bound = scales.unsqueeze(1) / 2 + blocks.abs() * 2.0**-23
        assert bool((error <= bound).all()), float((error - bound).max())


def test_zero_blocks_and_exact_grid_values_are_exact() -> None:
    x = torch.zeros(64)
    x[32:] = torch.arange(-16, 16, dtype=torch.float32) * 0.5  # multiples of its step
    x[63] = INT8_MAX * 0.5  # the block's max: step exactly 0.5
    values, scales = quantize_blocks(x, 32)
    assert float(scales[0]) == 0.0
    assert torch.equal(dequantize_blocks(values, scales), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_come_back_in_their_own_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(1024, generator=torch.Generator().manual_seed(1)).to(dtype)
    values, scales = quantize_blocks(x, 128)
    back = dequantize_blocks(values, scales, dtype)
    assert back.dtype == dtype
    step = scales.repeat_interleave(128)
    # Half a step, then the cast to `dtype` rounds once more (relative eps of `dtype`).
    eps = torch.finfo(dtype).eps
    assert bool(((back.double() - x.double()).abs() <= step / 2 + x.double().abs() * eps).all())


@pytest.mark.parametrize("numel", [1, 255, 256, 1000])
def test_packed_buffer_carries_values_and_scales(numel: int) -> None:
    """One int8 per element and one fp32 scale per block; a last block shorter than 256 has
    its own scale, so it is quantized as a block of its own length would be."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    buf = pack(x, 256)
    assert buf.dtype == torch.uint8
    assert buf.numel() == packed_nbytes(numel, 256) == numel + 4 * -(-numel // 256)
    whole = numel - numel % 256
    parts = [x[:whole].reshape(-1, 256)] if whole else []
    parts += [x[whole:].reshape(1, -1)] if whole < numel else []
    want = torch.cat([dequantize_blocks(*quantize_blocks(p, p.shape[-1])) for p in parts])
    assert torch.equal(unpack(buf, numel, 256, torch.float32), want)
    two = unpack_rows(torch.cat([buf, pack(-x, 256)]), 2, numel, 256, torch.float32)
    assert torch.equal(two[0], want) and torch.equal(two[1], -want)


def test_a_block_size_that_does_not_divide_is_named() -> None:
    quantize_blocks(torch.zeros(1000), 100)  # divides: fine
    with pytest.raises(ValueError, match=r"block size 300 does not divide the tensor's 1000"):
        quantize_blocks(torch.zeros(1000), 300)
    with pytest.raises(ValueError, match=r"block size 0 must be a positive integer"):
        check_block_size(10, 0)
    with pytest.raises(ValueError, match="packed buffer"):
        unpack(torch.zeros(10, dtype=torch.uint8), 100, 64, torch.float32)


# ---- DeepSpeed's name: deepspeed.runtime.zero.partition_parameters.CUDAQuantizer ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_quantizer_adapter_round_trips_in_the_parameter_dtype(dtype: torch.dtype) -> None:
    """DeepSpeed's `CUDAQuantizer` over partita's quantizer: int8 values and one scale per
    group (the fewest equal groups of at most 8000 elements: 12000 -> 2 of 6000), within half
    a step, back in the dtype asked for (fp16 when none, as DeepSpeed's kernel returns)."""
    from partita.compat.deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    x = torch.randn(12000, generator=torch.Generator().manual_seed(3)).to(dtype)
    values, scales = CUDAQuantizer().quantize(x)
    assert values.dtype == torch.int8 and values.shape == (2, 6000) and scales.numel() == 2
    back = CUDAQuantizer().dequantize(values, scales, dtype=dtype)
    assert back.dtype == dtype and CUDAQuantizer().dequantize(values, scales).dtype == torch.half
    step = scales.reshape(-1).repeat_interleave(6000).double()
    eps = torch.finfo(dtype).eps
    error = (back.reshape(-1).double() - x.double()).abs()
    assert bool((error <= step / 2 + x.double().abs() * eps).all())
    with pytest.raises(ValueError, match="7 groups do not divide"):
        CUDAQuantizer().quantize(x, groups=7)


@pytest.mark.parametrize("block_size", [1, 16, 256, 512])
def test_each_int4_block_round_trips_within_half_a_quantization_step(block_size: int) -> None:
    """int4 ([Note: int4 blocks]): codes in [-7, 7], scale = max|x| / 7 over the block, and
    |x - dequant(quant(x))| <= scale / 2 per element (plus one fp32 rounding of the product),
    through the packed nibbles too."""
    for x in _samples():
        values, scales = quantize_blocks(x, block_size, bits=4)
        assert int(values.abs().max()) <= INT4_MAX
        blocks = x.reshape(-1, block_size)
        assert torch.equal(scales, blocks.abs().amax(dim=1) / INT4_MAX)
        bound = scales.unsqueeze(1) / 2 + blocks.abs() * 2.0**-23
        error = (dequantize_blocks(values, scales) - x).reshape(-1, block_size).abs()
        assert bool((error <= bound).all()), float((error - bound).max())
        packed = unpack(pack(x, block_size, bits=4), x.numel(), block_size, torch.float32, 4)
        assert torch.equal(packed, dequantize_blocks(values, scales))


@pytest.mark.parametrize("numel", [1, 7, 255, 256, 1000])
def test_int4_packs_two_codes_a_byte_plus_scales(numel: int) -> None:
    """ceil(n / 2) bytes of codes (an odd count ends in a padding nibble) and 4 per block;
    rows of any length unpack side by side."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    buf = pack(x, 256, bits=4)
    assert buf.numel() == packed_nbytes(numel, 256, bits=4) == -(-numel // 2) + 4 * -(-numel // 256)
    rows = torch.stack([x, -x])
    table = unpack_rows(torch.cat([buf, pack(-x, 256, bits=4)]), 2, numel, 256, torch.float32, 4)
    assert torch.equal(table[1], -table[0])
    assert float((table - rows).abs().max()) <= float(x.abs().max()) / INT4_MAX / 2 * (1 + 1e-6)


def test_unknown_bit_widths_are_refused() -> None:
    with pytest.raises(ValueError, match="3 bits is not supported; use 4 or 8"):
        pack(torch.ones(4), 4, bits=3)
