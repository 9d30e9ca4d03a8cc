"""The check's JSON and markdown: every case's status, the speed table and the goals."""

from __future__ import annotations

import json
import os
from typing import Any

from .core import FAILING, Case, Context

SPEED = "4 speed"


def goals(ctx: Context) -> list[tuple[str, float | None, float, str]]:
    """(goal, measured, target, how compared): reported, not asserted."""
    speed = {
        c.name: c.figures for c in ctx.cases if c.section == SPEED and "tokens_per_s" in c.figures
    }

    def ratio(a: str, b: str, key: str) -> float | None:
        if a in speed and b in speed and speed[a].get(key) and speed[b].get(key):
            return speed[a][key] / speed[b][key]
        return None

    return [
        ("partita stage 3 tokens/s / FSDP2's (MFU ratio)",
         ratio("partita stage 3", "FSDP2 (fully_shard per block)", "tokens_per_s"), 1.0, ">="),
        ("partita stage 0 tokens/s / torch + fused AdamW",
         ratio("partita stage 0", "torch + fused AdamW", "tokens_per_s"), 0.95, ">="),
        ("copy time hidden behind CPU Adam (offload overlap)",
         ctx.notes.get("overlap_hidden_fraction"), 0.80, ">="),
        ("partita stage 3 + CPU offload step time / DeepSpeed ZeRO-Offload's (a comparison)",
         ratio("DeepSpeed stage 3 + ZeRO-Offload", "partita stage 3 + CPU offload", "tokens_per_s"), 1.0, "<="),
    ]  # fmt: skip


def _speed_table(cases: list[Case]) -> list[str]:
    rows = [c for c in cases if c.section == SPEED and c.name != "DeepSpeed ops build"]
    base = next(
        (c.figures for c in rows if c.name == "torch + fused AdamW" and "step_ms" in c.figures),
        None,
    )
    lines = [
        "| configuration | micro-batch x seq | step (ms) | tokens/s | vs torch | TFLOPS | MFU "
        "| peak device memory (GB) | last loss | optimizer | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for c in rows:
        f = c.figures
        if "step_ms" not in f:
            lines.append(f"| {c.name} | {c.status}: {c.detail} |" + " |" * 9)
            continue
        vs = f"{f['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        mfu = f"{f['mfu']:.1%}" if f.get("mfu") is not None else "-"
        peak = f"{f['peak_gb']:.1f}" if f.get("peak_gb") is not None else "-"
        lines.append(
            f"| {c.name} | {f['micro']} x {f['seq']} | {f['step_ms']:.1f} | {f['tokens_per_s']:.0f} | {vs} "
            f"| {f['tflops']:.1f} | {mfu} | {peak} | {f['losses'][-1]:.4f} | {f['optimizer']} "
            f"| {f.get('note', '')} |"
        )
    return lines


def markdown(ctx: Context, env: dict[str, Any]) -> str:
    """The report as markdown: header, cases, speed table, goals."""
    mode = ctx.mode
    failed = [c for c in ctx.cases if c.status in FAILING]
    kind = "dry run on CPU at tiny sizes" if mode.dry else f"GPU run on {env.get('device_name')}"
    lines = [
        f"### partita GPU check: {kind}",
        "",
        f"torch {env['torch']}, CUDA {env.get('cuda')}, deepspeed {env.get('deepspeed')}, "
        f"{env['cpu_count']} CPUs; two ranks on one device: {ctx.notes.get('two_process_backend', 'not run')}; "
        f"{len(failed)} failing case(s) of {len(ctx.cases)}.",
        "",
        "| section | case | status | detail | s |",
        "|---|---|---|---|---:|",
    ]
    for c in ctx.cases:
        detail = c.detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| {c.section} | {c.name} | {c.status} | {detail} | {c.seconds:.1f} |")
    shape = mode.big
    lines += ["", f"#### Speed: GPT {shape.layers} x {shape.dim}, vocab {shape.vocab}, bf16, world size 1, "
              f"median of {mode.speed_steps} steps after {mode.speed_warmup} warm-up; MFU against 989 TFLOPS "
              "(H200 bf16 dense)", ""]  # fmt: skip
    if mode.dry:
        lines += [
            "Dry run: a tiny model on CPU, so these timings only show that each row runs.",
            "",
        ]
    lines += _speed_table(ctx.cases)
    lines += ["", "Goals (reported, not asserted):", ""]
    for name, value, target, op in goals(ctx):
        if value is None:
            lines.append(f"- {name}: not measured")
            continue
        met = value >= target if op == ">=" else value <= target
        lines.append(f"- {name}: {value:.3f} (goal {op} {target}): {'met' if met else 'not met'}")
    return "\n".join(lines) + "\n"


def write(ctx: Context, env: dict[str, Any]) -> tuple[str, str]:
    """Writes ``gpu_check.json`` and ``gpu_check.md`` into the output folder."""
    os.makedirs(ctx.out_dir, exist_ok=True)
    md = markdown(ctx, env)
    payload = {
        "mode": "dry" if ctx.mode.dry else "gpu",
        "environment": env,
        "notes": ctx.notes,
        "failed": [f"{c.section} / {c.name}" for c in ctx.cases if c.status in FAILING],
        "goals": [{"goal": g, "value": v, "target": t, "op": o} for g, v, t, o in goals(ctx)],
        "cases": [c.__dict__ for c in ctx.cases],
    }
    md_path, json_path = (
        os.path.join(ctx.out_dir, "gpu_check.md"),
        os.path.join(ctx.out_dir, "gpu_check.json"),
    )
    with open(md_path, "w") as fh:
        fh.write(md)
    with open(json_path, "w") as fh:
        json.dump(payload, fh, indent=2, default=str)
        fh.write("\n")
    return md_path, json_path
