"""Paired step-time ratios of this tree's partita against another revision's.

A refactor that must not slow training is checked here: each configuration of ``bench_zero.py``
(and so of the data-parallel, ZeRO 1-2, ZeRO 3 and offload tables) runs as a ``torchrun`` job
with this tree's ``src/`` and then with the ``src/`` of ``--base`` (a temporary git worktree),
pair after pair, in alternating order (base first in odd rounds), so drift of the machine hits
both sides alike. Only partita's source differs: both jobs run this tree's ``bench_zero.py``
worker on the same model, data and config. Each pair gives a ratio (this tree / base of the
median step); the table reports every pair's ratio and their median. Example::

    .venv/bin/python benchmarks/bench_revision.py --base 9992f41 --rounds 3

Writes ``benchmarks/results/revision_<model>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_revision)
    from benchmarks import common
else:  # python benchmarks/bench_revision.py: this folder is sys.path[0]
    import common


BENCH_ZERO = Path(__file__).resolve().parent / "bench_zero.py"
DEFAULT_IMPLS = "partita-0,partita-1,partita-2,partita-3,partita-3+cpu,partita-3+nvme"


def parse_args() -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare with (e.g. a hash)")
    p.add_argument("--impls", default=DEFAULT_IMPLS, help="bench_zero configurations")
    p.add_argument("--model", choices=sorted(common.MODEL_SHAPES), default="23m")
    p.add_argument("--nprocs", type=int, default=2, help="processes per job")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps per job")
    p.add_argument("--rounds", type=int, default=3, help="pairs per configuration")
    p.add_argument("--nvme_dir", default=tempfile.gettempdir(), help="nvme_path of NVMe rows")
    p.add_argument("--job_timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--results_dir", type=Path, default=common.RESULTS_DIR, help="where to write")
    return p.parse_args()


def worker_args(args: argparse.Namespace, impl: str, threads: int) -> list[str]:
    """bench_zero's worker arguments for one job (its defaults for everything not set here)."""
    return [
        "--worker", impl, "--model", args.model, "--threads", str(threads),
        "--warmup", str(args.warmup), "--steps", str(args.steps), "--nvme_dir", args.nvme_dir,
    ]  # fmt: skip


def run_with_source(args: argparse.Namespace, impl: str, src: Path, threads: int) -> dict[str, Any]:
    """One job of `impl` importing partita from `src` (first on the workers' PYTHONPATH)."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(src) + ("" if previous is None else os.pathsep + previous)
    try:
        return common.launch_job(
            BENCH_ZERO, worker_args(args, impl, threads), args.nprocs, threads, args.job_timeout
        )
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous


def base_worktree(revision: str, where: Path) -> Path:
    """A detached worktree of `revision` under `where`; returns its ``src`` folder."""
    tree = where / "base"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), revision],
        cwd=common.ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return tree / "src"


def measure(args: argparse.Namespace, base_src: Path) -> dict[str, dict[str, Any]]:
    """Every configuration's pairs of median step times, alternating which side runs first."""
    head_src = Path(common.ROOT) / "src"
    threads = max(1, (os.cpu_count() or 1) // args.nprocs)
    out: dict[str, dict[str, Any]] = {}
    for impl in args.impls.split(","):
        pairs, losses_equal = [], True
        for round_ in range(args.rounds):
            order = [("base", base_src), ("head", head_src)]
            if round_ % 2:
                order.reverse()
            got = {side: run_with_source(args, impl, src, threads) for side, src in order}
            pairs.append((got["head"]["median_step_s"], got["base"]["median_step_s"]))
            losses_equal &= got["head"]["losses"] == got["base"]["losses"]
            print(f"{impl} round {round_ + 1}: head {pairs[-1][0] * 1e3:.1f} ms, "
                  f"base {pairs[-1][1] * 1e3:.1f} ms", flush=True)  # fmt: skip
        ratios = [h / b for h, b in pairs]
        out[impl] = {
            "pairs_s": pairs,
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "losses_equal": losses_equal,
        }
    return out


def render(args: argparse.Namespace, base: str, rows: dict[str, dict[str, Any]]) -> str:
    """The results as a Markdown table with the command that made them."""
    lines = [
        f"# partita at this tree vs {base}: paired step times ({args.model}, "
        f"{args.nprocs} CPU processes, {args.rounds} pairs, {args.steps} timed steps per job)",
        "",
        "| configuration | median ratio (this / base) | each pair | losses identical |",
        "|---|---|---|---|",
    ]
    for impl, r in rows.items():
        each = ", ".join(f"{x:.3f}" for x in r["ratios"])
        lines.append(
            f"| {impl} | {r['median_ratio']:.3f} | {each} | {'yes' if r['losses_equal'] else 'NO'} |"
        )
    command = " ".join(["benchmarks/bench_revision.py", *sys.argv[1:]])
    lines += ["", f"Command: `.venv/bin/python {command}`", ""]
    return "\n".join(lines)


def main() -> None:
    """Runs the pairs and writes the results."""
    args = parse_args()
    base = subprocess.run(
        ["git", "rev-parse", "--short", args.base],
        cwd=common.ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows = measure(args, base_worktree(args.base, Path(tmp)))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(Path(tmp) / "base")],
                cwd=common.ROOT, capture_output=True,
            )  # fmt: skip
    text = render(args, base, rows)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / f"revision_{args.model}"
    stem.with_suffix(".md").write_text(text)
    payload = {"base": base, "environment": common.environment(), "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    print(text)


if __name__ == "__main__":
    main()
