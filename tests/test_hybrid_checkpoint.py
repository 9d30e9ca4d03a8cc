"""Checkpoints of hybrid sharding (``zero_optimization.mics_shard_size``): a checkpoint saved at
(dp_shard 2, dp_replicate 2) is the checkpoint of one shard group (2 files, world size 2) and
loads at world 1, 2 and 4, hybrid or not, at stages 0-3, with the saving job's fp32 masters and
Adam state bitwise; resuming at hybrid trains on bitwise as the uninterrupted run ([Note:
checkpoints of replicas] in `partita.checkpoint.save`). One spawn per world size."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import partita
from checkpoint_workers import GLOBAL_BATCH, NEXT_STEPS, RESHARD_STEPS, full_states, reshard_config
from models import global_batches, make_model, rank_micro_batch
from partita import comm
from partita.testing import run_distributed

SHARD = 2
SAVED_STAGES = (1, 2, 3)
"""The stages saved at hybrid (hybrid sharding runs stages 1-3)."""


def _engine(stage: int, seed: int, shard: int | None = None) -> Any:
    model = make_model(seed=seed, frozen=True)
    config = reshard_config(stage, comm.get_world_size())
    if shard is not None:
        config["zero_optimization"]["mics_shard_size"] = shard
    engine, _, _, _ = partita.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config,
    )
    return engine


def _train(engine: Any, batches: list) -> list[float]:
    """One step per global batch (this rank's share); this rank's losses."""
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for batch in batches:
        loss = engine(*rank_micro_batch(batch, rank, world, GLOBAL_BATCH // world, 0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _folder(root: str, stage: int) -> str:
    return os.path.join(root, f"hybrid-s{stage}")


def _load(stage: int, folder: str, want: dict[str, torch.Tensor], shard: int | None = None):
    """A fresh engine (other initial weights) at `stage` loads `folder`: the states that differ
    from `want` (exact), the restored step counter, and the engine (to train on or destroy)."""
    engine = _engine(stage, seed=99, shard=shard)
    engine.load_checkpoint(folder)
    states = full_states(engine)
    differ = sorted(k for k in want if k not in states or not torch.equal(states[k], want[k]))
    return {"differ": differ, "global_steps": engine.global_steps}, engine


def saving_world(root: str) -> dict[str, Any]:
    """4 ranks: per saved stage, the hybrid run (save after RESHARD_STEPS, train on), a hybrid
    resume of it, and a plain stage-3 load of it."""
    batches = global_batches(RESHARD_STEPS + NEXT_STEPS, GLOBAL_BATCH)
    out: dict[str, Any] = {}
    for stage in SAVED_STAGES:
        engine = _engine(stage, seed=0, shard=SHARD)
        _train(engine, batches[:RESHARD_STEPS])
        engine.save_checkpoint(_folder(root, stage))
        states = full_states(engine)
        after = _train(engine, batches[RESHARD_STEPS:])
        engine.destroy()
        resumed, engine = _load(stage, _folder(root, stage), states, shard=SHARD)
        resumed["after"] = _train(engine, batches[RESHARD_STEPS:])
        engine.destroy()
        plain, engine = _load(3, _folder(root, stage), states)
        engine.destroy()
        out[stage] = {"states": states, "after": after, "hybrid": resumed, "plain3": plain}
    return out


def loading_world(root: str, want: dict[int, dict[str, torch.Tensor]], stages: list[int]):
    """Every saved checkpoint loaded at each of `stages` (plain data parallelism)."""
    out = {}
    for saved in SAVED_STAGES:
        for stage in stages:
            result, engine = _load(stage, _folder(root, saved), want[saved])
            engine.destroy()
            out[(saved, stage)] = result
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("hybrid-ckpt"))
    saved = run_distributed(saving_world, 4, root, timeout=240)
    want = {s: saved[0][s]["states"] for s in SAVED_STAGES}
    two = run_distributed(loading_world, 2, root, want, [0, 2, 3], timeout=180)
    one = run_distributed(loading_world, 1, root, want, [1], timeout=180)
    return {"root": root, "saved": saved, "loads": {2: two, 1: one}}


@pytest.mark.parametrize("stage", SAVED_STAGES)
def test_one_shard_group_is_written(runs: dict, stage: int) -> None:
    folder = os.path.join(_folder(runs["root"], stage), f"global_step{RESHARD_STEPS}")
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == SHARD
    assert sorted(manifest["files"]) == [f"rank{r:05d}-of-{SHARD:05d}.safetensors" for r in (0, 1)]
    # RNG and data loader states of every data-parallel rank (each reads its own batches).
    assert len(manifest["rng"]) == len(manifest["data_loader"]) == 4


@pytest.mark.parametrize("stage", SAVED_STAGES)
def test_hybrid_resume_is_bitwise(runs: dict, stage: int) -> None:
    for rank in runs["saved"]:
        run = rank[stage]
        assert run["hybrid"]["differ"] == []
        assert run["hybrid"]["global_steps"] == RESHARD_STEPS
        assert run["hybrid"]["after"] == run["after"]


@pytest.mark.parametrize("stage", SAVED_STAGES)
def test_plain_stage3_at_world_4_loads_it(runs: dict, stage: int) -> None:
    for rank in runs["saved"]:
        assert rank[stage]["plain3"] == {"differ": [], "global_steps": RESHARD_STEPS}


@pytest.mark.parametrize("saved", SAVED_STAGES)
@pytest.mark.parametrize(("world", "stage"), [(2, 0), (2, 2), (2, 3), (1, 1)])
def test_smaller_worlds_load_it(runs: dict, saved: int, world: int, stage: int) -> None:
    for rank in runs["loads"][world]:
        assert rank[(saved, stage)] == {"differ": [], "global_steps": RESHARD_STEPS}
