"""Reading and writing sizes: ``"24GB"``, ``"80 GiB"``, ``"1.5e9"`` bytes and ``"70B"``, ``"13e9"``
parameter counts. Bad input raises `EstimateError` naming the value, in one line."""

from __future__ import annotations

import math
import re

__all__ = ["EstimateError", "format_bytes", "parse_bytes", "parse_count"]


class EstimateError(ValueError):
    """Bad input to the estimator or planner; the message is one line naming the value."""


# Decimal units as device vendors quote them (80 GB = 80e9 bytes); binary ones as "GiB".
_BYTE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_COUNT_UNITS: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _split(text: str, what: str) -> tuple[float, str]:
    match = _NUMBER.match(text)
    if match is None:
        sign = " (sizes cannot be negative)" if text.strip().startswith("-") else ""
        raise EstimateError(f"{what} {text!r} is not a number with an optional unit{sign}")
    return float(match.group(1)), match.group(2)


def parse_bytes(value: str | float | int, what: str = "memory size") -> int:
    """Bytes from a number or a string with a decimal (KB, MB, GB, TB) or binary (KiB ... TiB)
    unit; a bare number is bytes. Raises `EstimateError` for negative, non-finite or unknown
    units, naming `what` and the value."""
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        number, unit = _split(value, what)
    if unit.lower() not in _BYTE_UNITS:
        raise EstimateError(f"{what} {value!r}: unknown unit {unit!r} (use GB, GiB, TB, ...)")
    unit = unit.lower()
    if not math.isfinite(number) or number < 0:
        raise EstimateError(f"{what} {value!r} must be a finite size >= 0")
    return int(number * _BYTE_UNITS[unit])


def parse_count(value: str | float | int, what: str = "parameter count") -> int:
    """A count from a number or a string such as ``"70B"``, ``"350M"``, ``"13e9"``; must be > 0."""
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        number, unit = _split(value, what)
    if unit.lower() not in _COUNT_UNITS:
        raise EstimateError(f"{what} {value!r}: unknown unit {unit!r} (use K, M, B or T)")
    unit = unit.lower()
    if not math.isfinite(number) or number <= 0:
        raise EstimateError(f"{what} {value!r} must be a finite number > 0")
    return int(number * _COUNT_UNITS[unit])


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units, three significant figures (``"1.12 TB"``)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"
