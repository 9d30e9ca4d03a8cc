"""Data-parallel (ZeRO stage 0) training benchmark: partita against its peers.

Trains the same GPT-2 on the same data with each configuration as its own ``torchrun`` job of
``--nprocs`` CPU processes (gloo), and prints median step time and peak RSS side by side:

* ``partita``: partita stage 0 (``import partita as deepspeed``);
* ``ddp-fused``: PyTorch DDP with ``torch.optim.AdamW(fused=True)``, the strongest peer here;
* ``ddp``: PyTorch DDP with the default ``torch.optim.AdamW``;
* ``deepspeed``: DeepSpeed stage 0, when ``import deepspeed`` works (``DS_ACCELERATOR=cpu``).

All use fp32, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01), gradient clipping
at 1.0, no scheduler; warm-up steps are excluded from timing. Example::

    .venv/bin/python benchmarks/bench_dp.py --model 23m --steps 20

Writes ``benchmarks/results/dp_<model>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_dp)
    from benchmarks import common
else:  # python benchmarks/bench_dp.py: this folder is sys.path[0]
    import common


IMPLS: dict[str, str] = {
    "partita": "partita stage 0",
    "ddp-fused": "DDP + AdamW(fused=True)",
    "ddp": "DDP + AdamW (default)",
    "deepspeed": "DeepSpeed stage 0",
}
PEERS = ("ddp-fused", "ddp", "deepspeed")
# fp32 runs of one model on the same data differ only by summation order (fused vs for-loop
# AdamW, bucketed all-reduce); a gap above this means a configuration trained something else.
LOSS_GAP_WARN = 1e-3

StepFn = Callable[[torch.Tensor], torch.Tensor]


def parse_args() -> argparse.Namespace:
    """Orchestrator and worker arguments (the worker is this script under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(common.MODEL_SHAPES), default="23m")
    p.add_argument(
        "--impls", default=",".join(IMPLS), help="comma-separated subset of " + ", ".join(IMPLS)
    )
    p.add_argument("--nprocs", type=int, default=2, help="processes per job")
    p.add_argument(
        "--threads", type=int, help="torch threads per process (default: cores / nprocs)"
    )
    p.add_argument("--micro_batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--rounds", type=int, default=1,
        help="jobs per configuration, run in turn (A B C A B C ...); steps of all are pooled",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--job_timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--results_dir", type=Path, default=common.RESULTS_DIR, help="where to write")
    p.add_argument("--worker", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--result_file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nprocs)
    return args


# --- worker --------------------------------------------------------------------------------


def setup_ddp(model: torch.nn.Module, fused: bool) -> tuple[StepFn, dict[str, Any]]:
    """DDP on gloo with torch's AdamW; the step mirrors what an engine's step does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=common.LR, betas=common.BETAS, eps=common.EPS,
        weight_decay=common.WEIGHT_DECAY, fused=fused,
    )  # fmt: skip

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = ddp(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, {"optimizer": f"{type(opt).__name__}(fused={fused})"}


def setup_engine(
    backend: str, model: torch.nn.Module, micro_batch: int, stage: int
) -> tuple[StepFn, dict[str, Any]]:
    """partita or DeepSpeed through the DeepSpeed API, the config from `common.ds_config`."""
    engine_lib = importlib.import_module(backend)
    engine, optimizer, _, _ = engine_lib.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=common.ds_config(micro_batch, stage),
    )

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = engine(batch.to(engine.device), labels=batch.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"optimizer": type(optimizer).__name__}


def worker(args: argparse.Namespace) -> None:
    """One configuration on one rank: build, time, and (rank 0) write the result file."""
    import json

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = args.worker.split("-")[0]
    if backend in ("partita", "deepspeed"):
        importlib.import_module(backend)  # first, as training scripts do (partita's import sets
        # its allocator default, which must precede the model's allocations)
    baseline = common.peak_rss_mb()  # interpreter, torch, engine library: before model, engine
    model = common.build_gpt2(args.model, args.seed)
    if args.worker in ("ddp", "ddp-fused"):
        step, extra = setup_ddp(model, fused=args.worker == "ddp-fused")
    else:
        step, extra = setup_engine(args.worker, model, args.micro_batch, stage=0)
    batches = common.corpus_batches(rank, world, args.micro_batch, args.seq_len)
    times, losses, faults = common.time_steps(step, batches, args.warmup, args.steps)
    extra["params"] = common.count_params(model)
    result = common.collect_result(times, losses, baseline, extra, faults)
    if result is not None:
        Path(args.result_file).write_text(json.dumps(result))
    common.exit_worker()


# --- orchestrator --------------------------------------------------------------------------


def available(impl: str) -> str | None:
    """Why ``impl`` cannot run here, or None when it can."""
    module = {"partita": "partita.api", "deepspeed": "deepspeed"}.get(impl)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"not installed (`import {module}` fails)"


def run_job(
    args: argparse.Namespace, impl: str, shared: list[str], errors: dict[str, str]
) -> dict[str, Any] | None:
    """One configuration's job; None (and the error in ``errors``) when it failed."""
    print(f"running {IMPLS[impl]} ...", flush=True)
    try:
        result = common.launch_job(
            Path(__file__).resolve(), ["--worker", impl, *shared], args.nprocs, args.threads,
            args.job_timeout,
        )  # fmt: skip
    except Exception as exc:  # one failed configuration must not hide the others
        errors[impl] = str(exc)
        print(f"  {IMPLS[impl]} FAILED:\n{exc}", file=sys.stderr, flush=True)
        return None
    print(f"  median step {result['median_step_s'] * 1e3:.1f} ms, "
          f"peak RSS {result['peak_rss_mb']} MB", flush=True)  # fmt: skip
    return result


def table_rows(impls: list[str], runs: dict[str, list[dict[str, Any]]]) -> list[common.Row]:
    """One row per configuration: its jobs merged, or why it has none."""
    rows = []
    for impl in impls:
        merged = common.merge_rounds(runs[impl]) if runs.get(impl) else None
        reason = available(impl) or ("failed (error in the JSON)" if merged is None else "")
        label = IMPLS[impl]
        if merged is not None and impl == "deepspeed":
            label = f"DeepSpeed {common.environment()['deepspeed']} stage 0"
        rows.append(common.Row(label, merged, reason, is_peer=impl in PEERS))
    return rows


def main() -> None:
    """Run every requested configuration, print the table, save markdown and JSON."""
    args = parse_args()
    if args.worker:
        worker(args)
        return
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        sys.exit(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    shared = [
        "--model", args.model, "--threads", str(args.threads), "--micro_batch", str(args.micro_batch),
        "--seq_len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps),
        "--seed", str(args.seed),
    ]  # fmt: skip
    errors: dict[str, str] = {}
    runnable = [impl for impl in impls if available(impl) is None]
    runs = common.run_rounds(
        runnable, args.rounds, lambda impl: run_job(args, impl, shared, errors)
    )
    rows = table_rows(impls, runs)

    params = next((r.result["params"] for r in rows if r.result), None)
    title = (
        f"Data parallel, GPT-2 {args.model} ({params:,} parameters), {args.nprocs} CPU processes x "
        f"{args.threads} threads, micro-batch {args.micro_batch} x {args.seq_len} tokens, fp32, "
        f"median of {args.steps} steps after {args.warmup} warm-up"
        + (f", x {args.rounds} interleaved rounds" if args.rounds > 1 else "")
    )
    markdown = common.render_markdown(
        rows, rss_reference=IMPLS["ddp-fused"], title=title, extra_columns=[common.FAULTS_COLUMN]
    )
    print("\n" + markdown)
    gaps = common.loss_gaps(rows, reference=IMPLS["ddp-fused"])
    for name, gap in gaps.items():
        if gap > LOSS_GAP_WARN:
            print(f"WARNING: {name}: losses differ from {IMPLS['ddp-fused']} by up to {gap:.2e}")
    payload = {
        "benchmark": "dp", "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "environment": common.environment(),
        "rows": [{"name": r.name, "note": r.note, "peer": r.is_peer, "result": r.result} for r in rows],
        "max_loss_gap_vs_ddp_fused": gaps, "errors": errors,
    }  # fmt: skip
    md_path, json_path = common.write_results(
        f"dp_{args.model}", markdown, payload, args.results_dir
    )
    print(f"wrote {md_path} and {json_path}")
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
