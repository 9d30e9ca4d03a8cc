"""Two source trees against each other on the planner benchmark's worker: GPT-2 10m, 2 CPU ranks,
fp32, ZeRO stages 1-3 without offload, interleaved (each round alternates which tree runs first)
so that the machine's drift hits both alike; prints each run's median step (the slower rank's)
and peak RSS over baseline (the larger rank's), then per tree and stage the runs and median.

    .venv/bin/python benchmarks/ab_trees.py OLD_TREE NEW_TREE [--rounds 3] [--steps 8]

Each tree is a checkout or ``git archive`` of the repository (its ``src`` is put first on
``PYTHONPATH``; its ``benchmarks/bench_estimate.py`` is the worker). Minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_RUN = r"""
import json, statistics, sys
sys.path.insert(0, "benchmarks")
import bench_estimate
from partita.testing import run_distributed
stage, steps = int(sys.argv[1]), int(sys.argv[2])
reps = run_distributed(bench_estimate.worker, 2, "10m", stage, "none", "none", "", False, steps,
                       timeout=600)
times = [max(ts) for ts in zip(*(r["step_times"] for r in reps))]
print("RESULT", json.dumps([statistics.median(times), max(r["peak_over_base"] for r in reps)]))
"""


def _one(tree: str, stage: int, steps: int) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "src"))
    out = subprocess.run(
        [sys.executable, "-c", _RUN, str(stage), str(steps)],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{tree} stage {stage} failed:\n{out.stderr[-3000:]}")
    step, peak = json.loads(lines[0][len("RESULT ") :])
    return float(step), int(peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    trees = [("old", args.old), ("new", args.new)]
    runs: dict[tuple[int, str], list[tuple[float, int]]] = {}
    for rnd in range(args.rounds):
        for stage in (1, 2, 3):
            order = trees if (rnd + stage) % 2 == 0 else trees[::-1]
            for name, tree in order:
                step, peak = _one(tree, stage, args.steps)
                runs.setdefault((stage, name), []).append((step, peak))
                print(f"round {rnd + 1} z{stage} {name}: {step:.3f} s, {peak / 2**20:.1f} MiB")
    for (stage, name), rs in sorted(runs.items()):
        steps = ", ".join(f"{s:.3f}" for s, _ in rs)
        peaks = ", ".join(f"{p / 2**20:.1f}" for _, p in rs)
        med = statistics.median(s for s, _ in rs)
        print(f"z{stage} {name}: steps {steps} (median {med:.3f} s); peaks {peaks} MiB")


if __name__ == "__main__":
    main()
