"""Peak dense FLOP rates by device name, for model-FLOPs utilisation (MFU).

The numbers are the vendors' published dense (no sparsity) tensor-core rates; ``float32`` is the
non-tensor-core rate, which is what a float32 matmul gets with torch's default
``allow_tf32=False``. A device not listed (and every CPU) has no known peak: MFU is then reported
as unknown unless the caller gives a peak.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_TFLOPS", "device_name", "peak_flops"]

# (substring of torch.cuda.get_device_name(), {dtype: dense TFLOP/s}); the first match wins, so
# the more specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[torch.dtype, float]]] = [
    ("H200", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9}),
    ("H100 PCIe", {torch.bfloat16: 756.0, torch.float16: 756.0, torch.float32: 51.2}),
    ("H100", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9}),
    ("A100", {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5}),
    ("L40S", {torch.bfloat16: 362.1, torch.float16: 362.1, torch.float32: 91.6}),
    ("L4", {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3}),
    ("A10", {torch.bfloat16: 125.0, torch.float16: 125.0, torch.float32: 31.2}),
    ("V100", {torch.float16: 125.0, torch.float32: 15.7}),
]
"""Published dense peak TFLOP/s per device family and dtype."""


def peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s of device `name` for `dtype` matmuls, or None when unknown."""
    for family, rates in PEAK_TFLOPS:
        if family in name:
            rate = rates.get(dtype)
            return None if rate is None else rate * 1e12
    return None


def device_name(device: torch.device) -> str:
    """A device's marketing name (``NVIDIA H100 80GB HBM3``); ``cpu`` for the host."""
    if device.type == "cuda":
        # Asked of torch directly: the profiler is a side package that reads, never sets, the
        # device, and partita.platform.accelerator has no name query.
        return torch.cuda.get_device_name(device)
    return device.type
