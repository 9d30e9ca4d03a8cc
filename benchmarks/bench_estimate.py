"""Validation table for ``partita estimate``: predicted vs measured memory per rank.

For GPT-2 models of ~10M and ~50M parameters, 2 CPU ranks (gloo), fp32, stages 0-3 x offload
(none, cpu; nvme at stage 3 only, as partita runs it), three training steps each in a fresh pair
of processes: the estimator's model states against ``engine.memory_report()``, and its peak
(all items, activations traced on meta/fake tensors) against the peak RSS over the process's
baseline (RSS after imports, GPT-2's modelling code included, before the model is built;
the peak is reset there). DeepSpeed's
own estimator (``estimate_zero{2,3}_model_states_mem_needs``, per GPU + per CPU / ranks) is
beside it where DeepSpeed has one (stages 2 and 3).

    .venv/bin/python benchmarks/bench_estimate.py [--models 10m,50m] [--json FILE.json]
        [--tree_commit SHA]

``--json`` writes the rows with when, on what load and from which tree they were measured,
and the table with that header beside it (FILE.md). ``--tree_commit`` names the commit when
the script runs from a ``git archive`` of it (so other work in a shared checkout is not what
is measured).
    .venv/bin/python benchmarks/bench_estimate.py --plan_cap 400MiB,445MiB [--models 10m]
        [--repeats 1] [--speed_steps 30] [--json FILE]
    .venv/bin/python benchmarks/bench_estimate.py --plan_cap 400MiB --repredict FILE.json

``--plan_cap`` checks the planner instead: with that much memory per rank (and the rates
measured here: FLOP/s, CPU Adam parameters/s, gloo all-reduce bytes/s) it ranks the
configurations that fit; it trains every candidate ``--repeats`` times in a fresh pair of
processes for its peak, then all candidates side by side in one pair of processes for
``--speed_steps`` steps each, in turn (`plan_speed`: [Note: side-by-side step times]), and
prints per cap predicted against measured: the choice should fit and no candidate within
the cap should be faster by a sign test over the paired steps. The runs do not depend on the
cap, so several caps share them; with ``--repredict`` a saved run is judged again with the
estimator as it is now.

On CPU the device is the host: predicted peak = device + host items with the estimator's
defaults (5% allocator slack on CPU ranks; no pinned staging on CPU). Runs minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # ~9.0M parameters (tied embeddings): 6 blocks of 256, a 16K vocabulary.
    "10m": {"n_layer": 6, "n_embd": 256, "n_head": 4, "n_positions": 256, "vocab_size": 16384},
    # ~48M: 10 blocks of 512, a 32K vocabulary.
    "50m": {"n_layer": 10, "n_embd": 512, "n_head": 8, "n_positions": 256, "vocab_size": 32768},
}
MICRO_BATCH, SEQ, STEPS = 4, 128, 3
HERE = os.path.dirname(os.path.abspath(__file__))
CELLS: list[tuple[int, str, str]] = [
    (0, "none", "none"),
    (1, "none", "none"), (1, "cpu", "none"),
    (2, "none", "none"), (2, "cpu", "none"),
    (3, "none", "none"), (3, "cpu", "cpu"), (3, "nvme", "none"), (3, "nvme", "nvme"),
]  # fmt: skip


def _config(name: str) -> Any:
    from transformers import GPT2Config

    return GPT2Config(**SHAPES[name], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def worker(
    name: str,
    stage: int,
    opt: str,
    param: str,
    nvme_dir: str,
    ckpt: bool = False,
    steps: int = STEPS,
) -> dict[str, Any]:
    """One rank: baseline, build, initialize, `steps` steps; the memory report, peak RSS and
    the times of the steps after the first (the first builds state and warms caches)."""
    # Imported before the baseline: code is not training memory (GPT-2's modelling module and
    # what its first forward imports weigh ~100 MiB of RSS).
    import transformers.loss.loss_utils
    import transformers.masking_utils
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    import partita
    from partita.platform.accelerator import host_file_rss, host_peak_rss, host_rss

    try:  # reset VmHWM so the peak is this run's, not the imports'
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base, base_files = host_rss(), host_file_rss()
    model, config = build(name, stage, opt, param, ckpt, nvme_dir)
    engine, *_ = partita.initialize(model=model, config=config)
    del model
    g = torch.Generator().manual_seed(engine.global_rank)
    vocab = SHAPES[name]["vocab_size"]
    times, cpu = [], []
    for _ in range(steps):
        x = torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=g)
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    report: dict[str, Any] = dict(engine.memory_report())
    report["step_s"] = sum(times[1:]) / max(1, len(times) - 1)
    report["step_times"] = times[1:]
    # Process CPU time (all threads, gloo's included) per step: what the step costs this rank
    # whatever else runs on the machine; wall time adds waits and other jobs' share.
    report["step_cpu"] = cpu[1:]
    report["peak_over_base"] = host_peak_rss() - base
    # Beside it, the same less the file-backed pages mapped meanwhile (libraries' code: clean,
    # reclaimable, and 26 or 65 MiB for the same steps depending on the venv's page cache).
    report["file_pages_mapped"] = host_file_rss() - base_files
    engine.destroy()
    return report


def build(
    name: str, stage: int, opt: str, param: str, ckpt: bool, nvme_dir: str = ""
) -> tuple[Any, dict[str, Any]]:
    """GPT-2 `name` (seed 0; HF activation checkpointing with `ckpt`) and the DeepSpeed config
    of the cell (AdamW, the micro-batch, ZeRO `stage`, optimizer/parameter offload)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config(name))
    if ckpt:
        model.gradient_checkpointing_enable()
    zero: dict[str, Any] = {"stage": stage}
    for key, where in (("offload_optimizer", opt), ("offload_param", param)):
        if where != "none":
            zero[key] = (
                {"device": where, "nvme_path": nvme_dir} if where == "nvme" else {"device": where}
            )
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    return model, config


def _predict(name: str, stage: int, opt: str, param: str) -> dict[str, int]:
    from partita.estimate import MODEL_STATES, Candidate, Hardware, Settings, estimate
    from partita.estimate.model import from_hf_config

    shape = from_hf_config(_config(name), MICRO_BATCH, SEQ, torch.float32)
    cand = Candidate(stage, opt, param, "fp32")
    est = estimate(shape, cand, Hardware(2, accelerator="cpu"), Settings())
    # The states while they exist (gradients whole), as memory_report() reports them.
    states = sum(i.device + i.host for i in est.states if i.name in MODEL_STATES)
    return {
        "params": shape.total,
        "states": states,
        # The pool's own peak (what comm_buffers reports), not its bytes at the step's peak.
        "buffers": est.peaks.get("reduce buckets", 0),
        "peak": est.total("device") + est.total("host"),
    }


def _deepspeed(total: int, largest: int, stage: int, opt: str, param: str) -> int | None:
    """DeepSpeed's estimate per rank (per GPU + per CPU / 2), where it has one."""
    try:
        from deepspeed.runtime.zero import stage3, stage_1_and_2
    except ImportError:
        return None
    if stage == 2:
        cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(total, 2, 1, opt != "none")
        return int(gpu + cpu / 2)
    if stage == 3:
        cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
            total, largest, 2, 1, opt != "none", param != "none", zero_init=False
        )
        return int(gpu + cpu / 2)
    return None


def link_worker(numel: int = 1 << 22, repeats: int = 5) -> tuple[float, float]:
    """Bus bytes/s of a gloo all-reduce of `numel` fp32 elements (best of `repeats`), and the
    share of its wall time this process spent on CPU (median): what an all-reduce running
    beside compute takes from it (`Rates.comm_cpu_share`)."""
    import statistics

    import torch.distributed as dist

    x = torch.ones(numel)
    dist.all_reduce(x)  # warm-up: connections and buffers
    best, shares = float("inf"), []
    for _ in range(repeats):
        dist.barrier()
        cpu, start = time.process_time(), time.perf_counter()
        dist.all_reduce(x)
        wall = time.perf_counter() - start
        best = min(best, wall)
        shares.append(min(1.0, (time.process_time() - cpu) / wall))
    n = dist.get_world_size()
    return 2 * (n - 1) / n * numel * 4 / best, statistics.median(shares)


def _rates(name: str, env: dict[str, str]) -> Any:
    """The planner's calibration, as `partita plan --cpu --model ...` does it (the model's own
    forward and backward and the CPU Adam on the threads one of 2 ranks gets), plus gloo's
    all-reduce between 2 ranks."""
    import bench_estimate
    from partita.estimate.calibrate import calibrate_adam_rate, calibrate_model_flops, rank_threads
    from partita.estimate.plan import Rates
    from partita.testing import run_distributed

    links = run_distributed(bench_estimate.link_worker, 2, timeout=300, env=env)
    threads = rank_threads(2)
    flops = calibrate_model_flops(_config(name), MICRO_BATCH, SEQ, torch.float32, threads, 2.0)
    return Rates(
        flops,
        link_bandwidth=min(bw for bw, _ in links),
        adam_rate=calibrate_adam_rate(threads=threads),
        comm_cpu_share=max(share for _, share in links),
    )


def _measure(
    name: str, cands: list[Any], repeats: int, steps: int, env: dict[str, str]
) -> dict[str, dict[str, list[float]]]:
    """Trains every candidate `repeats` times, interleaved (round r starts len/repeats places
    further along the list, so no candidate always runs first or after the same neighbour while
    the machine's load drifts); per candidate, each run's steady step times (the slower rank's),
    their median, and the peak RSS over baseline (the larger rank's)."""
    import statistics

    import bench_estimate
    from partita.testing import run_distributed

    out: dict[str, dict[str, Any]] = {
        c.label: {"step": [], "peak": [], "steps": [], "cpu": []} for c in cands
    }
    for r in range(repeats):
        shift = (r * len(cands)) // max(1, repeats)
        for c in cands[shift:] + cands[:shift]:
            reports = run_distributed(
                bench_estimate.worker, 2, name, c.stage, c.offload_optimizer, c.offload_param,
                "", c.checkpointing, steps, timeout=900, env=env,
            )  # fmt: skip
            # A step ends when the slower rank's does; a run's figure is the median of its
            # steady steps, so one step slowed by another job's burst does not decide it.
            times = [max(ts) for ts in zip(*(rep["step_times"] for rep in reports), strict=True)]
            out[c.label]["steps"].append(times)
            out[c.label]["step"].append(statistics.median(times))
            cpu = [max(ts) for ts in zip(*(rep["step_cpu"] for rep in reports), strict=True)]
            out[c.label]["cpu"].append(statistics.median(cpu))
            out[c.label]["peak"].append(max(rep["peak_over_base"] for rep in reports))
            print(f"  round {r + 1} {c.label}: {out[c.label]['step'][-1]:.3f} s, "
                  f"{_mb(int(out[c.label]['peak'][-1]))} MiB", flush=True)  # fmt: skip
    return out


def _verdict(cap: int, ests: list[Any], ranked: list[Any], meas: dict[str, Any]) -> dict[str, Any]:
    """The planner's choice under `cap` against the measurements: does it fit, and is it the
    fastest (by median) of those whose every run stayed within the cap; "within noise" when
    the two runs' ranges of step time overlap."""
    import statistics

    within = [k for k, v in meas.items() if max(v["peak"]) <= cap]
    median = {k: statistics.median(v["step"]) for k, v in meas.items()}
    fastest = min(within, key=median.__getitem__) if within else None
    chosen = ranked[0][0].candidate.label if ranked else None
    overlap = None
    if chosen and fastest:
        a, b = meas[chosen]["step"], meas[fastest]["step"]
        overlap = chosen == fastest or (min(a) <= max(b) and min(b) <= max(a))
    # Three runs per candidate give no more than a range: a choice that is not the fastest by
    # median but whose runs overlap the fastest's is a tie this benchmark cannot break.
    speed = "fastest" if chosen == fastest else "tied (ranges overlap)" if overlap else "slower"
    return {
        "cap": cap, "chosen": chosen, "fastest_within_cap": fastest,
        "chosen_fits": chosen in within if chosen else None,
        "chosen_is_fastest": chosen == fastest, "within_noise": overlap, "speed": speed,
        "within_cap": within, "predicted_fit": [e.candidate.label for e in ests if e.fits],
        "predicted_step": {e.candidate.label: t.total for e, t in ranked},
    }  # fmt: skip


def _cap_table(name: str, ests: list[Any], verdict: dict[str, Any], meas: dict[str, Any]) -> str:
    import statistics

    cap, pred = verdict["cap"], verdict["predicted_step"]
    lines = [
        f"cap {_mb(cap)} MiB per rank ({name}): chosen {verdict['chosen']}; fastest measured "
        f"within the cap {verdict['fastest_within_cap']}; chosen fits: {verdict['chosen_fits']}; "
        f"chosen is fastest: {verdict['chosen_is_fastest']} (ranges overlap: "
        f"{verdict['within_noise']}); verdict: {verdict['speed']}",
        "",
        "| config | fits (predicted) | predicted peak MiB | measured peak MiB (max) | within cap "
        "| predicted step s | measured step s (median of runs) | runs' range | fastest step "
        "| CPU s per step (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in ests:
        label, m = e.candidate.label, meas[e.candidate.label]
        step = f"{pred[label]:.3f}" if label in pred else "-"
        lines.append(
            f"| {label} | {'yes' if e.fits else 'no'} | {_mb(e.total('device') + e.total('host'))}"
            f" | {_mb(int(max(m['peak'])))} | {'yes' if max(m['peak']) <= cap else 'NO'} | {step}"
            f" | {statistics.median(m['step']):.3f} | {min(m['step']):.3f}-{max(m['step']):.3f}"
            f" | {min((t for ts in m.get('steps', []) for t in ts), default=float('nan')):.3f}"
            f" | {statistics.median(m['cpu']) if m.get('cpu') else float('nan'):.3f} |"
        )
    return "\n".join(lines)


def plan_check(
    name: str,
    caps: list[int],
    repeats: int,
    speed_steps: int,
    env: dict[str, str],
    trial: bool = False,
) -> dict[str, Any]:
    """Ranks the configurations for each cap (bytes per rank) with rates measured here; trains
    every candidate (fitting or not: the measurements do not depend on the cap) `repeats`
    times in fresh processes for its peak, then all of them side by side for `speed_steps`
    steps for their speed; prints predicted against measured for each cap."""
    from partita.estimate.plan import HEADROOM

    rates = _rates(name, env)
    print(f"rates: {rates.flops / 1e9:.1f} GFLOP/s, link {rates.link_bandwidth / 1e9:.2f} GB/s, "
          f"(CPU share {rates.comm_cpu_share:.2f}), Adam {rates.adam_rate / 1e6:.0f} M params/s; "
          f"headroom {HEADROOM}", flush=True)  # fmt: skip
    cands = _plan_candidates()
    meas = _measure(name, cands, repeats, STEPS, env)  # peaks, each in fresh processes
    times = _side_by_side(name, cands, speed_steps, env)
    return judge(name, caps, rates, meas, times, trial=trial)


def _side_by_side(
    name: str, cands: list[Any], steps: int, env: dict[str, str]
) -> dict[str, list[float]]:
    """Every candidate's step times, the engines side by side in one pair of ranks
    ([Note: side-by-side step times] in `plan_speed`); per step the slower rank's."""
    import plan_speed
    from partita.testing import run_distributed

    spec = [
        (c.label, c.stage, c.offload_optimizer, c.offload_param, c.checkpointing) for c in cands
    ]
    per_rank = run_distributed(
        plan_speed.side_by_side_worker, 2, name, spec, 2, steps, timeout=3600, env=env
    )
    return plan_speed.slower_rank(per_rank)


def _plan_candidates() -> list[Any]:
    from partita.estimate import candidates

    return [
        c for c in candidates("fp32", None) if "nvme" not in (c.offload_optimizer, c.offload_param)
    ]


def judge(
    name: str,
    caps: list[int],
    rates: Any,
    meas: dict[str, Any],
    times: dict[str, list[float]] | None = None,
    headroom: float | None = None,
    trial: bool = False,
) -> dict[str, Any]:
    """The planner's choice for each cap (the estimator as it is now, `rates`, `headroom`:
    None for the planner's default `HEADROOM`) against measurements `meas` (as `_measure`
    returns them) and, when given, the side-by-side step times `times` (which then decide the
    speed verdict); prints a table per cap. `trial`: the choice of ``partita plan --trial``,
    whose trials measure what `_measure` measured (a fresh pair of processes, 3 steps, peak
    over baseline): the fastest predicted of those the headroom kept out whose peak leaves
    `TRIAL_MARGIN` of the cap free, else the planner's choice."""
    import plan_speed
    from partita.estimate import Hardware, estimate
    from partita.estimate.model import from_hf_config
    from partita.estimate.plan import HEADROOM, rank

    headroom = HEADROOM if headroom is None else headroom
    shape = from_hf_config(_config(name), MICRO_BATCH, SEQ, torch.float32)
    cands = [c for c in _plan_candidates() if c.label in meas]
    result: dict[str, Any] = {"model": name, "rates": vars(rates), "headroom": headroom,
                              "measured": meas, "side_by_side": times, "caps": []}  # fmt: skip
    for cap in caps:
        hw = Hardware(2, host_memory=2 * cap, accelerator="cpu", headroom=headroom)
        ests = [estimate(shape, c, hw) for c in cands]
        ranked = rank(ests, shape.trainable, MICRO_BATCH * SEQ, rates, shape.recomputed)
        if trial:
            ranked = _with_trials(shape, cap, ests, ranked, rates, meas)
        verdict = _verdict(cap, ests, ranked, meas)
        verdict["predicted_peak"] = {
            e.candidate.label: e.total("device") + e.total("host") for e in ests
        }
        if times is None:
            table = _cap_table(name, ests, verdict, meas)
        else:
            side = plan_speed.verdict(verdict["chosen"], verdict["within_cap"], times)
            verdict["side_by_side"] = side
            rows = [
                {"label": e.candidate.label, "fits": e.fits,
                 "predicted_peak": verdict["predicted_peak"][e.candidate.label] / 2**20,
                 "measured_peak": max(meas[e.candidate.label]["peak"]) / 2**20,
                 "within": e.candidate.label in verdict["within_cap"],
                 "predicted_step": verdict["predicted_step"].get(e.candidate.label)}
                for e in ests
            ]  # fmt: skip
            table = plan_speed.cap_table(name, cap / 2**20, rows, verdict["chosen"], times, side)
        result["caps"].append(verdict)
        print("\n" + table + "\n", flush=True)
    return result


def _with_trials(
    shape: Any, cap: int, ests: list[Any], ranked: list[Any], rates: Any, meas: dict[str, Any]
) -> list[Any]:
    """`ranked` with ``partita plan --trial``'s choice first (`judge`)."""
    from partita.estimate.plan import kept_out_by_headroom
    from partita.estimate.trial import TRIAL_MARGIN

    for e, t in kept_out_by_headroom(shape, ests, ranked, MICRO_BATCH * SEQ, rates):
        if max(meas[e.candidate.label]["peak"]) <= cap * (1 - TRIAL_MARGIN):
            return [(e, t), *ranked]
    return ranked


def _plan_checks(names: list[str], args: argparse.Namespace) -> None:
    from partita.estimate.units import parse_bytes

    sys.path.insert(0, HERE)
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    caps = [parse_bytes(c, "--plan_cap") for c in args.plan_cap.split(",")]
    if args.repredict:  # the saved run's measurements and rates, today's estimator and caps
        from partita.estimate.plan import Rates

        with open(args.repredict) as f:
            saved = json.load(f)
        for res in saved["results"]:
            judge(
                res["model"], caps, Rates(**res["rates"]), res["measured"],
                res.get("side_by_side"), args.headroom, args.trial,
            )  # fmt: skip
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    results = [plan_check(n, caps, args.repeats, args.speed_steps, env, args.trial) for n in names]
    if args.json:
        meta = {"command": " ".join(sys.argv), "started": started,
                "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "loadavg_start": load, "loadavg_end": os.getloadavg(),
                "cpus": os.cpu_count(), "speed_steps": args.speed_steps, "repeats": args.repeats}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


def main() -> None:
    """Runs every cell and prints the markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="10m,50m")
    ap.add_argument("--json", help="also write the rows here, and the table beside it (.md)")
    ap.add_argument(
        "--repredict", metavar="FILE.json",
        help="re-render a saved run's measurements with the current estimator (no training); "
        "with --plan_cap, a saved --plan_cap --json run",
    )  # fmt: skip
    ap.add_argument(
        "--plan_cap",
        help="check the planner under this memory per rank, e.g. 410MiB (or several: 400MiB,440MiB)",
    )
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="--plan_cap: fresh-process runs per candidate for its peak (the largest counts)",
    )  # fmt: skip
    ap.add_argument(
        "--headroom", type=float,
        help="with --plan_cap --repredict: judge with this planner headroom (default: HEADROOM)",
    )  # fmt: skip
    ap.add_argument(
        "--trial", action="store_true",
        help="with --plan_cap: judge the choice of partita plan --trial (its trials' peaks are "
        "the measured ones)",
    )  # fmt: skip
    ap.add_argument(
        "--speed_steps", type=int, default=30,
        help="--plan_cap: timed steps per candidate, all candidates side by side",
    )  # fmt: skip
    ap.add_argument(
        "--tree_commit", help="run from a `git archive` of this commit: name it in the results"
    )
    args = ap.parse_args()
    if args.plan_cap:
        _plan_checks(args.models.split(","), args)
    elif args.repredict:
        with open(args.repredict) as f:
            saved = json.load(f)
        rows = saved["rows"] if isinstance(saved, dict) else saved  # older files: rows only
        for r in rows:
            pred = _predict(r["model"], r["stage"], r["opt"], r["param"])
            r["pred_states"], r["pred_peak"] = pred["states"], pred["peak"]
            r["pred_buffers"] = pred["buffers"]
        print(_table(rows))
    else:
        _validate(args.models.split(","), args.json, args.tree_commit)


def _run_meta(tree_commit: str | None) -> dict[str, Any]:
    """When, where and from which tree: UTC time, load average, CPUs, the commit and the
    files under src/ and benchmarks/ that differ from it (measured code is committed code
    only when that list is empty). `tree_commit`: a `git archive` of that commit (no .git)."""
    import subprocess

    def git(*argv: str) -> str:
        out = subprocess.run(["git", *argv], capture_output=True, text=True, cwd=HERE)
        return out.stdout.strip() if out.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "../src", "../benchmarks/bench_estimate.py")
    commit = git("rev-parse", "HEAD")
    if tree_commit and not commit:
        commit, dirty = f"{tree_commit} (a git archive of it)", ""
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "commit": commit or "unknown",
        "uncommitted": dirty.splitlines(),
    }  # fmt: skip


def _validate(names: list[str], json_path: str | None, tree_commit: str | None) -> None:
    """Trains every cell of every model in fresh pairs of processes; prints (and with
    `json_path` writes, with the run's `_run_meta` at start and end) the table."""
    from transformers import GPT2LMHeadModel

    import bench_estimate  # the workers import it by this name (this file is __main__ here)
    from partita.compat.estimator_names import model_to_params
    from partita.testing import run_distributed

    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    meta = {"command": " ".join(["benchmarks/bench_estimate.py", *sys.argv[1:]]),
            "start": _run_meta(tree_commit)}  # fmt: skip
    rows = []
    for name in names:
        with torch.device("meta"):
            total, largest = model_to_params(GPT2LMHeadModel(_config(name)))
        for stage, opt, param in CELLS:
            with tempfile.TemporaryDirectory() as nvme_dir:
                start = time.time()
                reports = run_distributed(
                    bench_estimate.worker, 2, name, stage, opt, param, nvme_dir,
                    timeout=900, env=env,
                )  # fmt: skip
            rows.append(_measured_row(name, stage, opt, param, reports, total, largest))
            rows[-1]["seconds"] = round(time.time() - start, 1)
            print(_row(rows[-1]), flush=True)
    meta["end"] = _run_meta(tree_commit)
    print("\n" + _table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
            f.write(_markdown(meta, rows))


def _measured_row(
    name: str, stage: int, opt: str, param: str, reports: list[Any], total: int, largest: int
) -> dict[str, Any]:
    """One table row: the predictions beside the larger rank's measurements."""
    pred = _predict(name, stage, opt, param)
    keys = ("params", "grads", "master_params", "optimizer_state")
    return {
        "model": name, "stage": stage, "opt": opt, "param": param,
        "pred_states": pred["states"],
        "meas_states": max(sum(r[k] for k in keys) for r in reports),
        "pred_buffers": pred["buffers"],
        "meas_buffers": max(r["comm_buffers"] for r in reports),
        "pred_peak": pred["peak"], "meas_peak": max(r["peak_over_base"] for r in reports),
        "meas_peak_less_files": max(
            r["peak_over_base"] - r["file_pages_mapped"] for r in reports
        ),
        "deepspeed": _deepspeed(total, largest, stage, opt, param),
    }  # fmt: skip


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The results file: what ran, when, on what load, from which tree, and the table."""
    start, end = meta["start"], meta["end"]
    tree = f"commit {start['commit']}" + (
        ", with uncommitted changes to " + ", ".join(start["uncommitted"])
        if start["uncommitted"] else ", no uncommitted changes under src/ or to this script"
    )  # fmt: skip
    load = ", ".join(f"{x:.2f}" for x in start["loadavg"])
    load_end = ", ".join(f"{x:.2f}" for x in end["loadavg"])
    return (
        f"# Memory estimator vs measured, 2 CPU ranks, fp32, micro-batch {MICRO_BATCH} x {SEQ}, "
        f"{STEPS} steps\n\n"
        f"Command: `.venv/bin/python {meta['command']}`, {start['time']} to {end['time']}, "
        f"{start['cpus']} CPUs, load average (1, 5, 15 min) {load} at the start and {load_end} "
        f"at the end; {tree}. err = (predicted - measured) / measured; measured peak: the "
        "larger rank's peak RSS over its post-import baseline (less file pages: the same less the "
        "file-backed pages mapped during the run, libraries' code); reduce buffers: the estimator's "
        "own peak of the gradient pool against `memory_report()['comm_buffers']`.\n\n"
        + _table(rows)
        + "\n"
    )


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _err(pred: int, meas: int) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}%" if meas else "-"


def _row(r: dict[str, Any]) -> str:
    cfg = f"z{r['stage']} opt={r['opt']} param={r['param']}"
    return (
        f"| {r['model']} | {cfg} | {_mb(r['pred_states'])} | {_mb(r['meas_states'])} | "
        f"{_err(r['pred_states'], r['meas_states'])} | {_mb(r.get('pred_buffers'))} | "
        f"{_mb(r.get('meas_buffers'))} | {_mb(r['pred_peak'])} | "
        f"{_mb(r['meas_peak'])} | {_err(r['pred_peak'], r['meas_peak'])} | "
        f"{_mb(r.get('meas_peak_less_files'))} | "
        f"{_err(r['pred_peak'], r['meas_peak_less_files']) if 'meas_peak_less_files' in r else '-'} | "
        f"{_mb(r['deepspeed'])} |"
    )


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | config | states pred MiB | states meas MiB | err | reduce buffers pred MiB | "
        "comm_buffers meas MiB | peak pred MiB | peak meas MiB (RSS over base) | err | "
        "less file pages MiB | err | DeepSpeed est. MiB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([head, *(_row(r) for r in rows)])


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
