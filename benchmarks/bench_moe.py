"""Mixture-of-experts benchmark: partita's expert parallelism against DeepSpeed-MoE.

One 4-rank CPU job (gloo) per configuration, the same script for both libraries: DeepSpeed's
MoE tutorial shape grown to a few million parameters (byte embedding, a dense block, a
``deepspeed.moe.layer.MoE`` of MLP experts, a dense block, the output head; loss = token
cross-entropy + 0.01 x l_aux), AdamW, fp32, ZeRO stage 2, the experts split over ``--ep`` ranks.
partita runs the script through ``partita.compat.deepspeed`` (``import partita as deepspeed``);
DeepSpeed 0.19.8 runs it as written (``DS_ACCELERATOR=cpu``).

Reported per configuration: median step time after warm-up (a step's time is its slowest
rank's), peak RSS per rank, and the collective payload each rank hands to
``torch.distributed`` per step (all-to-alls of the dispatch, gradient reductions, parameter
gathers: counted by wrapping its functions before either library is imported, as
``bench_hybrid.py`` does). Example::

    .venv/bin/python benchmarks/bench_moe.py --steps 20 --rounds 2

Writes ``benchmarks/results/moe_<stem>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_moe)
    from benchmarks import common
    from benchmarks.bench_hybrid import BYTES
else:  # python benchmarks/bench_moe.py: this folder is sys.path[0]
    import common
    from bench_hybrid import BYTES


WORLD = 4
IMPLS: dict[str, str] = {
    "partita": "partita (import partita as deepspeed)",
    "deepspeed": "DeepSpeed MoE",
}
PEERS = ("deepspeed",)
REFERENCE = "deepspeed"
VOCAB = 256
AUX = 0.01


def parse_args() -> argparse.Namespace:
    """Orchestrator and worker arguments (the worker is this script under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2, help="top-k")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024, help="expert MLP width")
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--micro_batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--rounds", type=int, default=1, help="jobs per configuration, in turn")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--job_timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--results_dir", type=Path, default=common.RESULTS_DIR, help="where to write")
    p.add_argument("--stem", help="results file stem (default moe_ep<ep>_z<stage>)")
    p.add_argument("--worker", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--result_file", help=argparse.SUPPRESS)
    return p.parse_args()


class MoENet(nn.Module):
    """Embedding, dense block, MoE of MLP experts, dense block, head (DeepSpeed's tutorial
    shape over byte tokens)."""

    def __init__(self, ds: Any, args: argparse.Namespace) -> None:
        super().__init__()
        h = args.hidden
        self.embed = nn.Embedding(VOCAB, h)
        self.pre = nn.Sequential(nn.Linear(h, h), nn.GELU())
        expert = nn.Sequential(nn.Linear(h, args.ffn), nn.GELU(), nn.Linear(args.ffn, h))
        self.moe = ds.moe.layer.MoE(
            hidden_size=h, expert=expert, num_experts=args.experts, ep_size=args.ep, k=args.k
        )
        self.post = nn.Sequential(nn.Linear(h, h), nn.GELU())
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.pre(self.embed(tokens[:, :-1]))
        y, l_aux, _ = self.moe(x)
        logits = self.head(self.post(x + y))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return loss + AUX * l_aux


def _library(impl: str) -> Any:
    """``deepspeed`` itself, or partita standing in for it."""
    if impl == "deepspeed":
        return importlib.import_module("deepspeed")
    return importlib.import_module("partita.compat.deepspeed")


def _setup(args: argparse.Namespace, ds: Any) -> tuple[Any, nn.Module]:
    torch.manual_seed(args.seed)
    model = MoENet(ds, args)
    params = ds.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    config = common.ds_config(args.micro_batch, args.stage)
    engine, _, _, _ = ds.initialize(model=model, model_parameters=params, config=config)
    return engine, model


def worker(args: argparse.Namespace) -> None:
    """One configuration on one rank: build, time, count bytes, (rank 0) write the result."""
    torch.set_num_threads(args.threads)
    BYTES.install()  # before either library binds torch.distributed's functions
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds = _library(args.worker)
    baseline = common.peak_rss_mb()
    try:
        engine, model = _setup(args, ds)
    except Exception as exc:
        if rank == 0:
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            Path(args.result_file).write_text(json.dumps({"error": error}))
        common.exit_worker()
    per_step: list[dict[str, float]] = []

    def step(batch: torch.Tensor) -> torch.Tensor:
        before = BYTES.snapshot()
        BYTES.on = True
        try:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
        finally:
            BYTES.on = False
        after = BYTES.snapshot()
        per_step.append({k: v - before.get(k, 0) for k, v in after.items()})
        return loss

    batches = common.corpus_batches(rank, world, args.micro_batch, args.seq_len + 1)
    times, losses, faults = common.time_steps(step, batches, args.warmup, args.steps)
    last = per_step[-1]
    payload = sum(v for k, v in last.items() if k.startswith("payload/"))
    import torch.distributed as dist

    every: list[Any] = [None] * world
    dist.all_gather_object(every, payload)
    extra = {
        "params": common.count_params(model),
        "payload_per_step_by_rank": every,
        "bytes_by_op_total": dict(BYTES.by_op),
    }
    result = common.collect_result(times, losses, baseline, extra, faults)
    if result is not None:
        Path(args.result_file).write_text(json.dumps(result))
    common.exit_worker()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    keys = ("ep", "experts", "k", "hidden", "ffn", "stage", "threads", "micro_batch", "seq_len",
            "warmup", "steps", "seed")  # fmt: skip
    shared = [x for key in keys for x in (f"--{key}", str(getattr(args, key)))]
    rows = common.run_table(
        Path(__file__).resolve(), impls, IMPLS, PEERS, shared, WORLD, args.threads,
        args.job_timeout, args.rounds,
    )  # fmt: skip
    ref = rows[impls.index(REFERENCE)].name if REFERENCE in impls else rows[0].name
    params = next((r.result["params"] for r in rows if r.result), None)
    title = (
        f"MoE, {args.experts} experts top-{args.k} over ep {args.ep} ({params:,} parameters), "
        f"{WORLD} CPU processes x {args.threads} thread, ZeRO {args.stage}, micro-batch "
        f"{args.micro_batch} x {args.seq_len} tokens, fp32, median of {args.steps} steps after "
        f"{args.warmup} warm-up" + (f", x {args.rounds} rounds" if args.rounds > 1 else "")
    )
    column: common.Column = (
        "MB payload/step per rank (max)",
        lambda r: f"{max(r['payload_per_step_by_rank']) / 1e6:.2f}",
    )
    markdown = common.render_markdown(
        rows, rss_reference=ref, title=title, time_reference=ref, extra_columns=[column]
    )
    print("\n" + markdown)
    payload = {
        "benchmark": "moe",
        "command": " ".join([".venv/bin/python", "benchmarks/bench_moe.py", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": common.environment(),
        "rows": [{"name": r.name, "note": r.note, "peer": r.is_peer, "result": r.result} for r in rows],
    }  # fmt: skip
    stem = args.stem or f"moe_ep{args.ep}_z{args.stage}"
    md_path, json_path = common.write_results(stem, markdown, payload, args.results_dir)
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
