"""Section 1 (correctness against plain torch, fp16 overflow, determinism) and section 3
(checkpoints: stage 3 saved, stage 0 loaded, RNG restored)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

import partita

from .core import LR, Case, Context, verdict
from .model import build
from .trainers import (
    bitwise,
    compare,
    engine_config,
    seeded,
    train_partita,
    train_reference,
)

S1, S3 = "1 correctness", "3 checkpoints"


def run_section1(ctx: Context) -> None:
    """Stages 0-3 in bf16 against the reference, fp16 with a skipped overflow, a run twice."""
    mode = ctx.mode
    data = _data(ctx)
    lr = LR * (1 + 1e-3) if ctx.perturb == "parity" else LR  # a broken reference on purpose
    ref = train_reference(mode.small, "bf16", data, mode.device, lr=lr)
    for stage in range(4):
        ctx.run(S1, f"bf16 stage {stage} vs torch", lambda s=stage: _parity(ctx, s, ref, data))
    ctx.run(S1, "fp16 loss scaling, overflow skipped", lambda: _fp16_overflow(ctx, data))
    ctx.run(S1, "same run twice (stage 3, dropout)", lambda: _twice(ctx, data))


def _data(ctx: Context) -> list[Any]:
    from .model import batches

    shape = ctx.mode.small
    return batches(shape, ctx.mode.steps, shape.micro, ctx.mode.device)


def _parity(ctx: Context, stage: int, ref: Any, data: list[Any]) -> Case:
    config = engine_config(stage, "bf16", ctx.mode.small.micro)
    got = train_partita(ctx.mode.small, config, data, ctx.mode.device)
    figures = compare(got, ref)
    detail = "losses, bf16 weights and fp32 masters bitwise equal to plain torch"
    if not bitwise(figures):
        detail = f"differs: max loss diff {figures['max_loss_diff']:.3g}, master {figures['max_master_diff']:.3g}"
    return Case(S1, f"bf16 stage {stage} vs torch", verdict(bitwise(figures)), detail, figures)


def _fp16_overflow(ctx: Context, data: list[Any]) -> Case:
    """Stage 2 in fp16 with an inf injected into one gradient at step 1: that step is
    skipped, and the whole run equals the reference fed the same loss scales."""
    shape, device = ctx.mode.small, ctx.mode.device
    config = engine_config(2, "fp16", shape.micro)
    got = train_partita(shape, config, data, device, overflow_at=1)
    ref = train_reference(shape, "fp16", data, device, scales=got.scales, overflow_at=1)
    figures = compare(got, ref)
    figures.update(applied=got.applied, scales=got.scales)
    want_applied = [i != 1 for i in range(len(data))]
    ok = bitwise(figures) and got.applied == want_applied and ref.applied == want_applied
    detail = (
        f"step 1 skipped, scales {got.scales}; bitwise equal to the reference"
        if ok
        else f"applied {got.applied} (want {want_applied}), max loss diff {figures['max_loss_diff']:.3g}"
    )
    return Case(S1, "fp16 loss scaling, overflow skipped", verdict(ok), detail, figures)


def _twice(ctx: Context, data: list[Any]) -> Case:
    shape = ctx.mode.small.with_(dropout=0.1)
    config = engine_config(3, "bf16", shape.micro)
    runs = []
    for _ in range(2):
        with seeded(1234):
            runs.append(train_partita(shape, config, data, ctx.mode.device))
    figures = compare(runs[0], runs[1])
    ok = bitwise(figures)
    detail = "bitwise equal" if ok else f"max loss diff {figures['max_loss_diff']:.3g}"
    return Case(S1, "same run twice (stage 3, dropout)", verdict(ok), detail, figures)


def run_section3(ctx: Context) -> None:
    """Save at stage 3 mid-run, load at stage 0 (and at stage 3) and continue."""
    ctx.run(S3, "stage 3 save, stage 0/3 load, RNG", lambda: _checkpoint(ctx), min_s=10)


def _checkpoint(ctx: Context) -> list[Case]:
    """An uninterrupted stage-3 run with dropout; a copy saved after ``k`` steps and resumed
    at stage 0 and at stage 3 after the RNG was scrambled. The first resumed loss depends only
    on the loaded weights and the restored RNG (dropout masks); the later ones also on the
    loaded optimizer state. Every stage steps bitwise like plain torch (section 1), so every
    resumed loss must equal the uninterrupted run's bitwise, at either stage."""
    shape = ctx.mode.small.with_(dropout=0.1)
    data = _data(ctx)
    k = len(data) // 2
    with tempfile.TemporaryDirectory(dir=ctx.out_dir) as tmp:
        with seeded(99):
            full, rng_at_save = _train_and_save(ctx, shape, data, k, tmp)
        resumed = {stage: _resume(ctx, shape, data[k:], tmp, stage) for stage in (0, 3)}
    cases = []
    for stage, (losses, rng_after_load) in resumed.items():
        first_equal = losses[0] == full[k]
        all_equal = losses == full[k:]
        rng_equal = rng_after_load == rng_at_save
        ok = first_equal and rng_equal and all_equal
        figures = {
            "uninterrupted": full[k:],
            "resumed": losses,
            "rng_restored": rng_equal,
            "all_steps_equal": all_equal,
        }
        detail = (
            f"RNG restored; all {len(losses)} resumed losses bitwise equal to the uninterrupted run"
            if ok
            else f"RNG restored {rng_equal}; first loss equal {first_equal}, all equal {all_equal}"
            f" ({losses} vs {full[k:]})"
        )
        cases.append(Case(S3, f"stage 3 save -> stage {stage} load", verdict(ok), detail, figures))
    return cases


def _rng_bytes() -> list[bytes]:
    """The generator states dropout draws from (CUDA's on the GPU, the CPU's otherwise)."""
    if torch.cuda.is_available():
        return [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return [torch.get_rng_state().numpy().tobytes()]


def _train_and_save(
    ctx: Context, shape: Any, data: list[Any], k: int, save_dir: str
) -> tuple[list[float], list[bytes]]:
    model = build(shape, 0, ctx.mode.device)
    config = engine_config(3, "bf16", shape.micro)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    losses, rng = [], []
    for i, batch in enumerate(data):
        if i == k:
            engine.save_checkpoint(save_dir, tag="mid")
            rng = _rng_bytes()
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    engine.destroy()
    return losses, rng


def _resume(
    ctx: Context, shape: Any, rest: list[Any], save_dir: str, stage: int
) -> tuple[list[float], list[bytes]]:
    with seeded(7):  # a different RNG state: only the checkpoint can bring the right one back
        model = build(shape, 5, ctx.mode.device)
    config = engine_config(stage, "bf16", shape.micro)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    path, _ = engine.load_checkpoint(save_dir, tag="mid")
    if path is None:
        raise RuntimeError(f"load_checkpoint found nothing in {save_dir}")
    rng = _rng_bytes()
    losses = []
    for batch in rest:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    engine.destroy()
    return losses, rng
