"""Per-rank bodies for tests/test_deepspeed_checkpoints.py: DeepSpeed itself (0.19.8, CPU
accelerator, gloo) trains a small model and saves ZeRO checkpoints; partita engines then load
them. Module level so spawned ranks can import them; deepspeed is imported inside the bodies
(DS_ACCELERATOR=cpu must be set before its import)."""

from __future__ import annotations

import os
from typing import Any

import torch

import partita
from checkpoint_workers import full_states, reshard_config
from models import global_batches, make_model, rank_micro_batch
from partita import comm

GLOBAL_BATCH = 4
DS_STEPS = 2
CASES = {
    # name: (DeepSpeed ZeRO stage, bf16, frozen first block)
    "s1": (1, False, False),
    "s2": (2, False, True),
    "s2-bf16": (2, True, False),
    "s3": (3, False, True),
}


def ds_config(stage: int, bf16: bool) -> dict[str, Any]:
    """DeepSpeed's config for the saving run (global batch 4, one micro-step per step)."""
    world = comm.get_world_size()
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _ds_full_states(engine: Any, initial: dict[str, torch.Tensor]) -> dict:
    """DeepSpeed's own view of every trainable parameter's fp32 master and Adam state, in the
    keys `checkpoint_workers.full_states` uses (frozen ones: their initial values)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            out[f"frozen::{name}"] = initial[name]
            continue
        out[f"param::{name}"] = safe_get_full_fp32_param(p).float().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}::{name}"] = safe_get_full_optimizer_state(p, key).float().clone()
    # torch's AdamW keeps one `step` per flat partition (DeepSpeed steps flat groups).
    inner = engine.optimizer.optimizer
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    assert len(steps) == 1, steps
    step = steps.pop()
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[f"step::{name}"] = torch.tensor(step)
    return out


def ds_save(root: str) -> dict[str, Any]:
    """DeepSpeed trains `DS_STEPS` steps and saves, for every case; returns its states."""
    import deepspeed

    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict[str, Any] = {}
    for name, (stage, bf16, frozen) in CASES.items():
        model = make_model(seed=3, frozen=frozen)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=opt, model_parameters=trainable, config=ds_config(stage, bf16)
        )
        for batch in global_batches(DS_STEPS, GLOBAL_BATCH):
            tokens, targets = rank_micro_batch(batch, rank, world, GLOBAL_BATCH // world, 0)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(os.path.join(root, name))
        out[name] = _ds_full_states(engine, initial)
        engine.destroy()
    return out


def _partita_engine(stage: int, bf16: bool, frozen: bool) -> Any:
    model = make_model(seed=11, frozen=frozen)
    cfg = reshard_config(stage, comm.get_world_size(), "bf16" if bf16 else "fp32")
    engine, *_ = partita.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=cfg,
    )
    return engine


def partita_load(root: str, loads: list[tuple[str, int]]) -> dict[str, Any]:
    """Each (case, partita stage): a fresh partita engine loads DeepSpeed's checkpoint with
    ``trust_pickle=True``; its full states, counters, and what a second load of the same
    checkpoint without the opt-in raises (trust is per call, not process-wide)."""
    out: dict[str, Any] = {}
    for case, stage in loads:
        _, bf16, frozen = CASES[case]
        engine = _partita_engine(stage, bf16, frozen)
        folder = os.path.join(root, case)
        try:
            path, client = engine.load_checkpoint(folder, trust_pickle=True)
        except Exception as e:  # reported to the test, which names the case
            out[(case, stage)] = {"error": f"{type(e).__name__}: {e}"}
            engine.destroy()
            continue
        result: dict[str, Any] = {"path": path, "client": client}
        result["states"] = full_states(engine)
        result["global_steps"] = engine.global_steps
        try:
            engine.load_checkpoint(folder)
            result["untrusted"] = "loaded"
        except Exception as e:
            result["untrusted"] = f"{type(e).__name__}: {e}"
        result["env"] = os.environ.get("PARTITA_TRUST_PICKLE")
        out[(case, stage)] = result
        engine.destroy()
    return out


def save_and_load(root: str, loads: list[tuple[str, int]]) -> dict[str, Any]:
    """World 2: DeepSpeed saves every case, then partita loads them (one spawn for both)."""
    return {"ds": ds_save(root), "loaded": partita_load(root, loads)}
