"""Does a configuration's peak memory grow with the machine's load? The planner's headroom.

`partita.estimate.plan.HEADROOM` keeps a fraction of each memory free for what the estimate
misses; it was set from runs in which peaks under load 6-9 exceeded their predictions (an
older estimator). This measures the planner candidates' peaks (GPT-2 ``--models``, 2 CPU ranks,
fp32, stages 0-3 x optimizer/parameter offload x activation checkpointing, 3 steps, each run
in a fresh pair of processes, as ``bench_estimate.py --plan_cap`` does) once per load level:
with ``K`` processes spinning on the CPU beside the ranks for each level K of ``--loads``, and
prints each peak against today's prediction.

    .venv/bin/python benchmarks/peaks_under_load.py [--models 10m] [--loads 0,6]
        [--repeats 2] [--json FILE.json]

The headroom needed to admit no configuration that exceeds its cap is the largest
``1 - predicted / measured`` seen (0 when every prediction is at or above its peak).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_SPIN = "while True: pass"


def _spinners(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` processes that keep a core busy each until killed."""
    return [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(count)]


def predicted_peaks(name: str) -> dict[str, int]:
    """Today's estimate of each planner candidate's peak (device + host bytes per rank)."""
    import torch

    import bench_estimate
    from partita.estimate import Hardware, estimate
    from partita.estimate.model import from_hf_config

    cfg = bench_estimate._config(name)
    shape = from_hf_config(cfg, bench_estimate.MICRO_BATCH, bench_estimate.SEQ, torch.float32)
    hw = Hardware(2, host_memory=1 << 40, accelerator="cpu")
    out = {}
    for cand in bench_estimate._plan_candidates():
        est = estimate(shape, cand, hw)
        out[cand.label] = est.total("device") + est.total("host")
    return out


def measure(name: str, load: int, repeats: int) -> dict[str, Any]:
    """Every candidate's peaks (bytes, one per run) with `load` spinners running."""
    import bench_estimate

    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    spinners = _spinners(load)
    try:
        time.sleep(2.0 if load else 0.0)  # let the spinners take their cores
        before = os.getloadavg()
        cands = bench_estimate._plan_candidates()
        meas = bench_estimate._measure(name, cands, repeats, bench_estimate.STEPS, env)
        after = os.getloadavg()
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    return {"load": load, "loadavg": [before, after],
            "peaks": {label: m["peak"] for label, m in meas.items()}}  # fmt: skip


def table(name: str, predicted: dict[str, int], levels: list[dict[str, Any]]) -> str:
    """Markdown: per candidate the prediction and, per load level, the largest peak and how
    far the prediction is above it."""
    head = f"| {name} config | predicted MiB |"
    head += "".join(f" {lv['load']} spinning: peak MiB | above |" for lv in levels)
    rows = [head, "|" + " --- |" * (2 + 2 * len(levels))]
    for label, pred in predicted.items():
        row = f"| {label} | {pred / 2**20:.1f} |"
        for lv in levels:
            peak = max(lv["peaks"][label])
            row += f" {peak / 2**20:.1f} | {pred / peak - 1:+.1%} |"
        rows.append(row)
    worst = max(
        1 - predicted[label] / max(peaks) for lv in levels for label, peaks in lv["peaks"].items()
    )
    rows.append(f"\nheadroom needed (largest 1 - predicted/measured): {max(0.0, worst):.1%}")
    return "\n".join(rows)


def main() -> None:
    """Measures each load level in turn and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="10m")
    parser.add_argument("--loads", default="0,6", help="spinning processes per level")
    parser.add_argument("--repeats", type=int, default=2, help="runs per candidate and level")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = []
    for name in args.models.split(","):
        predicted = predicted_peaks(name)
        levels = [measure(name, int(k), args.repeats) for k in args.loads.split(",")]
        print("\n" + table(name, predicted, levels) + "\n", flush=True)
        results.append({"model": name, "predicted": predicted, "levels": levels})
    if args.json:
        meta = {"command": " ".join(sys.argv), "started": started,
                "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "cpus": os.cpu_count()}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
