"""Hybrid sharding (``zero_optimization.mics_shard_size``, FSDP2's HSDP, DeepSpeed's MiCS):
ZeRO stages 1-3 shard inside groups of 2 consecutive ranks and replicate across 2 such groups
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


STAGES = (1, 2, 3)


def _train_cases() -> list[dict]:
    plain = [
        {"config": base_config(2, 1, zero_optimization=_zero(stage)), "steps": STEPS}
        for stage in STAGES
    ]
    clipped = [
        {"config": base_config(2, 2, clip=0.05, zero_optimization=_zero(stage)), "steps": STEPS}
        for stage in (2, 3)
    ]
    return [*plain, *clipped, plain[0], plain[2]]  # the last two: stages 1 and 3 again, bitwise


BAD = [
    {**_zero(1), "mics_shard_size": 3},  # does not divide 4
    {**_zero(2), "mics_shard_size": 8},  # exceeds the world
    {**_zero(1), "mics_shard_size": 0},
    _zero(0),  # stage 0 has no shards to cut
]


def _shard_bytes(run: dict, stage: int) -> int:
    """Bytes of this rank's fp32 gradient shard, the size of its master shard: stage 3's fp32
    masters are the parameter shards themselves (no copy counted in ``master_params``), and
    its ``grads`` entry counts the masters' gradient shards."""
    return run["memory"]["grads" if stage == 3 else "master_params"]


TINY = {"kind": "tiny", "dim": 64, "layers": 4}
"""The model `init_probe` builds under ``zero.Init`` (and its eagerly built twin)."""


@pytest.fixture(scope="module")
def results() -> dict:
    cases = [{"train": c} for c in with_float64(_train_cases())]
    runs = len(cases)
    stage3 = base_config(2, 1, zero_optimization=_zero(3))
    cases += [
        {"probe": base_config(2, 1, zero_optimization=_zero(2))},
        {"init": {"config": stage3, "kind": "tiny", "steps": STEPS}},
        {"train": {"config": stage3, "steps": STEPS, "model_kwargs": TINY}},
    ]
    cases += [{"bad": zero} for zero in BAD]
    # 2 "nodes" of 2 ranks ([Note: links] in partita.comm.counters): the shard groups lie
    # inside one, the replicate groups cross.
    env = {"LOCAL_WORLD_SIZE": str(SHARD)}
    per_rank = run_distributed(hybrid_grid, WORLD, cases, timeout=240, env=env)
    return {
        "train": [r[:runs] for r in per_rank],
        "probe": [r[runs] for r in per_rank],
        "init": [r[runs + 1 : runs + 3] for r in per_rank],
        "bad": [r[runs + 3 :] for r in per_rank],
    }


@pytest.mark.parity
def test_losses_match_one_process_and_rerun_is_bitwise(results: dict) -> None:
    stage1, stage2, stage3, clipped2, clipped3, again1, again3 = pairs(results["train"][0])
    batch = 2 * WORLD  # data is split over all 4 ranks, not over the shard group
    for run in (stage1, stage2, stage3):
        assert_parity(run, reference_run(STEPS, batch=batch))
    # Clipping reads the norm: over the shard group only (replicas would count it twice).
    for run in (clipped2, clipped3):
        assert_parity(run, reference_run(STEPS, batch=2 * batch, clip=0.05))
    for first, again in ((stage1, again1), (stage3, again3)):
        for twin in (0, 1):
            assert again[twin]["losses"] == first[twin]["losses"]
            for a, b in zip(again[twin]["params"], first[twin]["params"], strict=True):
                assert torch.equal(a, b)


def test_zero_init_model_trains_as_the_eagerly_built_one(results: dict) -> None:
    """A model built under ``zero.Init`` (as the Trainer builds one at stage 3) is re-cut over
    the shard group when the engine takes it, and trains bitwise as its eager twin."""
    for built_in_init, eager in results["init"]:
        assert built_in_init["same_as_eager"]
        assert built_in_init["losses"] == eager["losses"]
        assert built_in_init["seen"] and built_in_init["master"]  # GatheredParameters writes


def test_groups_are_consecutive_shards_and_strided_replicas(results: dict) -> None:
    for rank, probe in enumerate(results["probe"]):
        first = rank - rank % SHARD
        assert probe["shard"] == list(range(first, first + SHARD))
        assert probe["replicate"] == list(range(rank % SHARD, WORLD, SHARD))
        assert probe["zero_world"] == SHARD and probe["dp_world"] == WORLD


def test_optimizer_state_is_one_shard_of_the_model(results: dict) -> None:
    for per_rank in results["train"]:
        for stage, run in zip(STAGES, per_rank[:3], strict=True):  # fp32
            master = _shard_bytes(run, stage)
            # fp32 master shard: the model's elements over 2 ranks, plus padding (stage 3
            # pads each unit's segments to a multiple of the shard size)
            assert run["numel"] * 4 / SHARD <= master < run["numel"] * 4 / SHARD + 64 * 4
            # AdamW: two moments of the shard (and a scalar step counter per tensor)
            assert 2 * master <= run["memory"]["optimizer_state"] <= 2 * master + 64 * 8


def test_bytes_between_replicas_are_one_gradient_shard_per_step(results: dict) -> None:
    """partita counts an all-reduce as the tensor it carries (`partita.comm.counters`): each
    step all-reduces every gradient shard (fp32, numel/shard) once across the replicas and
    nothing else; a ring moves 2 * (r - 1) / r times that per rank, here with r = 2 exactly
    the count. The shard group carries the reduce-scatter, the all-gather and the norm."""
    half = len(_train_cases())
    for per_rank in results["train"]:
        for i in (0, 1, 2, half, half + 1, half + 2):  # stages 1-3, fp32 and float64
            run = per_rank[i]
            shard_bytes = _shard_bytes(run, STAGES[i % half])
            assert run["replicate_by_op"] == {"all_reduce/grad": STEPS * shard_bytes}
            # Across the 2 "nodes": that all-reduce each step, and nothing else of the steps
            # (the start-up broadcast of the model and the test's own loss sum aside).
            inter = dict(run["inter_by_op"])
            assert inter.pop("broadcast/init") == run["numel"] * (4 if i < half else 8)
            assert inter.pop("all_reduce/test") > 0
            assert inter == {"all_reduce/grad": STEPS * shard_bytes}
            assert run["group_bytes"]["dp_replicate"] == STEPS * shard_bytes
            assert run["group_bytes"]["dp_shard"] > 0
        for stage, clipped in zip((2, 3), per_rank[3:5], strict=True):
            # stages 2-3 reduce at every micro-batch: 2 per step
            shard_bytes = _shard_bytes(clipped, stage)
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
        assert "MiCS" in errors[3] and "stage 0" in errors[3]
