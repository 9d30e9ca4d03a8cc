"""ZeRO training benchmark: partita's stages 1, 2 and 3 against their peers.

Trains the same GPT-2 on the same data as ``bench_dp.py``, each configuration its own
``torchrun`` job of ``--nprocs`` CPU processes (gloo), in two suites:

* ``zero12``: partita stages 1 and 2 against partita stage 0 (the reference), DDP with
  ``AdamW(fused=True)`` and DeepSpeed stages 1 and 2;
* ``zero3``: partita stage 3 against partita stage 0 (the reference), FSDP2 (``fully_shard`` on
  each transformer block, then the root, with ``AdamW(fused=True)``) and DeepSpeed stage 3;
* ``offload``: partita stage 3 without offload (the reference), with the optimizer state on the
  CPU, with it and the parameters on the CPU, with the optimizer state on NVMe (one sub-group in
  memory at a time, DeepSpeed's default; and pipelined: ``pipeline_read``/``pipeline_write``
  with ``buffer_count`` 12), and with both on NVMe (swap files under ``--nvme_dir``); DeepSpeed stage 3 with CPU optimizer offload as the
  peer. On a CPU-only machine "CPU offload" moves nothing (host and device are one memory), so
  its rows measure the offload code path's overhead; NVMe rows measure real disk traffic.

All use fp32, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01), gradient clipping
at 1.0, no scheduler; warm-up steps are excluded from timing. partita and DeepSpeed share one
config (``--persistence_threshold`` and ``--zero_config`` included). Examples::

    .venv/bin/python benchmarks/bench_zero.py --model 23m --steps 20
    .venv/bin/python benchmarks/bench_zero.py --nprocs_sweep 1,2,4

Writes ``benchmarks/results/zero12_<model>`` and ``zero3_<model>`` ``.md`` and ``.json``; the
``--nprocs_sweep`` mode instead runs partita's stages at each world size and writes
``zero_sweep_<model>``: peak RSS and model-state bytes per rank next to ZeRO's arithmetic.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_zero)
    from benchmarks import common
else:  # python benchmarks/bench_zero.py: this folder is sys.path[0]
    import common


StepFn = Callable[[torch.Tensor], torch.Tensor]
# fp32 runs of one model on the same data differ only by summation order (fused vs for-loop
# AdamW, bucketed or sharded reductions); a gap above this means something else was trained.
LOSS_GAP_WARN = 1e-3
MB = 1024 * 1024
# memory_report keys that make up the model states ZeRO partitions.
MODEL_STATE_KEYS = ("params", "grads", "master_params", "optimizer_state")
DDP, FSDP2 = "ddp-fused", "fsdp2"


@dataclass(frozen=True)
class Suite:
    """One comparison: its configurations (first the reference), which are peers, the
    configuration that RSS and losses are compared with, and the goals it checks."""

    impls: tuple[str, ...]
    peers: tuple[str, ...]
    reference: str  # rss ratio and loss gaps are taken against this one (when it ran)
    title: str


SUITES: dict[str, Suite] = {
    "zero12": Suite(
        ("partita-0", "partita-1", "partita-2", DDP, "deepspeed-1", "deepspeed-2"),
        (DDP, "deepspeed-1", "deepspeed-2"),
        DDP,
        "ZeRO stages 1 and 2",
    ),
    "zero3": Suite(
        ("partita-0", "partita-3", FSDP2, "deepspeed-3"),
        (FSDP2, "deepspeed-3"),
        FSDP2,
        "ZeRO stage 3",
    ),
    "offload": Suite(
        (
            "partita-3",
            "partita-3+cpu",
            "partita-3+cpu_params",
            "partita-3+nvme",
            "partita-3+nvme_pipelined",
            "partita-3+nvme_params",
            "deepspeed-3+cpu",
        ),
        ("deepspeed-3+cpu",),
        "partita-3",
        "ZeRO stage 3 offload",
    ),
}

OFFLOADS: dict[str, tuple[str, str]] = {
    "cpu": ("cpu", "none"),
    "cpu_params": ("cpu", "cpu"),
    "nvme": ("nvme", "none"),
    "nvme_params": ("nvme", "nvme"),
    "nvme_pipelined": ("nvme", "none"),
}
"""Offload variant -> (offload_optimizer.device, offload_param.device)."""
PIPELINED = {"pipeline_read": True, "pipeline_write": True, "buffer_count": 12}
"""``offload_optimizer`` keys of the ``nvme_pipelined`` variant: reads and writes overlapped."""


def split_impl(impl: str) -> tuple[str, int, str]:
    """``partita-3+nvme_params`` -> (backend, stage, offload variant or '')."""
    backend, rest = impl.rsplit("-", 1)
    stage, _, offload = rest.partition("+")
    return backend, int(stage), offload


def label(impl: str) -> str:
    """The table's name for a configuration key such as ``partita-2`` or ``fsdp2``."""
    if impl == DDP:
        return "DDP + AdamW(fused=True)"
    if impl == FSDP2:
        return "FSDP2 (fully_shard per block) + AdamW(fused=True)"
    backend, stage, offload = split_impl(impl)
    where = ""
    if offload:
        opt, param = OFFLOADS[offload]
        where = f" + optimizer on {opt.upper()}" + (
            f", parameters on {param.upper()}" if param != "none" else ""
        )
        where += " (pipelined I/O)" if offload == "nvme_pipelined" else ""
    if backend == "deepspeed":
        version = common.environment()["deepspeed"]
        name = f"DeepSpeed {version} stage {stage}" if version else f"DeepSpeed stage {stage}"
        return name + where
    return f"partita stage {stage}{where}"


def parse_args() -> argparse.Namespace:
    """Orchestrator and worker arguments (the worker is this script under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(common.MODEL_SHAPES), default="23m")
    p.add_argument(
        "--suites", default="zero12,zero3", help="comma-separated: zero12, zero3, offload"
    )
    p.add_argument("--impls", help="only these configurations (e.g. partita-3,fsdp2)")
    p.add_argument("--nprocs", type=int, default=2, help="processes per job")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores / N)")
    p.add_argument("--micro_batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--rounds", type=int, default=1,
        help="jobs per configuration, run in turn (A B C A B C ...); steps of all are pooled",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--persistence_threshold", type=int, default=100_000,
        help="stage3_param_persistence_threshold for partita and DeepSpeed stage 3 "
        "(DeepSpeed's default; parameters with fewer elements stay gathered)",
    )  # fmt: skip
    p.add_argument(
        "--zero_config", type=json.loads, default={},
        help='JSON merged into zero_optimization of partita and DeepSpeed stages >= 1, e.g. '
        '\'{"reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7}\'',
    )  # fmt: skip
    p.add_argument(
        "--nvme_dir", default=tempfile.gettempdir(), help="nvme_path of the NVMe offload rows"
    )
    p.add_argument(
        "--bf16", action="store_true",
        help="bf16 mixed precision (fp32 masters) for partita and DeepSpeed; the torch peers "
        "stay fp32, so only partita and DeepSpeed rows may run (results get a _bf16 suffix)",
    )  # fmt: skip
    p.add_argument(
        "--check_pair", action="store_true",
        help="stage 3 with and without the rank-divergence check (stage3_check_divergence), "
        "paired in one job: one engine whose steps alternate check on/off (ABBA), so both see "
        "the same machine load; prints the median step-time ratio on/off",
    )  # fmt: skip
    p.add_argument("--nprocs_sweep", help="e.g. 1,2,4: memory of partita's stages per N")
    p.add_argument("--sweep_stages", default="1,2,3", help="partita stages in the sweep")
    p.add_argument("--job_timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--results_dir", type=Path, default=common.RESULTS_DIR, help="where to write")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result_file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nprocs)
    return args


# --- worker --------------------------------------------------------------------------------


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    """torch's fused AdamW with the shared hyper-parameters."""
    return torch.optim.AdamW(
        params, lr=common.LR, betas=common.BETAS, eps=common.EPS,
        weight_decay=common.WEIGHT_DECAY, fused=True,
    )  # fmt: skip


def torch_step(
    model: torch.nn.Module, forward: torch.nn.Module, opt: torch.optim.Optimizer
) -> StepFn:
    """The step of the torch peers, mirroring an engine's: forward, backward, clip, step."""

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = forward(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def setup_ddp(model: torch.nn.Module) -> tuple[StepFn, dict[str, Any]]:
    """DDP on gloo with fused AdamW."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    opt = fused_adamw(model.parameters())
    return torch_step(model, DistributedDataParallel(model), opt), {
        "optimizer": "AdamW(fused=True)"
    }


def setup_fsdp2(model: torch.nn.Module) -> tuple[StepFn, dict[str, Any]]:
    """FSDP2 on gloo: ``fully_shard`` on each transformer block, then on the root (which takes
    the embeddings, tied LM head and final norm), fused AdamW over the DTensor shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in cast(torch.nn.ModuleList, model.get_submodule("transformer.h")):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fused_adamw(model.parameters())
    return torch_step(model, model, opt), {"optimizer": "AdamW(fused=True)"}


def engine_config(args: argparse.Namespace, stage: int, offload: str = "") -> dict[str, Any]:
    """The DeepSpeed-style config of a partita or DeepSpeed run at ``stage``, with the
    `OFFLOADS` variant ``offload`` ('' for none)."""
    config = common.ds_config(args.micro_batch, stage)
    zero = config["zero_optimization"]
    if stage >= 1:
        zero.update(args.zero_config)
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = args.persistence_threshold
    if offload:
        for block, device in zip(
            ("offload_optimizer", "offload_param"), OFFLOADS[offload], strict=True
        ):
            if device != "none":
                zero[block] = {"device": device, "nvme_path": args.nvme_dir}
        if offload == "nvme_pipelined":
            zero["offload_optimizer"].update(PIPELINED)
    if args.bf16:
        config["bf16"] = {"enabled": True}
    return config


def setup_engine(
    backend: str, model: torch.nn.Module, config: dict[str, Any]
) -> tuple[StepFn, dict[str, Any], Any]:
    """partita or DeepSpeed through the DeepSpeed API; also returns the engine."""
    engine_lib = importlib.import_module(backend)
    engine, optimizer, _, _ = engine_lib.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = engine(batch.to(engine.device), labels=batch.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        return loss

    inner = getattr(optimizer, "optimizer", None)  # DeepSpeed's ZeRO wraps a torch optimizer
    name = type(optimizer).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
    return step, {"optimizer": name}, engine


def stage3_layout(engine: Any, names: dict[int, str]) -> dict[str, Any]:
    """Which parameters partita's stage 3 keeps persistent (gathered), and its unit count;
    block indices in names are folded to ``*`` so 12 blocks read as one pattern."""
    strategy = engine.strategy
    persistent = [] if strategy.persistent is None else strategy.persistent.params
    patterns = sorted({re.sub(r"\.\d+\.", ".*.", names[id(p)]) for p in persistent})
    return {
        "units": len(strategy.units),
        "persistent_count": len(persistent),
        "persistent_numel": sum(p.numel() for p in persistent),
        "persistent_patterns": patterns,
    }


def all_ranks(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def build_worker(
    args: argparse.Namespace, model: torch.nn.Module
) -> tuple[StepFn, dict[str, Any], Any]:
    """The step function, result extras and (partita only) engine of ``args.worker``."""
    if args.worker == DDP:
        return (*setup_ddp(model), None)
    if args.worker == FSDP2:
        return (*setup_fsdp2(model), None)
    backend, stage, offload = split_impl(args.worker)
    names = {id(p): n for n, p in model.named_parameters()}
    step, extra, engine = setup_engine(backend, model, engine_config(args, stage, offload))
    if backend == "partita" and stage == 3:
        extra["stage3"] = stage3_layout(engine, names)
    return step, extra, engine if backend == "partita" else None


def worker(args: argparse.Namespace) -> None:
    """One configuration on one rank: build, time, and (rank 0) write the result file."""
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = args.worker.split("-")[0]
    if backend in ("partita", "deepspeed"):
        importlib.import_module(backend)  # first, as training scripts do (partita's import sets
        # its allocator default, which must precede the model's allocations)
    baseline = common.peak_rss_mb()  # interpreter, torch, engine library: before model, engine
    model = common.build_gpt2(args.model, args.seed)
    params = common.count_params(model)  # before stage 3 swaps the parameters for placeholders
    step, extra, engine = build_worker(args, model)
    if args.check_pair:
        step, checked = alternate_check(step, engine)
    batches = common.corpus_batches(rank, world, args.micro_batch, args.seq_len)
    times, losses, faults = common.time_steps(step, batches, args.warmup, args.steps)
    if args.check_pair:
        extra["checked"] = checked[args.warmup :]
        extra["checks"] = engine.strategy.divergence.checks  # identity exchanges, all steps
        extra["checked_steps"] = sum(checked)  # warmup included, as in "checks"
    extra["params"] = params
    if engine is not None:
        extra["memory_report"] = all_ranks(engine.memory_report())
    result = common.collect_result(times, losses, baseline, extra, faults)
    if result is not None:
        Path(args.result_file).write_text(json.dumps(result))
    common.exit_worker()


def alternate_check(step: StepFn, engine: Any) -> tuple[StepFn, list[bool]]:
    """`step` with partita stage 3's divergence check on in calls 0, 3, 4, 7, ... and off in
    the others (ABBA: a drift in the machine's speed falls on both alike); the list records
    each call's setting. Every rank switches at the same call, so the identities still pair."""
    check = engine.strategy.divergence
    enabled = check.enabled
    checked: list[bool] = []

    def paired(batch: torch.Tensor) -> torch.Tensor:
        check.enabled = enabled and len(checked) % 4 in (0, 3)
        checked.append(check.enabled)
        return step(batch)

    return paired, checked


def pair_times(times: list[float], checked: list[bool]) -> dict[str, Any]:
    """Median step time (the slowest rank's) with and without the check, and their ratio."""
    on = [t for t, c in zip(times, checked, strict=True) if c]
    off = [t for t, c in zip(times, checked, strict=True) if not c]
    if not on or not off:
        return {}
    med_on, med_off = statistics.median(on), statistics.median(off)
    return {
        "steps_on": len(on), "steps_off": len(off), "median_on_s": med_on,
        "median_off_s": med_off, "ratio_on_off": med_on / med_off,
    }  # fmt: skip


def run_check_pair(args: argparse.Namespace) -> int:
    """``--check_pair``: one partita stage-3 job, steps alternating the check; prints and
    saves ``zero3_check_<model>.json``."""
    errors: dict[str, str] = {}
    result = run_job(args, "partita-3", args.nprocs, args.threads, errors)
    if result is None:
        return 1
    pair = pair_times(result["step_times_s"], result["checked"])
    pair["checks_per_step"] = result["checks"] / (args.warmup + args.steps)
    # Only checked steps exchange identities (half of them here): the cost per step that pays.
    pair["checks_per_checked_step"] = result["checks"] / max(1, result["checked_steps"])
    print(json.dumps(pair, indent=1))
    out = args.results_dir / f"zero3_check_{args.model}.json"
    out.write_text(json.dumps({"args": jsonable(vars(args)), "check_pair": pair}, indent=1))
    print(f"wrote {out}")
    return 0


# --- orchestrator --------------------------------------------------------------------------


def available(impl: str) -> str | None:
    """Why ``impl`` cannot run here, or None when it can."""
    module = {"partita": "partita.api", "deepspeed": "deepspeed"}.get(impl.split("-")[0])
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"not installed (`import {module}` fails)"


def shared_args(args: argparse.Namespace) -> list[str]:
    """Worker arguments every job of this run shares."""
    return [
        "--model", args.model, "--threads", str(args.threads), "--micro_batch", str(args.micro_batch),
        "--seq_len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps),
        "--seed", str(args.seed), "--persistence_threshold", str(args.persistence_threshold),
        "--zero_config", json.dumps(args.zero_config), "--nvme_dir", args.nvme_dir,
        *(["--bf16"] if args.bf16 else []), *(["--check_pair"] if args.check_pair else []),
    ]  # fmt: skip


def run_job(
    args: argparse.Namespace, impl: str, nprocs: int, threads: int, errors: dict[str, str]
) -> dict[str, Any] | None:
    """One configuration's job; None (and the error in ``errors``) when it failed."""
    worker_args = ["--worker", impl, *shared_args(args)]
    worker_args[worker_args.index("--threads") + 1] = str(threads)
    print(f"running {label(impl)} on {nprocs} processes ...", flush=True)
    try:
        result = common.launch_job(
            Path(__file__).resolve(), worker_args, nprocs, threads, args.job_timeout
        )
    except Exception as exc:  # one failed configuration must not hide the others
        errors[f"{impl}@{nprocs}"] = str(exc)
        print(f"  {label(impl)} FAILED:\n{exc}", file=sys.stderr, flush=True)
        return None
    print(f"  median step {result['median_step_s'] * 1e3:.1f} ms, "
          f"peak RSS {[round(m) for m in result['peak_rss_mb']]} MB", flush=True)  # fmt: skip
    return result


def model_state_mb(result: dict[str, Any]) -> list[float]:
    """Per rank, the bytes partita's memory_report counts as model states, in MB."""
    return [sum(r[k] for k in MODEL_STATE_KEYS) / MB for r in result.get("memory_report", [])]


def show_model_states(result: dict[str, Any]) -> str:
    """Table cell: partita's model-state MB per rank ('-' for other implementations)."""
    states = model_state_mb(result)
    return " / ".join(f"{m:.1f}" for m in states) if states else "-"


def show_first_loss(result: dict[str, Any]) -> str:
    """Table cell: the first step's loss (before any update: only the forward differs)."""
    return f"{result['losses'][0]:.6f}"


@dataclass(frozen=True)
class Goal:
    """A stated target: ``metric(impl) / metric(other)`` at most ``limit`` (below it when
    ``strict``); metric is the median step time or the largest rank's peak RSS."""

    impl: str
    other: str
    metric: str  # "time" or "rss"
    limit: float
    strict: bool

    def check(self, results: dict[str, dict[str, Any]]) -> str:
        """One markdown bullet: the measured ratio and whether the goal is met."""
        what = "step time" if self.metric == "time" else "peak RSS"
        bound = f"{'<' if self.strict else '<='} {self.limit:g}x"
        text = f"{label(self.impl)} {what} / {label(self.other)}: "
        if self.impl not in results or self.other not in results:
            return f"- {text}not measured (goal {bound})"

        def value(impl: str) -> float:
            res = results[impl]
            return res["median_step_s"] if self.metric == "time" else max(res["peak_rss_mb"])

        ratio = value(self.impl) / value(self.other)
        met = ratio < self.limit if self.strict else ratio <= self.limit
        return f"- {text}{ratio:.3f}x (goal {bound}): {'met' if met else 'NOT met'}"


def suite_goals(name: str) -> list[Goal]:
    """The issue's goals for a suite."""
    if name == "zero12":
        goals = []
        for s in ("1", "2"):
            goals.append(Goal(f"partita-{s}", "partita-0", "time", 1.03, strict=False))
            goals.append(Goal(f"partita-{s}", f"deepspeed-{s}", "time", 1.0, strict=True))
            goals += [Goal(f"partita-{s}", p, "rss", 1.0, True) for p in SUITES[name].peers]
        return goals
    if name == "offload":
        return []  # the issue asks for the figures, with no target
    return [
        Goal("partita-3", FSDP2, "time", 1.0, strict=True),
        Goal("partita-3", "deepspeed-3", "time", 1.0, strict=True),
        Goal("partita-3", "partita-0", "time", 1.1, strict=False),
        Goal("partita-3", FSDP2, "rss", 1.0, strict=True),
        Goal("partita-3", "deepspeed-3", "rss", 1.0, strict=True),
    ]


def loss_check(
    results: dict[str, dict[str, Any]], reference: str
) -> tuple[dict[str, Any], list[str]]:
    """Per configuration, the first step's and the largest per-step loss gap from
    ``reference``; and a warning line for each gap above `LOSS_GAP_WARN`."""
    if reference not in results:
        return {}, []
    ref = results[reference]["losses"]
    gaps, warnings = {}, []
    for impl, res in results.items():
        diffs = [abs(a - b) for a, b in zip(res["losses"], ref, strict=True)]
        gaps[impl] = {"first_step": diffs[0], "max": max(diffs)}
        if max(diffs) > LOSS_GAP_WARN:
            warnings.append(
                f"WARNING: {label(impl)}: losses differ from {label(reference)} by up to "
                f"{max(diffs):.2e} (first step: {diffs[0]:.2e})"
            )
    return gaps, warnings


def stage3_note(results: dict[str, dict[str, Any]], threshold: int) -> str:
    """What partita's stage 3 kept persistent, as a markdown paragraph ('' if it did not run)."""
    layout = results.get("partita-3", {}).get("stage3")
    if not layout:
        return ""
    share = layout["persistent_numel"] / results["partita-3"]["params"]
    return (
        f"partita stage 3: {layout['units']} sharded units; with "
        f"stage3_param_persistence_threshold={threshold:,}, {layout['persistent_count']} "
        f"parameters ({layout['persistent_numel']:,} elements, {share:.1%} of the model) stay "
        f"gathered: {', '.join(layout['persistent_patterns'])}.\n"
    )


def suite_title(args: argparse.Namespace, suite: Suite, params: int | None) -> str:
    """The table's heading: what ran, on what, how measured."""
    shown = f"{params:,}" if params else "?"
    return (
        f"{suite.title}, GPT-2 {args.model} ({shown} parameters), {args.nprocs} CPU processes x "
        f"{args.threads} threads, micro-batch {args.micro_batch} x {args.seq_len} tokens, "
        f"{'bf16 (fp32 masters)' if args.bf16 else 'fp32'}, "
        f"median of {args.steps} steps after {args.warmup} warm-up"
        + (f", x {args.rounds} interleaved rounds" if args.rounds > 1 else "")
    )


def report_suite(
    args: argparse.Namespace,
    name: str,
    impls: list[str],
    done: dict[str, Any],
    errors: dict[str, str],
) -> None:
    """Print and save one suite's table, goals and loss check."""
    suite = SUITES[name]
    results = {i: done[i] for i in impls if done.get(i) is not None}
    rows = [
        common.Row(label(i), results.get(i), "failed (error in the JSON)" if f"{i}@{args.nprocs}"
                   in errors else available(i) or "", is_peer=i in suite.peers)
        for i in impls
    ]  # fmt: skip
    reference = suite.reference if suite.reference in results else "partita-0"
    gaps, warnings = loss_check(results, reference)
    params = next((r["params"] for r in results.values()), None)
    markdown = common.render_markdown(
        rows, rss_reference=label(suite.reference), title=suite_title(args, suite, params),
        time_reference=label("partita-0" if "partita-0" in impls else suite.reference),
        extra_columns=[("partita model states per rank (MB)", show_model_states),
                       ("step-1 loss", show_first_loss), common.FAULTS_COLUMN],
    )  # fmt: skip
    note = stage3_note(results, args.persistence_threshold)
    markdown += f"\n{note}" if note else ""
    goals = suite_goals(name)
    if goals:
        markdown += "\nGoals (median step time; peak RSS of the largest rank):\n\n"
        markdown += "\n".join(g.check(results) for g in goals) + "\n"
    print("\n" + markdown)
    for line in warnings:
        print(line)
    payload = {
        "benchmark": name, "args": jsonable(vars(args)), "environment": common.environment(),
        "rows": [{"key": i, "name": label(i), "peer": i in suite.peers, "result": results.get(i)}
                 for i in impls],
        "loss_reference": reference, "loss_gaps": gaps,
        "errors": {k: v for k, v in errors.items() if k.rsplit("@", 1)[0] in impls},
    }  # fmt: skip
    stem = f"{name}_{args.model}" + ("_bf16" if args.bf16 else "")
    paths = common.write_results(stem, markdown, payload, args.results_dir)
    print(f"wrote {paths[0]} and {paths[1]}")


def jsonable(values: dict[str, Any]) -> dict[str, Any]:
    """``vars(args)`` with paths as strings."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


# --- world-size sweep ------------------------------------------------------------------------


def theory_bytes(stage: int, psi: int, world: int) -> float:
    """ZeRO's model-state bytes per rank for an fp32 model with AdamW and fp32 master shards:
    params 4, grads 4, master 4 (stage 0: none, the optimizer steps the module's weights) and
    Adam moments 8 bytes per parameter; stage 1 shards master and moments over ``world``,
    stage 2 also grads, stage 3 everything."""
    if stage == 0:
        return 16.0 * psi
    if stage == 1:
        return 8.0 * psi + 12.0 * psi / world
    if stage == 2:
        return 4.0 * psi + 16.0 * psi / world
    return 20.0 * psi / world


def sweep_row(stage: int, world: int, result: dict[str, Any] | None) -> str:
    """One markdown line of the sweep table."""
    if result is None:
        return f"| {stage} | {world} | failed |" + " |" * 9
    psi = result["params"]
    worst = max(range(world), key=lambda r: model_state_mb(result)[r])
    report = result["memory_report"][worst]
    measured = model_state_mb(result)[worst]
    theory = theory_bytes(stage, psi, world) / MB
    growth = max(
        p - b for p, b in zip(result["peak_rss_mb"], result["baseline_rss_mb"], strict=True)
    )
    parts = [report[k] / MB for k in (*MODEL_STATE_KEYS, "comm_buffers")]
    return (
        f"| {stage} | {world} | {max(result['peak_rss_mb']):.0f} | {growth:.0f} | {measured:.1f} "
        f"| {theory:.1f} | {measured / theory:.3f} | "
        + " | ".join(f"{v:.1f}" for v in parts)
        + " |"
    )


def run_sweep(args: argparse.Namespace) -> dict[str, str]:
    """partita's stages at each world size of ``--nprocs_sweep``: print and save the table."""
    worlds = [int(n) for n in args.nprocs_sweep.split(",")]
    stages = [int(s) for s in args.sweep_stages.split(",")]
    errors: dict[str, str] = {}
    runs: list[dict[str, Any]] = []
    for stage in stages:
        for world in worlds:
            threads = max(1, (os.cpu_count() or 1) // world)
            result = run_job(args, f"partita-{stage}", world, threads, errors)
            runs.append({"stage": stage, "nprocs": world, "threads": threads, "result": result})
    psi = next((r["result"]["params"] for r in runs if r["result"]), None)
    lines = [
        f"### partita model-state memory per rank against world size, GPT-2 {args.model} "
        f"({psi or 0:,} parameters), fp32, AdamW, {args.warmup + args.steps} steps",
        "",
        "Model states are the largest rank's memory_report (params + grads + master_params + "
        "optimizer_state, after the last step); theory: 16 bytes/param at stage 0, "
        "4+4+12/N at stage 1, 4+16/N at stage 2, 20/N at stage 3. RSS growth: peak RSS minus "
        "the RSS before the model was built.",
        "",
        "| stage | N | peak RSS (MB, max rank) | RSS growth (MB) | model states (MB) | theory (MB) "
        "| measured / theory | params | grads | master | optimizer state | comm buffers (peak) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [sweep_row(r["stage"], r["nprocs"], r["result"]) for r in runs]
    markdown = "\n".join(lines) + "\n"
    print("\n" + markdown)
    payload = {
        "benchmark": "zero_sweep", "args": jsonable(vars(args)),
        "environment": common.environment(), "runs": runs, "errors": errors,
    }  # fmt: skip
    paths = common.write_results(f"zero_sweep_{args.model}", markdown, payload, args.results_dir)
    print(f"wrote {paths[0]} and {paths[1]}")
    return errors


def main() -> None:
    """Run the requested suites (or the sweep), print the tables, save markdown and JSON."""
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.nprocs_sweep:
        sys.exit(1 if run_sweep(args) else 0)
    if args.check_pair:
        sys.exit(run_check_pair(args))
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        sys.exit(f"--suites: unknown {unknown}; choose from {list(SUITES)}")
    wanted = {i.strip() for i in args.impls.split(",")} if args.impls else None
    known = {i for s in SUITES.values() for i in s.impls}
    if wanted is not None and wanted - known:
        sys.exit(f"--impls: unknown {sorted(wanted - known)}; choose from {sorted(known)}")
    if args.bf16:
        peers = {i for name in suites for i in SUITES[name].impls if wanted is None or i in wanted}
        if peers & {DDP, FSDP2}:
            sys.exit(f"--bf16: the torch peers run fp32; choose --impls without {DDP}, {FSDP2}")
    runs: dict[str, list[dict[str, Any]]] = {}  # partita stage 0 runs once for both suites
    errors: dict[str, str] = {}
    for name in suites:
        impls = [i for i in SUITES[name].impls if wanted is None or i in wanted]
        todo = [i for i in impls if i not in runs and available(i) is None]
        runs.update(
            common.run_rounds(
                todo, args.rounds, lambda i: run_job(args, i, args.nprocs, args.threads, errors)
            )
        )
        done = {i: common.merge_rounds(r) if r else None for i, r in runs.items()}
        report_suite(args, name, impls, done, errors)
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
