"""Shared pieces of the training benchmarks: model, data, timing, memory, launching, tables.

A benchmark script is two halves. Its *orchestrator* launches one ``torchrun`` job per
configuration with `launch_job` (so every configuration's peak RSS is its own processes'), and
its *worker* (the same script, re-entered with ``--worker``) builds the model with
`build_gpt2`, times steps with `time_steps` on `corpus_batches`, and returns `collect_result`.
`render_markdown` and `write_results` print and save the side-by-side table.

Everything here runs on CPU with gloo: the orchestrator hides GPUs from its jobs so that all
configurations are compared on the same device.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data"
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# GPT-2 shapes by name. "23m" is GPT-2 small's depth at a third of its width (12 layers of 256,
# 4 heads of 64) with GPT-2's vocabulary and context: 22,605,568 parameters (tied embeddings),
# big enough that the optimizer and gradient all-reduce matter, small enough for 2 CPU cores.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "23m": {"n_layer": 12, "n_embd": 256, "n_head": 4, "n_positions": 1024, "vocab_size": 50257},
    "124m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
    # For smoke tests of the benchmark scripts themselves: seconds, not minutes.
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128, "vocab_size": 256},
}

# Hyper-parameters every configuration shares (torch.optim.AdamW's defaults, explicit).
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0


def build_gpt2(name: str, seed: int) -> torch.nn.Module:
    """A Hugging Face GPT-2 of shape ``MODEL_SHAPES[name]`` with seeded random weights, no
    dropout (so every configuration computes the same function)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(**MODEL_SHAPES[name], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def ds_config(micro_batch: int, stage: int, **extra: Any) -> dict[str, Any]:
    """The DeepSpeed-style config shared by partita and DeepSpeed runs: fp32, AdamW with the
    shared hyper-parameters, no scheduler, gradient clipping, ZeRO ``stage``."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,  # keep engine logging out of the timed steps
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {"stage": stage},
    }
    config.update(extra)
    return config


def corpus_batches(rank: int, world: int, micro_batch: int, seq_len: int) -> Iterator[torch.Tensor]:
    """Endless ``(micro_batch, seq_len)`` token batches from the bytes of ``data/*.txt``.

    Step ``i`` on rank ``r`` reads windows ``(i * world + r) * micro_batch ...``, so every
    configuration sees the same data and the ranks of one step never overlap."""
    raw = b"\n\n".join(p.read_bytes() for p in sorted(DATA_DIR.glob("*.txt")))
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)
    step = 0
    while True:
        first = ((step * world + rank) * micro_batch) % (len(windows) - micro_batch)
        yield windows[first : first + micro_batch]
        step += 1


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def exit_worker() -> NoReturn:
    """End a worker process at once, after every rank is done and output is flushed.

    Interpreter teardown is skipped on purpose: there, process-group destructors race with
    library threads (torch 2.13 can deadlock joining gloo's run loop while it waits for the GIL;
    DeepSpeed's CPU comm op can abort), and a benchmark has nothing left to clean up."""
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def time_steps(
    step: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterator[torch.Tensor],
    warmup: int,
    steps: int,
) -> tuple[list[float], list[float], list[int]]:
    """Run ``warmup`` untimed then ``steps`` timed training steps.

    Each timed step starts at a barrier, so a step's time on a rank includes waiting for the
    slowest rank's gradients. Returns (seconds per timed step, loss of every step, minor page
    faults of this process in each timed step)."""
    times: list[float] = []
    losses: list[float] = []
    faults: list[int] = []
    for i in range(warmup + steps):
        batch = next(batches)
        barrier()
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        loss = step(batch)
        elapsed = time.perf_counter() - start
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
        losses.append(float(loss.detach()))
        if i >= warmup:
            times.append(elapsed)
            faults.append(faulted)
    return times, losses, faults


def collect_result(
    times: list[float],
    losses: list[float],
    baseline_rss_mb: float,
    extra: dict[str, Any],
    faults: list[int] | None = None,
) -> dict[str, Any] | None:
    """Gather every rank's timings and memory; rank 0 gets the job's result, others None.

    The step time of a step is the slowest rank's; the median over steps is the headline."""
    mine = {
        "times": times,
        "peak_rss_mb": peak_rss_mb(),
        "baseline_rss_mb": baseline_rss_mb,
        "faults": statistics.median(faults) if faults else None,
    }
    ranks: list[Any] = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() != 0:
            return None
    step_times = [max(r["times"][i] for r in ranks) for i in range(len(times))]
    return {
        "median_step_s": statistics.median(step_times),
        "step_times_s": step_times,
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "baseline_rss_mb": [r["baseline_rss_mb"] for r in ranks],
        "page_faults_per_step": [r["faults"] for r in ranks],
        "losses": losses,
        **extra,
    }


def launch_job(
    script: Path, worker_args: Sequence[str], nprocs: int, threads: int, timeout_s: float
) -> dict[str, Any]:
    """Run ``script --result_file F *worker_args`` under torchrun with ``nprocs`` processes and
    return the JSON its rank 0 wrote to F; raises RuntimeError with the job's output tail."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nprocs}", str(script), "--result_file", str(result_file),
            *worker_args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "CUDA_VISIBLE_DEVICES": "",  # every configuration on CPU
            "DS_ACCELERATOR": "cpu",  # DeepSpeed assumes CUDA unless told
        }
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0 or not result_file.exists():
            tail = (proc.stdout + proc.stderr)[-12000:]
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
        return json.loads(result_file.read_text())


def launch_row(
    script: Path,
    label: str,
    worker_args: Sequence[str],
    nprocs: int,
    threads: int,
    timeout_s: float,
) -> tuple[dict[str, Any] | None, str]:
    """`launch_job` for one table row, printing progress: ``(result, "")``, or ``(None, why)``
    when the job failed or the library refused the configuration (a worker that writes
    ``{"error": ...}``)."""
    print(f"running {label} ...", flush=True)
    try:
        result = launch_job(script, worker_args, nprocs, threads, timeout_s)
    except Exception as exc:
        print(f"  FAILED:\n{exc}", file=sys.stderr, flush=True)
        return None, f"failed: {str(exc)[-300:]}"
    if "error" in result:
        print(f"  refused: {result['error']}", flush=True)
        return None, f"refused or failed at set-up: {result['error']}"
    print(f"  median step {result['median_step_s'] * 1e3:.1f} ms, peak RSS "
          f"{[round(m) for m in result['peak_rss_mb']]} MB", flush=True)  # fmt: skip
    return result, ""


def run_table(
    script: Path,
    impls: Sequence[str],
    labels: Mapping[str, str],
    peers: Sequence[str],
    worker_args: Sequence[str],
    nprocs: int,
    threads: int,
    timeout_s: float,
    rounds: int = 1,
) -> list[Row]:
    """Every configuration of `impls` as a table row: its jobs (``script --worker IMPL
    *worker_args``, `rounds` interleaved rounds, merged) or why it has none. A label naming
    DeepSpeed gets its installed version."""
    notes: dict[str, str] = {}

    def run_one(impl: str) -> dict[str, Any] | None:
        result, notes[impl] = launch_row(
            script, labels[impl], ["--worker", impl, *worker_args], nprocs, threads, timeout_s
        )
        return result

    runs = run_rounds(impls, rounds, run_one)
    rows = []
    for impl in impls:
        label = labels[impl].replace("DeepSpeed", f"DeepSpeed {environment()['deepspeed']}", 1)
        merged = merge_rounds(runs[impl]) if runs[impl] else None
        rows.append(Row(label, merged, notes.get(impl, ""), is_peer=impl in peers))
    return rows


def run_rounds(
    impls: Sequence[str], rounds: int, run_one: Callable[[str], dict[str, Any] | None]
) -> dict[str, list[dict[str, Any]]]:
    """Each configuration's ``rounds`` jobs, interleaved (A B C A B C ...) so that drift of the
    machine hits every configuration alike; ``run_one`` runs one job and returns its result, or
    None when it failed, after which that configuration is not run again. Returns the results
    of each configuration's jobs (empty when its first job failed); merge them with
    `merge_rounds`."""
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
    failed: set[str] = set()
    for _ in range(rounds):
        for impl in impls:
            if impl in failed:
                continue
            result = run_one(impl)
            if result is None:
                failed.add(impl)
            else:
                runs[impl].append(result)
    return {impl: ([] if impl in failed else r) for impl, r in runs.items()}


def merge_rounds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several jobs of the same configuration (``--rounds``): the median over
    every timed step of every job, the highest peak RSS per rank, the first job's losses (every
    job trains the same steps) and the per-job medians, so drift between jobs stays visible."""
    merged = dict(results[0])
    steps = [t for r in results for t in r["step_times_s"]]
    merged["step_times_s"] = steps
    merged["median_step_s"] = statistics.median(steps)
    merged["round_medians_s"] = [r["median_step_s"] for r in results]
    per_rank = zip(*(r["peak_rss_mb"] for r in results), strict=True)
    merged["peak_rss_mb"] = [max(ranks) for ranks in per_rank]
    if all(r.get("page_faults_per_step") for r in results):
        per_rank_faults = zip(*(r["page_faults_per_step"] for r in results), strict=True)
        merged["page_faults_per_step"] = [statistics.median(f) for f in per_rank_faults]
    return merged


def environment() -> dict[str, Any]:
    """Versions and host facts that belong next to any timing."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        from importlib.metadata import version

        info["deepspeed"] = version("deepspeed")
    except Exception:  # not installed: the DeepSpeed rows are skipped
        info["deepspeed"] = None
    return info


@dataclass
class Row:
    """One configuration's line of the table."""

    name: str
    result: dict[str, Any] | None  # None when the configuration was skipped or failed
    note: str = ""
    is_peer: bool = True  # peers are what partita is compared against


# An extra table column: its header and how a finished row's result dict is shown in it.
Column = tuple[str, Callable[[dict[str, Any]], str]]


def show_faults(result: dict[str, Any]) -> str:
    """Table cell: median minor page faults per timed step, per rank, in thousands."""
    faults = result.get("page_faults_per_step") or []
    if not faults or any(f is None for f in faults):
        return "-"
    return " / ".join(f"{f / 1000:.0f}k" for f in faults)


FAULTS_COLUMN: Column = ("page faults per step", show_faults)


def render_markdown(
    rows: list[Row],
    rss_reference: str,
    title: str,
    time_reference: str | None = None,
    extra_columns: Sequence[Column] = (),
) -> str:
    """The side-by-side table: median step time, its ratio to the ``time_reference`` row (a
    column only when given) and to the fastest peer, peak RSS per rank and its ratio (largest
    rank) to the ``rss_reference`` row, any ``extra_columns``, the last step's loss (equal
    losses show that the configurations computed the same thing) and the optimizer class."""
    done = {r.name: r.result for r in rows if r.result is not None}
    peer_times = {r.name: r.result["median_step_s"] for r in rows if r.result and r.is_peer}
    best = min(peer_times, key=peer_times.__getitem__) if peer_times else None
    ref_rss = max(done[rss_reference]["peak_rss_mb"]) if rss_reference in done else None
    ref_time = done[time_reference]["median_step_s"] if time_reference in done else None
    time_cols = ([f"vs {time_reference}"] if time_reference else []) + ["vs best peer"]
    headers = ["configuration", "median step (ms)", *time_cols, "peak RSS per rank (MB)",
               f"RSS vs {rss_reference}", *(c[0] for c in extra_columns), "final loss",
               "optimizer"]  # fmt: skip
    lines = [f"### {title}", "", "| " + " | ".join(headers) + " |"]
    lines.append("|---|" + "---:|" * (len(headers) - 2) + "---|")
    for row in rows:
        res = row.result
        if res is None:
            lines.append(f"| {row.name} | {row.note or 'skipped'} |" + " |" * (len(headers) - 2))
            continue
        cells = [row.name, f"{res['median_step_s'] * 1e3:.1f}"]
        if time_reference:
            cells.append(f"{res['median_step_s'] / ref_time:.2f}x" if ref_time else "-")
        cells.append(f"{res['median_step_s'] / peer_times[best]:.2f}x" if best else "-")
        cells.append(" / ".join(f"{m:.0f}" for m in res["peak_rss_mb"]))
        cells.append(f"{max(res['peak_rss_mb']) / ref_rss:.2f}x" if ref_rss else "-")
        cells += [show(res) for _, show in extra_columns]
        cells += [f"{res['losses'][-1]:.4f}", str(res.get("optimizer", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    if best is not None:
        lines += ["", f"Best peer: {best}."]
    return "\n".join(lines) + "\n"


def loss_gaps(rows: list[Row], reference: str) -> dict[str, float]:
    """Largest per-step loss difference of each finished row from the ``reference`` row.

    Every configuration trains the same model on the same data with the same optimizer, so the
    gaps should be rounding-sized; a large one means a configuration computed something else."""
    results = {r.name: r.result for r in rows if r.result is not None}
    if reference not in results:
        return {}
    ref = results[reference]["losses"]
    return {
        name: max(abs(a - b) for a, b in zip(res["losses"], ref, strict=True))
        for name, res in results.items()
    }


def write_results(
    stem: str, markdown: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR
) -> tuple[Path, Path]:
    """Write ``<results_dir>/<stem>.md`` and ``.json``; returns both paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = results_dir / f"{stem}.md", results_dir / f"{stem}.json"
    md_path.write_text(markdown)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    return md_path, json_path
