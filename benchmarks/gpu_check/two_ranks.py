"""Section 1's two-process case: two ranks on the one device (NCCL where it allows that,
else gloo) train fp32 stages 2 and 3 and must match a single-process torch run on the whole
batch at the design's fp32 parity tolerance (per-step losses rtol 1e-6, weights 1e-6)."""

from __future__ import annotations

from typing import Any

import torch

from gpu_check.core import Case, Context, verdict
from gpu_check.model import Shape, batches
from gpu_check.spawn import choose_backend, spawn
from gpu_check.trainers import engine_config, train_reference

S1 = "1 correctness"
WORLD = 2


def rank_run(shape: Shape, steps: int, stages: tuple[int, ...]) -> dict[int, Any]:
    """On each rank: its half of every global batch, one fp32 engine per stage; the global
    mean loss per step and (rank 0) the final weights on the CPU."""
    import partita
    from gpu_check.model import build
    from partita import comm
    from partita.accelerator import get_accelerator

    device = get_accelerator().current_device()
    rank = comm.get_rank()
    data = batches(shape, steps, shape.micro * WORLD, device)
    out: dict[int, Any] = {}
    for stage in stages:
        model = build(shape, 0, device)
        config = engine_config(stage, "fp32", shape.micro)
        engine, _, _, _ = partita.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        losses = []
        for tokens, targets in data:
            mine = slice(rank * shape.micro, (rank + 1) * shape.micro)
            loss = engine(tokens[mine], targets[mine])
            engine.backward(loss)
            engine.step()
            total = loss.detach().float().clone()
            comm.all_reduce(total, tag="check")
            losses.append(float(total) / WORLD)
        params = list(engine.module.parameters())
        with partita.zero.GatheredParameters(params):
            weights = [p.detach().cpu().clone() for p in params]
        out[stage] = {"losses": losses, "weights": weights}
        engine.destroy()
    return out


def run_two_ranks(ctx: Context) -> None:
    """Chooses the backend, then runs and compares (see the module doc)."""
    mode = ctx.mode
    env = {"PARTITA_ACCELERATOR": "cuda" if mode.is_cuda else "cpu", "OMP_NUM_THREADS": "1"}
    if not mode.is_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    chosen: dict[str, Any] = {}

    def pick() -> Case:
        backend, env2, why = choose_backend(mode.is_cuda, env, timeout=60)
        chosen.update(backend=backend, env=env2)
        ctx.notes["two_process_backend"] = why
        return Case(S1, "2 ranks on one device: backend", "pass", why)

    ctx.run(S1, "2 ranks on one device: backend", pick, min_s=20)
    if chosen:
        ctx.run(S1, f"2 ranks ({chosen['backend']}) fp32 stages 2, 3 vs torch",
                lambda: _compare(ctx, chosen["backend"], chosen["env"]), min_s=20)  # fmt: skip


def _compare(ctx: Context, backend: str, env: dict[str, str]) -> list[Case]:
    shape = ctx.mode.small
    stages = (2, 3)
    results = spawn(rank_run, (shape, ctx.mode.steps, stages), WORLD, backend, env, timeout=240)
    data = batches(shape, ctx.mode.steps, shape.micro * WORLD, ctx.mode.device)
    ref = train_reference(shape, "fp32", data, ctx.mode.device)
    ref_losses = torch.tensor(ref.losses, dtype=torch.float64)
    cases = []
    for stage in stages:
        got = results[0][stage]
        losses = torch.tensor(got["losses"], dtype=torch.float64)
        loss_rel = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
        weight_ok = all(
            torch.allclose(a, b, rtol=1e-6, atol=1e-6)
            for a, b in zip(got["weights"], ref.weights, strict=True)
        )
        weight_diff = max(
            float((a - b).abs().max()) for a, b in zip(got["weights"], ref.weights, strict=True)
        )
        ok = loss_rel <= 1e-6 and weight_ok
        figures = {
            "max_loss_rel_diff": loss_rel,
            "max_weight_diff": weight_diff,
            "backend": backend,
        }
        detail = f"{backend}: max loss rel diff {loss_rel:.2g} (tol 1e-6), max weight diff {weight_diff:.2g}"
        cases.append(
            Case(
                S1, f"2 ranks ({backend}) fp32 stage {stage} vs torch", verdict(ok), detail, figures
            )
        )
    return cases
