"""ZeRO++ on stage 3 (qwZ, hpZ): bytes per step by group and the loss curve against plain
ZeRO-3, 4 CPU ranks as 2 "nodes" x 2, a small GPT-2 on the shipped text (``data/*.txt``).

    .venv/bin/python benchmarks/bench_zeropp.py --steps 300 --model tiny

Writes ``results/zeropp_<model>.json``, ``.md`` (a table) and ``.png`` (the loss curves). Every
configuration trains the same batches from the same weights; the training gathers' bytes are
read from partita's counters per named group ("" the world, crossing nodes; "hpz" a node's
ranks). Timings are not the point here (2 shared cores); bytes and losses are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_zeropp)
    from benchmarks.common import MODEL_SHAPES, RESULTS_DIR, build_gpt2, corpus_batches, ds_config
else:  # python benchmarks/bench_zeropp.py: this folder is sys.path[0]
    from common import MODEL_SHAPES, RESULTS_DIR, build_gpt2, corpus_batches, ds_config


WORLD = 4
CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ 2": {"zero_hpz_partition_size": 2},
    "qwZ + hpZ 2": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2},
    "qgZ + hpZ 2": {"zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
    "qgZ + feedback + hpZ 2": {
        "zero_quantized_gradients": True,
        "zero_quantized_gradients_error_feedback": True,
        "zero_hpz_partition_size": 2,
    },
    "qgZ int4 + hpZ 2": {
        "zero_quantized_gradients": True,
        "zero_quantized_gradients_bits": 4,
        "zero_hpz_partition_size": 2,
    },
    "qgZ int4 + feedback + hpZ 2": {
        "zero_quantized_gradients": True,
        "zero_quantized_gradients_bits": 4,
        "zero_quantized_gradients_error_feedback": True,
        "zero_hpz_partition_size": 2,
    },
    "qwZ + qgZ + hpZ 2": {
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 2,
    },
}


def train(name: str, zero: dict[str, Any], model: str, steps: int, seq: int) -> dict[str, Any]:
    """One configuration on this rank: per-step loss (mean over ranks), and the last step's
    training-gather and gradient bytes per group (this rank's counters)."""
    import partita
    from partita import comm
    from partita.comm import COUNTERS

    rank = comm.get_rank()
    config = ds_config(2, 3, bf16={"enabled": True})
    config["zero_optimization"].update(
        stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, **zero
    )
    net = build_gpt2(model, seed=0)
    engine, _, _, _ = partita.initialize(
        model=net, model_parameters=net.parameters(), config=config
    )
    batches = corpus_batches(rank, WORLD, 2, seq)
    losses: list[float] = []
    moved: dict[str, dict[str, int]] = {}
    for _ in range(steps):
        before = dict(COUNTERS.total_group_bytes)
        tokens = next(batches)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        comm.all_reduce(mean, tag="bench")
        losses.append(mean.item() / WORLD)
        moved = {"param": {}, "grad": {}}
        for (group, _op, tag), value in COUNTERS.total_group_bytes.items():
            delta = value - before.get((group, _op, tag), 0)
            if tag in moved and delta:
                moved[tag][group or "world"] = moved[tag].get(group or "world", 0) + delta
    engine.destroy()
    return {
        "name": name,
        "losses": losses,
        "param_bytes": moved["param"],
        "grad_bytes": moved["grad"],
    }


def grid(name: str, **kwargs: Any) -> dict[str, Any]:
    """The grid entry run on every rank."""
    return train(name, CONFIGS[name], **kwargs)


def table(results: list[dict[str, Any]], steps: int) -> str:
    """A markdown table: gather bytes per step by group, final loss, and the gap to zero3."""
    base = results[0]
    tail = max(1, steps // 10)
    ref = sum(base["losses"][-tail:]) / tail
    rows = [
        "| config | gather, world | gather, node ('hpz') | gradient, world | gradient, node | "
        f"gradient, across nodes ('hpz_lane') | mean loss, last {tail} steps | vs zero3 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        last = sum(r["losses"][-tail:]) / tail
        p, g = r["param_bytes"], r["grad_bytes"]
        cells = [p.get("world", 0), p.get("hpz", 0), g.get("world", 0), g.get("hpz", 0)]
        cells.append(g.get("hpz_lane", 0))
        moved = " | ".join(f"{c:,}" for c in cells)
        rows.append(f"| {r['name']} | {moved} | {last:.4f} | {100 * (last - ref) / ref:+.2f}% |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """The loss curves, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(r["losses"], label=r["name"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over 4 ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Runs every configuration in one 4-rank spawn and writes the results."""
    from partita.testing import run_distributed_grid

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="tiny")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [
        {"name": n, "model": args.model, "steps": args.steps, "seq": args.seq} for n in CONFIGS
    ]
    per_case = run_distributed_grid(grid, WORLD, cases, timeout=3600)
    results = [ranks[0] for ranks in per_case]
    stem = args.out / f"zeropp_{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    text = (
        f"# ZeRO++ on stage 3: {args.model} GPT-2, bf16, {WORLD} CPU ranks as 2 x 2, "
        f"{args.steps} steps, micro-batch 2 x {args.seq} tokens\n\n"
        f"Command: `.venv/bin/python benchmarks/bench_zeropp.py --steps {args.steps} "
        f"--model {args.model} --seq {args.seq}`\n\nBytes each rank sends or gathers in one "
        f"step (partita's counters, by group).\n\n{table(results, args.steps)}\n"
    )
    stem.with_suffix(".md").write_text(text)
    plot(results, stem.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
