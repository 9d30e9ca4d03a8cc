"""Human-readable numbers for the profiler tables (``1.23 G``, ``4.5 ms``, ``12.3 MB``)."""

from __future__ import annotations

__all__ = ["bytes_to_string", "duration_to_string", "number_to_string"]

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(value: float, unit: str = "", precision: int = 2) -> str:
    """`value` with a metric prefix: ``number_to_string(2.5e9, "FLOPS") == "2.5 GFLOPS"``."""
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{round(value / scale, precision):g} {prefix}{unit}"
    return f"{round(value, precision):g} {unit}".rstrip()


def duration_to_string(seconds: float, precision: int = 2) -> str:
    """Seconds as s, ms or us, whichever reads best."""
    if seconds >= 1:
        return f"{round(seconds, precision):g} s"
    if seconds >= 1e-3:
        return f"{round(seconds * 1e3, precision):g} ms"
    return f"{round(seconds * 1e6, precision):g} us"


def bytes_to_string(nbytes: float, precision: int = 2) -> str:
    """Bytes in binary units (B, KB, MB, GB, TB: powers of 1024, as DeepSpeed's comms table)."""
    units = ("B", "KB", "MB", "GB", "TB")
    value = float(nbytes)
    for unit in units:
        if abs(value) < 1024 or unit == units[-1]:
            return f"{round(value, precision):g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
