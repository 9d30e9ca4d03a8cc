"""Per-rank bodies for checkpoint tests (module level so spawned ranks can import them).

One spawn per world size runs many cases: `save_phase` trains, saves and keeps training (the
uninterrupted reference); `load_phase` starts fresh engines in new processes, loads and
continues. Together they give the exact-resume checks (same world size) and the reshard
matrix (every saved world size and stage into every loading stage).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

import partita
from models import VOCAB, TinyLM, global_batches, make_model, rank_micro_batch
from partita import comm
from partita.zero import accessors

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


class DropoutLM(TinyLM):
    """TinyLM with dropout on the embeddings and before the head (random masks per step)."""

    def __init__(self) -> None:
        super().__init__(dim=16, layers=2)
        self.drop = nn.Dropout(0.2)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.drop(self.norm(x)))
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def resume_config(stage: int) -> dict[str, Any]:
    """fp16 with dynamic loss scaling, warmup schedule, accumulation 2."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 8},
        },
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "steps_per_print": 1000,
    }


def _dataset(n: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (n, 8), generator=gen)
    return [(t, (t * 5 + 1) % VOCAB) for t in tokens]


def _inject_inf(engine: Any, steps: set[int]) -> None:
    """An inf in one gradient element on rank 0 at the given global steps (a skipped step)."""
    if comm.get_rank() != 0:
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if engine.global_steps in steps:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    next(engine.module.parameters()).register_hook(hook)


def _resume_engine(stage: int, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = DropoutLM()
    engine, _, loader, _ = partita.initialize(
        model=model, config=resume_config(stage), training_data=_dataset()
    )
    _inject_inf(engine, {2, 6})
    return engine, loader


def _train_steps(engine: Any, loader: Any, steps: int) -> list[float]:
    """`steps` optimizer steps over the loader (new epochs as needed); per-micro-step losses."""
    losses = []
    it = iter(loader)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        try:
            tokens, targets = next(it)
        except StopIteration:
            it = iter(loader)
            tokens, targets = next(it)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def resume_full(stage: int, folder: str, total: int, save_at: int) -> dict[str, Any]:
    """The uninterrupted run: saves after `save_at` steps and trains on to `total`."""
    engine, loader = _resume_engine(stage, seed=0)
    before = _train_steps(engine, loader, save_at)
    engine.save_checkpoint(folder, client_state={"save_at": save_at, "note": "resume"})
    after = _train_steps(engine, loader, total - save_at)
    out = {"before": before, "after": after, "skipped": engine.skipped_steps}
    out["scale"] = engine.cur_scale
    engine.destroy()
    return out


def resume_load(stage: int, folder: str, total: int, save_at: int) -> dict[str, Any]:
    """A fresh engine (other initial weights) loads and trains to `total`."""
    engine, loader = _resume_engine(stage, seed=123)
    path, client = engine.load_checkpoint(folder)
    after = _train_steps(engine, loader, total - save_at)
    out = {"after": after, "skipped": engine.skipped_steps, "client": client, "path": path}
    out["scale"] = engine.cur_scale
    engine.destroy()
    return out


# --- reshard ---------------------------------------------------------------------------------
GLOBAL_BATCH = 4
RESHARD_STEPS, NEXT_STEPS = 3, 5


def reshard_config(stage: int, world: int) -> dict[str, Any]:
    """fp32 AdamW, global batch 4 at any world size; small buckets so layouts differ."""
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},
        "steps_per_print": 1000,
    }


def _reshard_engine(stage: int, seed: int) -> Any:
    model = make_model(seed=seed, frozen=True)
    engine, _, _, _ = partita.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=reshard_config(stage, comm.get_world_size()),
    )
    return engine


def full_states(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master and optimizer state, gathered (collective)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            out[f"frozen::{name}"] = p.detach().float().clone()
            continue
        out[f"param::{name}"] = accessors.safe_get_full_fp32_param(p)
        for key in STATE_KEYS:
            value = accessors.safe_get_full_optimizer_state(p, key)
            if value is not None:
                out[f"{key}::{name}"] = value.float()
    return out


def _global_losses(engine: Any, batches: list) -> list[float]:
    rank, world = comm.get_rank(), comm.get_world_size()
    micro = GLOBAL_BATCH // world
    losses = []
    for batch in batches:
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        comm.all_reduce(total, tag="test")
        losses.append(total.item() / world)
    return losses


def reshard_save(stage: int, folder: str) -> dict[str, Any]:
    """Trains 3 steps, saves, records the states, trains 5 more (the reference)."""
    engine = _reshard_engine(stage, seed=0)
    batches = global_batches(RESHARD_STEPS + NEXT_STEPS, GLOBAL_BATCH)
    _global_losses(engine, batches[:RESHARD_STEPS])
    engine.save_checkpoint(folder)
    states = full_states(engine)
    losses = _global_losses(engine, batches[RESHARD_STEPS:])
    engine.destroy()
    return {"states": states, "losses": losses}


def reshard_load(stage: int, folder: str, ref_states: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A fresh engine at this world size and `stage` loads `folder`; returns the states that
    differ from `ref_states` (exact comparison) and the next 5 steps' losses."""
    engine = _reshard_engine(stage, seed=99)
    engine.load_checkpoint(folder)
    states = full_states(engine)
    differ = sorted(
        k for k in ref_states if k not in states or not torch.equal(states[k], ref_states[k])
    )
    batches = global_batches(RESHARD_STEPS + NEXT_STEPS, GLOBAL_BATCH)
    losses = _global_losses(engine, batches[RESHARD_STEPS:])
    out = {"differ": differ, "losses": losses, "global_steps": engine.global_steps}
    engine.destroy()
    return out


# --- one spawn per world size ------------------------------------------------------------------
def save_phase(root: str, resume_stages: list[int], reshard_stages: list[int]) -> dict[str, Any]:
    """Every save-side case of one world size (see the module docstring)."""
    world = comm.get_world_size()
    out: dict[str, Any] = {"resume": {}, "reshard": {}}
    for s in resume_stages:
        folder = os.path.join(root, f"resume-w{world}-s{s}")
        out["resume"][s] = resume_full(s, folder, total=10, save_at=4)
    for s in reshard_stages:
        out["reshard"][s] = reshard_save(s, os.path.join(root, f"reshard-n{world}-s{s}"))
    return out


def load_phase(
    root: str, resume_stages: list[int], saved: dict[tuple[int, int], dict], stages: list[int]
) -> dict[str, Any]:
    """Every load-side case of one world size: resumes, then all (N, s) x t reshard loads."""
    world = comm.get_world_size()
    out: dict[str, Any] = {"resume": {}, "reshard": {}}
    for s in resume_stages:
        folder = os.path.join(root, f"resume-w{world}-s{s}")
        out["resume"][s] = resume_load(s, folder, total=10, save_at=4)
    for (n, s), ref in saved.items():
        folder = os.path.join(root, f"reshard-n{n}-s{s}")
        for t in stages:
            out["reshard"][(n, s, t)] = reshard_load(t, folder, ref)
    return out


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """(result or the exception raised, seconds)."""
    start = time.perf_counter()
    try:
        result: Any = fn(*args, **kwargs)
    except Exception as e:
        result = e
    return result, time.perf_counter() - start
