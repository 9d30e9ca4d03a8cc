"""Section 1's two-process case: two ranks on the one device (NCCL where it allows that,
else gloo) train stages 2 and 3 and must match a single-process torch run on the whole batch
as the CPU parity suite does: in fp32, per-step losses within rtol 1e-6; in float64, losses
within rtol 1e-6 and every final weight within the first-order reduction-order bound
(`weight_atol`; the suite's [Note: parity bound] in tests/models.py says why fp32 weights
cannot be held elementwise: the first GPU run saw fp32 weights 3.9e-05 apart with losses
1.8e-07 apart)."""

from __future__ import annotations

from typing import Any

import torch

from .core import EPS, LR, Case, Context, verdict
from .model import Shape, batches
from .spawn import choose_backend, spawn
from .trainers import DTYPES, engine_config, train_reference

S1 = "1 correctness"
WORLD = 2
PRECISIONS = ("fp32", "fp64")


def weight_atol(steps: int, shape: Shape) -> float:
    """Final-weight bound of a float64 run: the two runs sum each gradient element's terms
    (at most one per token of the global batch) in different orders, at most 2 n u apart
    (n terms, u = 2^-53, terms summing to at most 1 in magnitude for a mean cross-entropy),
    and AdamW turns a gradient difference into at most lr / eps of a weight per step."""
    terms = WORLD * shape.micro * shape.seq
    return steps * LR * (2 * terms * 2.0**-53) / EPS


def rank_run(shape: Shape, steps: int, stages: tuple[int, ...]) -> dict[tuple[int, str], Any]:
    """On each rank: its half of every global batch, one fp32 engine per stage; the global
    mean loss per step and (rank 0) the final weights on the CPU."""
    import partita
    from partita import comm
    from partita.platform.accelerator import get_accelerator

    from .model import build

    device = get_accelerator().current_device()
    rank = comm.get_rank()
    data = batches(shape, steps, shape.micro * WORLD, device)
    out: dict[tuple[int, str], Any] = {}
    for stage, precision in [(s, p) for s in stages for p in PRECISIONS]:
        model = build(shape, 0, device).to(DTYPES[precision])
        config = engine_config(stage, precision, shape.micro)
        engine, _, _, _ = partita.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        losses = []
        for tokens, targets in data:
            mine = slice(rank * shape.micro, (rank + 1) * shape.micro)
            loss = engine(tokens[mine], targets[mine])
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            comm.all_reduce(total, tag="check")
            losses.append(float(total) / WORLD)
        params = list(engine.module.parameters())
        with partita.zero.GatheredParameters(params):
            weights = [p.detach().cpu().clone() for p in params]
        out[(stage, precision)] = {"losses": losses, "weights": weights}
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
        ctx.run(S1, f"2 ranks ({chosen['backend']}) stages 2, 3 vs torch",
                lambda: _compare(ctx, chosen["backend"], chosen["env"]), min_s=20)  # fmt: skip


def _compare(ctx: Context, backend: str, env: dict[str, str]) -> list[Case]:
    shape, steps = ctx.mode.small, ctx.mode.steps
    stages = (2, 3)
    results = spawn(rank_run, (shape, steps, stages), WORLD, backend, env, timeout=240)
    data = batches(shape, steps, shape.micro * WORLD, ctx.mode.device)
    refs = {p: train_reference(shape, p, data, ctx.mode.device) for p in PRECISIONS}
    atol = weight_atol(steps, shape)
    cases = []
    for stage in stages:
        figures: dict[str, object] = {"backend": backend, "fp64_weight_atol": atol}
        for precision, ref in refs.items():
            got = results[0][(stage, precision)]
            losses = torch.tensor(got["losses"], dtype=torch.float64)
            ref_losses = torch.tensor(ref.losses, dtype=torch.float64)
            figures[f"{precision}_max_loss_rel_diff"] = float(
                ((losses - ref_losses).abs() / ref_losses.abs()).max()
            )
            figures[f"{precision}_max_weight_diff"] = max(
                float((a.double() - b.double()).abs().max())
                for a, b in zip(got["weights"], ref.weights, strict=True)
            )
        ok = (
            figures["fp32_max_loss_rel_diff"] <= 1e-6  # type: ignore[operator]
            and figures["fp64_max_loss_rel_diff"] <= 1e-6  # type: ignore[operator]
            and figures["fp64_max_weight_diff"] <= atol  # type: ignore[operator]
        )
        detail = (
            f"{backend}: max loss rel diff fp32 {figures['fp32_max_loss_rel_diff']:.2g}, "
            f"fp64 {figures['fp64_max_loss_rel_diff']:.2g} (tol 1e-6); max weight diff fp64 "
            f"{figures['fp64_max_weight_diff']:.2g} (tol {atol:.2g}), fp32 "
            f"{figures['fp32_max_weight_diff']:.2g} (not held: see the module doc)"
        )
        cases.append(
            Case(S1, f"2 ranks ({backend}) stage {stage} vs torch", verdict(ok), detail, figures)
        )
    return cases
