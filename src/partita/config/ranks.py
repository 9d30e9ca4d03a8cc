"""Comparing the configs of all ranks: every rank must train with the same config.

Ranks launched with different config files (a stale copy on one node, a rank-dependent
value in a script) would otherwise run different batch sizes or ZeRO settings until some
collective mismatches and hangs. ``initialize()`` gathers each rank's `flatten`ed config
right after the process group exists and raises `ranks_differ`'s problems on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import Problem, join_path

__all__ = ["flatten", "ranks_differ"]

_ABSENT = "<absent>"


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = join_path(prefix, key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def ranks_differ(per_rank: Sequence[Mapping[str, Any]]) -> list[Problem]:
    """One problem per dotted key whose value is not the same on every rank (rank order in,
    one flattened config per rank), e.g. ``train_micro_batch_size_per_gpu: config differs
    across ranks: rank 0=2, rank 1=4``."""
    keys = sorted({key for flat in per_rank for key in flat})
    problems = []
    for key in keys:
        values = [flat.get(key, _ABSENT) for flat in per_rank]
        if all(v == values[0] and type(v) is type(values[0]) for v in values):
            continue
        groups: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(value if value is _ABSENT else repr(value), []).append(rank)
        text = ", ".join(f"{_ranks(ranks)}={value}" for value, ranks in groups.items())
        problems.append(Problem(key, f"config differs across ranks: {text}"))
    return problems
