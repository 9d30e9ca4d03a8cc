"""Stage 0 (replicated state) saves share the writing (issue 21 item 1): every rank holds all
of it, so each trainable parameter is written (copied, hashed, written) by one rank, balanced
by size, instead of rank 0 writing everything; the checkpoint loads back bitwise."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import partita
from models import global_batches, make_model, rank_micro_batch
from partita.testing import run_distributed

_CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 10**6,
}


def _states(engine: Any) -> dict[str, torch.Tensor]:
    return {n: engine.param_states.local_state(p, "exp_avg").clone() for n, p in
            engine.module.named_parameters()}  # fmt: skip


def stage0_worker(root: str) -> dict[str, Any]:
    """Trains a step at stage 0, saves, loads into a fresh engine; returns the manifest's
    files and whether the loaded state is the saved."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = partita.initialize(model=make_model(seed=2), config=_CFG)
    for batch in global_batches(2, 2 * world, seed=3):
        tokens, targets = rank_micro_batch(batch, rank, world, 2, 0)
        engine.backward(engine(tokens, targets))
        engine.step()
    engine.save_checkpoint(root, tag="t")
    saved = _states(engine)
    numel = {n: p.numel() for n, p in engine.module.named_parameters()}
    engine.destroy()
    engine, *_ = partita.initialize(model=make_model(seed=9), config=_CFG)
    engine.load_checkpoint(root, tag="t")
    loaded = _states(engine)
    with open(os.path.join(root, "t", "manifest.json")) as f:
        files = json.load(f)["files"]
    same = all(torch.equal(saved[n], loaded[n]) for n in saved)
    return {"files": files, "numel": numel, "same": same}


def test_stage0_ranks_share_the_writing_and_load_back(tmp_path: Any) -> None:
    results = run_distributed(stage0_worker, 2, str(tmp_path), timeout=240)
    files, numel = results[0]["files"], results[0]["numel"]
    assert sorted(files) == ["rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"]
    # Each trainable parameter whole in exactly one file.
    held: dict[str, list[list[int]]] = {}
    for info in files.values():
        for name, ranges in info["ranges"].items():
            assert name not in held, name
            held[name] = ranges
    assert held == {n: [[0, k]] for n, k in numel.items()}
    # Balanced: neither rank writes most of it (rank 0 also writes the buffers).
    sizes = sorted(info["bytes"] for info in files.values())
    assert sizes[0] > 0.3 * sum(sizes), sizes
    assert all(r["same"] for r in results), results
