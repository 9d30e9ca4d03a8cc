"""Hybrid sharding (``zero_optimization.mics_shard_size``, FSDP2's HSDP, DeepSpeed's MiCS):
ZeRO stages 1-2 shard inside groups of 2 consecutive ranks and replicate across 2 such groups
(4 CPU ranks), with one-process parity, bitwise reruns, 1/shard optimizer state, the bytes
between replicas, and the refusals. One spawn runs every case ([Note: hybrid sharding] in
`partita.comm.dims`)."""

from __future__ import annotations

import pytest
import torch

from engine_workers import base_config
from hybrid_workers import hybrid_grid
from models import STEPS, assert_parity, pairs, reference_run, with_float64
from partita.testing import run_distributed

WORLD, SHARD = 4, 2
REPLICAS = WORLD // SHARD
KEY = "zero_optimization.mics_shard_size"
BUCKET = {"reduce_bucket_size": 3000}


def _zero(stage: int) -> dict:
    return {"stage": stage, "mics_shard_size": SHARD, **BUCKET}


def _train_cases() -> list[dict]:
    plain = [
        {"config": base_config(2, 1, zero_optimization=_zero(stage)), "steps": STEPS}
        for stage in (1, 2)
    ]
    clipped = {
        "config": base_config(2, 2, clip=0.05, zero_optimization=_zero(2)),
        "steps": STEPS,
    }
    return [*plain, clipped, plain[0]]  # the last: stage 1 again, bitwise


BAD = [
    {**_zero(1), "mics_shard_size": 3},  # does not divide 4
    {**_zero(2), "mics_shard_size": 8},  # exceeds the world
    {**_zero(1), "mics_shard_size": 0},
    _zero(3),  # stage 3: refused (not implemented)
]


@pytest.fixture(scope="module")
def results() -> dict:
    cases = [{"train": c} for c in with_float64(_train_cases())]
    cases += [{"probe": base_config(2, 1, zero_optimization=_zero(2))}]
    cases += [{"bad": zero} for zero in BAD]
    per_rank = run_distributed(hybrid_grid, WORLD, cases, timeout=240)
    runs = len(cases) - 1 - len(BAD)
    return {
        "train": [r[:runs] for r in per_rank],
        "probe": [r[runs] for r in per_rank],
        "bad": [r[runs + 1 :] for r in per_rank],
    }


@pytest.mark.parity
def test_losses_match_one_process_and_rerun_is_bitwise(results: dict) -> None:
    stage1, stage2, clipped, again = pairs(results["train"][0])
    batch = 2 * WORLD  # data is split over all 4 ranks, not over the shard group
    assert_parity(stage1, reference_run(STEPS, batch=batch))
    assert_parity(stage2, reference_run(STEPS, batch=batch))
    # Clipping reads the norm: over the shard group only (replicas would count it twice).
    assert_parity(clipped, reference_run(STEPS, batch=2 * batch, clip=0.05))
    for twin in (0, 1):
        assert again[twin]["losses"] == stage1[twin]["losses"]
        for a, b in zip(again[twin]["params"], stage1[twin]["params"], strict=True):
            assert torch.equal(a, b)


def test_groups_are_consecutive_shards_and_strided_replicas(results: dict) -> None:
    for rank, probe in enumerate(results["probe"]):
        first = rank - rank % SHARD
        assert probe["shard"] == list(range(first, first + SHARD))
        assert probe["replicate"] == list(range(rank % SHARD, WORLD, SHARD))
        assert probe["zero_world"] == SHARD and probe["dp_world"] == WORLD


def test_optimizer_state_is_one_shard_of_the_model(results: dict) -> None:
    for per_rank in results["train"]:
        run = per_rank[0]  # stage 1, fp32
        master = run["memory"]["master_params"]
        # fp32 master shard: the model's elements over 2 ranks, plus bucket padding
        assert run["numel"] * 4 / SHARD <= master < run["numel"] * 4 / SHARD + 64 * 4
        # AdamW: two moments of the shard (and a scalar step counter)
        assert 2 * master <= run["memory"]["optimizer_state"] <= 2 * master + 64


def test_bytes_between_replicas_are_one_gradient_shard_per_step(results: dict) -> None:
    """partita counts an all-reduce as the tensor it carries (`partita.comm.counters`): each
    step all-reduces every gradient shard (fp32, numel/shard) once across the replicas and
    nothing else; a ring moves 2 * (r - 1) / r times that per rank, here with r = 2 exactly
    the count. The shard group carries the reduce-scatter, the all-gather and the norm."""
    for per_rank in results["train"]:
        for run in per_rank[:2] + per_rank[4:6]:  # stages 1 and 2, fp32 and float64, gas 1
            shard_bytes = run["memory"]["master_params"]  # fp32 master = the gradient shard
            assert run["replicate_by_op"] == {"all_reduce/grad": STEPS * shard_bytes}
            assert run["group_bytes"]["dp_replicate"] == STEPS * shard_bytes
            assert run["group_bytes"]["dp_shard"] > 0
        clipped = per_rank[2]  # stage 2 reduces at every micro-batch: 2 per step
        shard_bytes = clipped["memory"]["master_params"]
        assert clipped["group_bytes"]["dp_replicate"] == 2 * STEPS * shard_bytes
    ring = 2 * (REPLICAS - 1) / REPLICAS
    assert ring == 1.0


def test_bad_shard_size_fails_on_every_rank_naming_the_key(results: dict) -> None:
    for rank, errors in enumerate(results["bad"]):
        assert len(errors) == len(BAD)
        for zero, message in zip(BAD, errors, strict=True):
            assert KEY in message, (rank, zero, message)
        assert (
            "data-parallel world size 4" in errors[0] and "data-parallel world size 4" in errors[1]
        )
        assert "MiCS" in errors[3] and "stage 3" in errors[3]
