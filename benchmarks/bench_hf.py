"""Hugging Face Trainer benchmark: partita standing in for DeepSpeed against DeepSpeed itself.

The same Trainer script (``hf_bench_worker.py``: ``TrainingArguments(deepspeed=...)`` with
Hugging Face's all-``"auto"`` ZeRO config) trains the same GPT-2 (``common.MODEL_SHAPES``, random
weights saved once with ``save_pretrained``, nothing downloaded) on the same random tokens, fp32,
on ``--nprocs`` CPU processes (gloo), launched two ways:

* partita: ``python -m partita.launcher.cli --num_procs N worker.py ...``, which sets
  ``PARTITA_AS_DEEPSPEED=1`` so that the Trainer's ``import deepspeed`` is partita;
* DeepSpeed: ``DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone
  --nproc_per_node N worker.py ...`` (the installed DeepSpeed).

Jobs are interleaved (partita stage 2, DeepSpeed stage 2, partita stage 3, DeepSpeed stage 3,
then again for each of ``--rounds``) so that drift of a shared machine hits both alike. The
worker times each optimizer step with a ``TrainerCallback`` (``on_step_begin`` to
``on_step_end``); a step's time is its slowest rank's, the first ``--warmup`` steps of each job
are left out, and the headline is the median over every timed step of every round. Peak RSS is
each rank's ``ru_maxrss`` at the end of training, the highest over rounds. Examples::

    .venv/bin/python benchmarks/bench_hf.py                # 23m GPT-2, ~5 minutes on 2 cores
    .venv/bin/python benchmarks/bench_hf.py --quick        # tiny model smoke run, ~1 minute

Prints a markdown table and writes it to ``--out`` (and the raw figures next to it, ``.json``).
The goals (step time <= 1.0x DeepSpeed's, peak RSS below DeepSpeed's) are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_hf)
    from benchmarks import common
else:  # python benchmarks/bench_hf.py: this folder is sys.path[0]
    import common

HERE = Path(__file__).resolve().parent

WORKER = HERE / "hf_bench_worker.py"
IMPLS = ("partita", "deepspeed")
# The module a run's ``import deepspeed`` must have resolved to, or the row measured the wrong
# thing (for example PARTITA_AS_DEEPSPEED leaking into the DeepSpeed job).
EXPECTED_MODULE = {"partita": "partita.compat.deepspeed", "deepspeed": "deepspeed"}
QUICK = {"model": "tiny", "seq": 32, "steps": 3, "warmup": 1, "rounds": 1}


def parse_args() -> argparse.Namespace:
    """The benchmark's command line; ``--quick`` overrides the sizes with `QUICK`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(common.MODEL_SHAPES), default="23m")
    p.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages (default 2,3)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the model shape's)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sample")
    p.add_argument("--micro_batch", type=int, default=2, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per job, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps of each job")
    p.add_argument("--rounds", type=int, default=2, help="interleaved jobs per configuration")
    p.add_argument("--nprocs", type=int, default=2, help="ranks (CPU processes) per job")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    p.add_argument(
        "--optimizer",
        choices=("trainer", "config"),
        default="trainer",
        help="trainer: the Trainer's torch AdamW handed to the engine (the same optimizer code "
        "in both); config: an AdamW block in the ZeRO config (each implementation's own)",
    )
    p.add_argument("--impls", default="partita,deepspeed", help="which implementations to run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job (hang guard)")
    p.add_argument("--out", type=Path, help="markdown file (default results/hf_trainer_<model>.md)")
    p.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    a = p.parse_args()
    if a.quick:
        for key, value in QUICK.items():
            setattr(a, key, value)
    if a.out is None:
        folder = Path(tempfile.gettempdir()) if a.quick else common.RESULTS_DIR
        a.out = folder / f"hf_trainer_{a.model}.md"
    a.stages = [int(s) for s in a.stages.split(",")]
    a.impls = [i for i in a.impls.split(",") if i]
    unknown = sorted(set(a.impls) - set(IMPLS))
    if unknown:
        p.error(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    if not 0 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup} must leave timed steps out of --steps {a.steps}")
    return a


def make_initial(model: str, vocab: int | None, folder: Path) -> int:
    """Save the starting weights every job loads (shape `model`, its vocabulary replaced by
    `vocab` when given); returns the parameter count."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shape = {**common.MODEL_SHAPES[model], **({"vocab_size": vocab} if vocab else {})}
    net = GPT2LMHeadModel(GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    net.save_pretrained(folder)
    return common.count_params(net)


def job_command(impl: str, nprocs: int, worker_args: list[str]) -> list[str]:
    """The launch command of one job."""
    if impl == "partita":
        launcher = ["-m", "partita.launcher.cli", "--num_procs", str(nprocs)]
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
    return [sys.executable, *launcher, str(WORKER), *worker_args]


def job_env(impl: str, threads: int) -> dict[str, str]:
    """Environment of one job: same threads for both, CPU only, and PARTITA_AS_DEEPSPEED set
    only by partita's launcher (a value inherited from the caller would turn DeepSpeed's job into
    partita)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PARTITA_AS_DEEPSPEED", None)
    if impl == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed assumes CUDA unless told
    return env


def run_job(a: argparse.Namespace, key: str, init: Path, out: Path) -> dict[str, Any] | None:
    """Launch one job (``key`` is ``<impl>-<stage>``) and merge its ranks' files; None (after
    printing why) when it failed."""
    impl, stage = key.rsplit("-", 1)
    out.mkdir(parents=True)
    worker_args = [
        "--init", str(init), "--out", str(out), "--stage", stage, "--seq", str(a.seq),
        "--micro_batch", str(a.micro_batch), "--steps", str(a.steps),
        "--warmup", str(a.warmup), "--optimizer", a.optimizer,
    ]  # fmt: skip
    cmd = job_command(impl, a.nprocs, worker_args)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=job_env(impl, a.threads), cwd=common.ROOT, capture_output=True, text=True,
            timeout=a.timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr or ""
        tail = (err if isinstance(err, str) else err.decode(errors="replace"))[-6000:]
        print(f"{key}: timed out after {a.timeout:.0f} s: {shlex.join(cmd)}\n{tail}")
        return None
    wall = time.perf_counter() - start
    files = [out / f"rank{r}.json" for r in range(a.nprocs)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        tail = (proc.stdout + proc.stderr)[-6000:]
        print(f"{key}: {shlex.join(cmd)} exited {proc.returncode}:\n{tail}")
        return None
    ranks = [json.loads(f.read_text()) for f in files]
    got = ranks[0]["deepspeed_module"]
    if got != EXPECTED_MODULE[impl]:
        print(f"{key}: 'import deepspeed' gave {got!r}, expected {EXPECTED_MODULE[impl]!r}")
        return None
    return job_result(ranks, a.warmup, wall)


def job_result(ranks: list[dict[str, Any]], warmup: int, wall_s: float) -> dict[str, Any]:
    """One job's figures from its ranks' files: per timed step the slowest rank's time."""

    def slowest(name: str) -> list[float]:
        return [max(r[name][i] for r in ranks) for i in range(warmup, len(ranks[0][name]))]

    steps = slowest("step_s")
    return {
        "step_times_s": steps,
        "median_step_s": statistics.median(steps),
        "to_pre_optimizer_s": slowest("to_pre_optimizer_s"),
        "peak_rss_mb": [r["peak_rss_mb"]["end"] for r in ranks],
        "peak_rss_stages_mb": [r["peak_rss_mb"] for r in ranks],
        "rss_end_mb": [r["rss_end_mb"] for r in ranks],
        "rss_at_callbacks_mb": [r["rss_at_callbacks_mb"] for r in ranks],
        "memory_report": [r["memory_report"] for r in ranks],
        "losses": ranks[0]["losses"],
        "engine": ranks[0]["engine"],
        "optimizer": ranks[0]["optimizer"],
        "deepspeed_module": ranks[0]["deepspeed_module"],
        "wall_s": wall_s,
    }


def merge(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's rounds: `common.merge_rounds` plus the largest peak RSS per rank at
    each measuring point, the median time to ``optimizer.step()``, the launch wall times and the
    highest RSS at the end of a step."""
    merged = common.merge_rounds(jobs)
    stages = [
        [j["peak_rss_stages_mb"][r] for j in jobs] for r in range(len(jobs[0]["peak_rss_mb"]))
    ]
    merged["peak_rss_stages_mb"] = [
        {point: max(s[point] for s in per_rank if point in s) for point in per_rank[0]}
        for per_rank in stages
    ]
    merged["median_to_pre_optimizer_s"] = statistics.median(
        t for j in jobs for t in j["to_pre_optimizer_s"]
    )
    merged["wall_s"] = [j["wall_s"] for j in jobs]
    merged["rss_between_steps_mb"] = max(
        max(r["end"]) for j in jobs for r in j["rss_at_callbacks_mb"]
    )
    return merged


def versions() -> dict[str, Any]:
    """Versions and host facts printed above the table."""
    info = common.environment()
    for package in ("transformers", "accelerate", "partita"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    return info


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``0.93x``."""
    return f"{a / b:.2f}x"


def table_rows(a: argparse.Namespace, results: dict[str, dict[str, Any]]) -> list[str]:
    """The table's header and one line per implementation and stage."""
    lines = [
        "| implementation | ZeRO | median step (ms) | round medians (ms) | step vs DeepSpeed "
        "| fwd+bwd+engine step (ms) | peak RSS per rank (MB) | peak RSS vs DeepSpeed "
        "| peak RSS after imports / at train begin (MB) | launch wall (s) | final loss "
        "| optimizer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for stage in a.stages:
        ds = results.get(f"deepspeed-{stage}")
        for impl in a.impls:
            res = results.get(f"{impl}-{stage}")
            if res is None:
                lines.append(f"| {impl} | {stage} | failed |" + " |" * 9)
                continue
            peak = max(res["peak_rss_mb"])
            points = res["peak_rss_stages_mb"]
            before = [max(p.get(k, 0.0) for p in points) for k in ("imports", "train_begin")]
            cells = [
                impl,
                str(stage),
                f"{res['median_step_s'] * 1e3:.1f}",
                " / ".join(f"{m * 1e3:.0f}" for m in res["round_medians_s"]),
                ratio(res["median_step_s"], ds["median_step_s"]) if ds else "-",
                f"{res['median_to_pre_optimizer_s'] * 1e3:.1f}",
                " / ".join(f"{m:.0f}" for m in res["peak_rss_mb"]),
                ratio(peak, max(ds["peak_rss_mb"])) if ds else "-",
                " / ".join(f"{m:.0f}" for m in before),
                " / ".join(f"{w:.0f}" for w in res["wall_s"]),
                f"{res['losses'][-1]:.4f}",
                res["optimizer"],
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_lines(a: argparse.Namespace, results: dict[str, dict[str, Any]]) -> list[str]:
    """Where the memory goes: partita's own accounting of what it holds (rank 0, first round)
    and each row's highest RSS at the end of a step (any rank and round) (partita's host cache keeps freed blocks mapped, so its
    RSS between steps stays near its peak; glibc returns large blocks at once)."""
    lines = []
    for stage in a.stages:
        for impl in a.impls:
            res = results.get(f"{impl}-{stage}")
            if res is None:
                continue
            between = res["rss_between_steps_mb"]
            text = f"- {impl} ZeRO-{stage}: RSS between steps up to {between:.0f} MB"
            report = res["memory_report"][0]
            if report:
                keys = ("params", "grads", "master_params", "optimizer_state", "comm_buffers")
                held = ", ".join(f"{k} {report.get(k, 0) / 2**20:.0f}" for k in keys)
                text += f"; partita's memory_report (MB, rank 0): {held}"
            lines.append(text)
    return ["Memory between steps:", "", *lines, ""] if lines else []


def goal_lines(a: argparse.Namespace, results: dict[str, dict[str, Any]]) -> list[str]:
    """The goals (reported, not asserted) and how far partita's losses are from DeepSpeed's."""
    lines = ["Goals (step time: median over timed steps; peak RSS: largest rank):", ""]
    for stage in a.stages:
        ours, theirs = results.get(f"partita-{stage}"), results.get(f"deepspeed-{stage}")
        if ours is None or theirs is None:
            lines.append(f"- ZeRO-{stage}: not compared (a configuration did not run)")
            continue
        t = ours["median_step_s"] / theirs["median_step_s"]
        m = max(ours["peak_rss_mb"]) / max(theirs["peak_rss_mb"])
        gap = max(
            abs(x - y) / abs(y) for x, y in zip(ours["losses"], theirs["losses"], strict=True)
        )
        lines += [
            f"- ZeRO-{stage} partita step time / DeepSpeed: {t:.3f}x (goal <= 1.0x): "
            + ("met" if t <= 1.0 else "NOT met"),
            f"- ZeRO-{stage} partita peak RSS / DeepSpeed: {m:.3f}x (goal < 1.0x): "
            + ("met" if m < 1.0 else "NOT met"),
            f"- ZeRO-{stage} largest per-step loss difference, relative: {gap:.1e}",
        ]
    return lines


def render(
    a: argparse.Namespace, params: int, results: dict[str, dict[str, Any]], env: dict[str, Any]
) -> str:
    """The markdown report: title, command, versions, table, goals."""
    timed = a.steps - a.warmup
    vocab = f" with a {a.vocab}-token vocabulary" if a.vocab else ""
    title = (
        f"### Hugging Face Trainer, GPT-2 {a.model}{vocab} ({params:,} parameters), {a.nprocs} CPU "
        f"processes x {a.threads} threads, micro-batch {a.micro_batch} x {a.seq} tokens per "
        f"rank, fp32, median of {timed} steps after {a.warmup} warm-up, x {a.rounds} "
        "interleaved rounds"
    )
    lines = [
        title,
        "",
        f"Command: `{shlex.join([sys.executable, *sys.argv])}`",
        "",
        f"torch {env['torch']}, transformers {env['transformers']}, accelerate "
        f"{env['accelerate']}, deepspeed {env['deepspeed']}, partita {env['partita']}, "
        f"Python {env['python']}, {env['cpu_count']} CPUs ({env['cpu']}); optimizer: "
        + ("the Trainer's torch AdamW" if a.optimizer == "trainer" else "AdamW config block"),
        "",
        *table_rows(a, results),
        "",
        "Step: on_step_begin to on_step_end of a TrainerCallback, slowest rank. fwd+bwd+engine "
        "step: on_step_begin to on_pre_optimizer_step (Accelerate runs the engine's backward and "
        "step in accelerator.backward). Peak RSS: ru_maxrss at the end of the worker, highest "
        "over rounds.",
        "",
        *memory_lines(a, results),
        *goal_lines(a, results),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run every job, interleaved, then print and write the report."""
    a = parse_args()
    keys = [f"{impl}-{stage}" for stage in a.stages for impl in a.impls]
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        init = Path(tmp) / "init"
        params = make_initial(a.model, a.vocab, init)
        counter = iter(range(10**6))

        def run_one(key: str) -> dict[str, Any] | None:
            result = run_job(a, key, init, Path(tmp) / f"{key}-{next(counter)}")
            if result is not None:
                print(
                    f"{key}: median step {result['median_step_s'] * 1e3:.1f} ms, peak RSS "
                    f"{max(result['peak_rss_mb']):.0f} MB, launch {result['wall_s']:.0f} s",
                    flush=True,
                )
            return result

        runs = common.run_rounds(keys, a.rounds, run_one)
    results = {key: merge(jobs) for key, jobs in runs.items() if jobs}
    env = versions()
    markdown = render(a, params, results, env)
    print(markdown)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(markdown)
    payload = {"args": {k: str(v) for k, v in vars(a).items()}, "env": env, "results": results}
    a.out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if len(results) == len(keys) else 1


if __name__ == "__main__":
    sys.exit(main())
