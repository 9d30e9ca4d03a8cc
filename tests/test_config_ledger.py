"""Every schema field is accounted for (honoured, refused or accepted-inert), and the schema's
defaults are the defaults the engine runs with."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import partita
from partita.config import ConfigError, DeepSpeedConfig, ZeroConfig, load_config
from partita.config.ledger import LEDGER, Status, schema_paths
from partita.engine import setup as engine_setup
from partita.testing import run_distributed

SRC = Path(partita.__file__).parent
BASE: dict[str, Any] = {"train_batch_size": 2, "zero_optimization": {"stage": 1}}


def test_every_schema_field_has_a_ledger_entry() -> None:
    paths = schema_paths(DeepSpeedConfig)
    missing = sorted(set(paths) - set(LEDGER))
    stale = sorted(set(LEDGER) - set(paths))
    assert not missing, f"schema fields without a ledger entry: {missing}"
    assert not stale, f"ledger entries for no schema field: {stale}"


def test_schema_paths_walks_nested_sections() -> None:
    paths = schema_paths(DeepSpeedConfig)
    assert "zero_optimization.offload_param.max_in_cpu" in paths
    assert "checkpoint.parallel_write.pipeline_stage" in paths
    assert "optimizer.params" in paths and "zero_optimization" not in paths


HONOURED = sorted(p for p, e in LEDGER.items() if e.status is Status.HONOURED)
REFUSED = sorted(p for p, e in LEDGER.items() if e.status is Status.REFUSED)
INERT = sorted(p for p, e in LEDGER.items() if e.status is Status.INERT)


@pytest.mark.parametrize("path", HONOURED)
def test_honoured_field_is_read_where_the_ledger_says(path: str) -> None:
    entry = LEDGER[path]
    name = path.rsplit(".", 1)[-1]
    files = [SRC / where for where in entry.note.split()]
    assert files and all(f.is_file() and "config" not in f.parts for f in files), entry.note
    for file in files:
        assert re.search(rf"\.{name}\b", file.read_text()), f"{path}: not read in {file}"


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    *parents, key = path.split(".")
    holder = out
    for part in parents:
        holder = holder.setdefault(part, {})
    holder[key] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _rejection(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """Problems from everything initialize() checks before the process group exists."""
    try:
        engine_setup.check_supported(load_config(raw, world_size=1))
    except ConfigError as error:
        return [(p.path, p.message) for p in error.problems]
    return []


@pytest.mark.parametrize("path", REFUSED)
def test_refused_field_rejects_a_non_default_value_naming_the_key(path: str) -> None:
    entry = LEDGER[path]
    base = _merge(BASE, entry.context)
    assert path not in {p for p, _ in _rejection(base)}
    problems = _rejection(_set(base, path, entry.example))
    assert any(p == path and ("not supported" in m or "partita" in m) for p, m in problems), (
        problems
    )


@pytest.mark.parametrize("path", INERT)
def test_inert_field_says_why(path: str) -> None:
    assert len(LEDGER[path].note) > 20


def test_inert_fields_accept_any_valid_value() -> None:
    raw = _set(BASE, "zero_optimization.allgather_bucket_size", 1234)
    raw = _set(raw, "zero_optimization.overlap_comm", False)
    raw = _set(raw, "aio.single_submit", True)
    assert _rejection(raw) == []


# --- defaults in force -----------------------------------------------------------------------


def test_reduce_bucket_size_default_is_the_bucket_in_force() -> None:
    default = ZeroConfig().reduce_bucket_size
    assert engine_setup.bucket_numel(ZeroConfig()) == default
    assert engine_setup.bucket_numel(ZeroConfig(reduce_bucket_size=5e8)) == 500_000_000


def _engine(zero: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage3_param_persistence_threshold": 0, **zero},
    }
    engine, *_ = partita.initialize(model=model, config=config, dist_init_required=False)
    return engine


def test_stage0_buckets_use_the_schema_default() -> None:
    engine = _engine({"stage": 0})
    assert engine.strategy.bucket_numel == ZeroConfig().reduce_bucket_size


def _peak_in_flight(zero: dict[str, Any]) -> tuple[Any, list[int]]:
    engine = _engine({"stage": 3, **zero})
    engine.backward(engine(torch.randn(2, 64)).sum())
    engine.step()
    segments = [s.padded_numel for u in engine.strategy.all_units for s in u.layout.segments]
    return engine.strategy.reducer, segments


def test_stage3_honours_reduce_bucket_size() -> None:
    default, segments = _peak_in_flight({})
    assert default.max_in_flight_numel == ZeroConfig().reduce_bucket_size
    # Three 64-wide layers: every reduction of the backward fits the default bound at once.
    assert default.peak_in_flight_numel == sum(segments) > 5000
    bounded, segments = _peak_in_flight({"reduce_bucket_size": 5000})
    assert bounded.max_in_flight_numel == 5000
    # One 64x64 layer (4160 elements) fits in 5000, two do not: at most one at a time.
    assert 0 < bounded.peak_in_flight_numel <= max(5000, *segments)


def _stage3_losses(buckets: list[int | None]) -> list[list[float]]:
    """Per-step losses of the same stage-3 run, once per reduce_bucket_size (None: default)."""
    out = []
    for bucket in buckets:
        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
        if bucket is not None:
            zero["reduce_bucket_size"] = bucket
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero,
        }
        engine, *_ = partita.initialize(model=model, config=config)
        generator = torch.Generator().manual_seed(torch.distributed.get_rank())
        losses = []
        for _ in range(3):
            loss = engine(torch.randn(2, 32, generator=generator)).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out.append(losses)
    return out


def test_stage3_bucket_bound_changes_no_value_on_two_ranks() -> None:
    """One reduction in flight at a time (a bucket smaller than any segment) pairs the ranks'
    collectives as the default does and trains bit for bit the same."""
    for default, one_at_a_time in run_distributed(_stage3_losses, 2, [None, 64], timeout=240):
        assert default == one_at_a_time


def test_dataloader_drop_last_reaches_the_loader() -> None:
    data = [torch.zeros(2) for _ in range(5)]
    for drop in (False, True):
        config = {"train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": drop}
        model = torch.nn.Linear(2, 2)
        _, _, loader, _ = partita.initialize(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            config=config,
            training_data=data,
            dist_init_required=False,
        )
        assert loader is not None
        assert len(list(loader)) == (2 if drop else 3)
