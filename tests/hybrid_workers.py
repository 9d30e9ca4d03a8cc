"""Rank-side code of tests/test_hybrid_shard.py: hybrid sharding (``mics_shard_size``) runs
with the per-group byte counts and shard sizes the test checks."""

from __future__ import annotations

from typing import Any

import partita
from engine_workers import base_config, init_probe, train
from models import make_model
from partita import comm
from partita.config import ConfigError


def hybrid_train(case: dict[str, Any]) -> dict[str, Any]:
    """`train(**case)` plus the bytes each named group carried during it and this rank's
    groups (read from a probe engine built with the same config)."""
    before = {g: comm.COUNTERS.bytes(group=g) for g in ("dp_shard", "dp_replicate")}
    by_op = dict(comm.COUNTERS.total_group_bytes)
    by_link = dict(comm.COUNTERS.total_link_bytes)
    result = train(**case)
    result["inter_by_op"] = {
        f"{op}/{tag}": v - by_link.get((k, op, tag), 0)
        for (k, op, tag), v in comm.COUNTERS.total_link_bytes.items()
        if k == "inter" and v - by_link.get((k, op, tag), 0)
    }
    result["group_bytes"] = {g: comm.COUNTERS.bytes(group=g) - b for g, b in before.items()}
    result["replicate_by_op"] = {
        f"{op}/{tag}": v - by_op.get((g, op, tag), 0)
        for (g, op, tag), v in comm.COUNTERS.total_group_bytes.items()
        if g == "dp_replicate" and v - by_op.get((g, op, tag), 0)
    }
    return result


def layout_probe(config: dict[str, Any]) -> dict[str, Any]:
    """This rank's shard and replicate ranks, and its ZeRO world, under `config`."""
    engine, _, _, _ = partita.initialize(model=make_model(), config=config)
    dims = engine.dims
    out = {
        "shard": list(dims.shard_ranks),
        "replicate": list(dims.replicate_ranks),
        "zero_world": comm.get_world_size(engine.strategy.process_group),
        "dp_world": engine.dp_world_size,
    }
    engine.destroy()
    return out


def bad_config(zero: dict[str, Any]) -> str:
    """The error `initialize` raises on this rank for `zero` ("" when none)."""
    try:
        partita.initialize(model=make_model(), config=base_config(2, 1, zero_optimization=zero))
    except (ConfigError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def hybrid_grid(cases: list[dict[str, Any]]) -> list[Any]:
    """Runs every case in one set of processes: ``{"train": ...}`` through `hybrid_train`,
    ``{"probe": config}`` through `layout_probe`, ``{"bad": zero}`` through `bad_config`,
    ``{"init": kwargs}`` through `init_probe` (the model built under ``zero.Init``)."""
    out: list[Any] = []
    for case in cases:
        if "init" in case:
            out.append(init_probe(**case["init"]))
        elif "probe" in case:
            out.append(layout_probe(case["probe"]))
        elif "bad" in case:
            out.append(bad_config(case["bad"]))
        else:
            out.append(hybrid_train(case["train"]))
    return out
