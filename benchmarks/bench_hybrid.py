"""Hybrid sharding benchmark: partita's ``mics_shard_size`` against FSDP2's HSDP and DeepSpeed MiCS.

One 4-rank CPU job (gloo) per configuration, laid out as 2 "nodes" of 2 ranks: shard groups
{0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}. The same GPT-2 shape, data, AdamW and
clipping as the other training benchmarks (`common`). Configurations:

* ``partita-h3`` / ``partita-h2`` / ``partita-h1``: partita ZeRO stage 3 / 2 / 1 with
  ``mics_shard_size: 2``;
* ``fsdp2-hsdp``: FSDP2 ``fully_shard`` (per block, then the root) on a 2-D ``DeviceMesh`` of
  shape (2, 2), dims ("replicate", "shard"): torch's HSDP; ``AdamW(fused=True)``;
* ``deepspeed-mics``: DeepSpeed ZeRO stage 3 with ``mics_shard_size: 2`` (its MiCS); when
  DeepSpeed refuses it, its exact error is the row;
* ``deepspeed-z2``: DeepSpeed ZeRO stage 2 over all 4 ranks (flat, not hybrid), for reference;
* ``ddp``: PyTorch DDP with ``AdamW(fused=True)``, the unsharded baseline.

Reported per configuration: median step time after warm-up (a step's time is its slowest
rank's), peak RSS per rank, and the bytes each rank hands to ``torch.distributed`` per step,
split by the group they travel on: inside its shard group ("shard", the intra-node link),
across replicas ("replicate", the inter-node link) or over all 4 ranks ("world"). The bytes are
counted the same way for every configuration, by wrapping ``torch.distributed``'s collectives
in each worker before any engine is imported, with partita's payload convention
(`partita.comm.counters`): all-reduce and broadcast count their tensor, reduce-scatter its full
input, all-gather its full output. Functional collectives (DTensor's, which FSDP2's gradient
clipping uses for the norm: a few scalars) bypass those functions and are not counted. For
partita its own counters (``COUNTERS.bytes(group='dp_shard' / 'dp_replicate')``) are recorded
next to them as a cross-check. Example::

    .venv/bin/python benchmarks/bench_hybrid.py --steps 20

Writes ``benchmarks/results/hybrid_<model>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_hybrid)
    from benchmarks import common
    from benchmarks.bench_zero import (  # the same torch peers
        StepFn,
        fused_adamw,
        setup_ddp,
        torch_step,
    )
else:  # python benchmarks/bench_hybrid.py: this folder is sys.path[0]
    import common
    from bench_zero import StepFn, fused_adamw, setup_ddp, torch_step  # the same torch peers


# A GPT-2 of a few million parameters over byte tokens (the corpus is bytes): 6 blocks of 256.
common.MODEL_SHAPES.setdefault(
    "5m", {"n_layer": 6, "n_embd": 256, "n_head": 4, "n_positions": 128, "vocab_size": 256}
)

WORLD, SHARD = 4, 2
IMPLS: dict[str, str] = {
    "partita-h3": "partita stage 3, mics_shard_size 2",
    "partita-h2": "partita stage 2, mics_shard_size 2",
    "partita-h1": "partita stage 1, mics_shard_size 2",
    "fsdp2-hsdp": "FSDP2 HSDP (fully_shard, 2-D mesh 2x2) + AdamW(fused=True)",
    "deepspeed-mics": "DeepSpeed MiCS (stage 3, mics_shard_size 2)",
    "deepspeed-z2": "DeepSpeed stage 2 over 4 ranks (flat)",
    "ddp": "DDP + AdamW(fused=True)",
}
PEERS = ("fsdp2-hsdp", "deepspeed-mics", "deepspeed-z2", "ddp")
REFERENCE = "fsdp2-hsdp"


def parse_args() -> argparse.Namespace:
    """Orchestrator and worker arguments (the worker is this script under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(common.MODEL_SHAPES), default="5m")
    p.add_argument(
        "--impls", default=",".join(IMPLS), help="comma-separated subset of " + ", ".join(IMPLS)
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
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
    p.add_argument("--stem", help="results file stem (default hybrid_<model>)")
    p.add_argument("--worker", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--result_file", help=argparse.SUPPRESS)
    return p.parse_args()


# --- byte counting ---------------------------------------------------------------------------


class GroupBytes:
    """Bytes handed to ``torch.distributed`` collectives, by group kind, while ``on``.

    Installed over the module functions before any engine is imported (partita binds some of
    them at import). A collective that calls another (``_all_gather_base`` ->
    ``all_gather_into_tensor``) counts once: only the outermost call of a thread is counted."""

    # name -> (argument holding the payload, how it counts)
    OPS: ClassVar[dict[str, str]] = {
        "all_reduce": "tensor",
        "broadcast": "tensor",
        "all_gather_single": "output_tensor",
        "all_gather_into_tensor": "output_tensor",
        "_all_gather_base": "output_tensor",
        "all_gather": "tensor_list",
        "reduce_scatter_single": "input",
        "reduce_scatter_tensor": "input",
        "_reduce_scatter_base": "input",
        "reduce_scatter": "input_list",
        "all_to_all_single": "input",
        "send": "tensor",
        "isend": "tensor",
    }
    # Bytes one rank sends on its links per byte of payload, for a ring over n ranks (the
    # point-to-point sends, which partita uses inside 2-rank groups on gloo, count as sent).
    SENT: ClassVar[dict[str, Callable[[int], float]]] = {
        "all_reduce": lambda n: 2 * (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n,
        "all_to_all": lambda n: (n - 1) / n,
    }

    def __init__(self) -> None:
        self.on = False
        self.bytes: dict[str, int] = defaultdict(int)
        self.by_op: dict[str, int] = defaultdict(int)
        self.sent: dict[str, float] = defaultdict(float)
        self._local = threading.local()

    def kind(self, group: Any) -> tuple[str, int]:
        """('shard' | 'replicate' | 'world' | 'other', its size) for ``group``."""
        import torch.distributed as dist

        ranks = sorted(dist.get_process_group_ranks(group or dist.group.WORLD))
        return self._kind(ranks), len(ranks)

    def _kind(self, ranks: list[int]) -> str:
        import torch.distributed as dist

        me = dist.get_rank()
        if len(ranks) == dist.get_world_size():
            return "world"
        if ranks == [me // SHARD * SHARD + i for i in range(SHARD)]:
            return "shard"
        if ranks == list(range(me % SHARD, dist.get_world_size(), SHARD)):
            return "replicate"
        return "other"

    def install(self) -> None:
        """Wrap every function of `OPS` in torch.distributed and its c10d module."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, payload in self.OPS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original, payload)
            for module in (dist, c10d):
                if hasattr(module, name):
                    setattr(module, name, wrapped)

    def _wrap(self, name: str, original: Callable[..., Any], payload: str) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if self.on and depth == 0:
                bound = signature.bind(*args, **kwargs)
                value = bound.arguments.get(payload)
                tensors = value if isinstance(value, list | tuple) else [value]
                nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
                where, size = self.kind(bound.arguments.get("group"))
                self.bytes[where] += nbytes
                self.by_op[f"{where}/{name}"] += nbytes
                family = next((f for f in self.SENT if name.lstrip("_").startswith(f)), "")
                self.sent[where] += nbytes * (self.SENT[family](size) if family else 1)
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapped

    def snapshot(self) -> dict[str, float]:
        """Payload bytes ``payload/<kind>`` and estimated sent bytes ``sent/<kind>`` so far."""
        return {**{f"payload/{k}": v for k, v in self.bytes.items()},
                **{f"sent/{k}": v for k, v in self.sent.items()}}  # fmt: skip


BYTES = GroupBytes()


# --- worker ----------------------------------------------------------------------------------


def setup_hsdp(model: torch.nn.Module) -> tuple[StepFn, dict[str, Any]]:
    """FSDP2 HSDP: a (replicate, shard) mesh of (2, 2); fully_shard per block, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD // SHARD, SHARD), mesh_dim_names=("replicate", "shard"))
    for block in cast(torch.nn.ModuleList, model.get_submodule("transformer.h")):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fused_adamw(model.parameters())
    return torch_step(model, model, opt), {"optimizer": "AdamW(fused=True)"}


def engine_config(impl: str, micro_batch: int) -> dict[str, Any]:
    """The DeepSpeed-style config of an engine configuration."""
    if impl == "deepspeed-z2":
        return common.ds_config(micro_batch, 2)
    stage = {"partita-h3": 3, "partita-h2": 2, "partita-h1": 1, "deepspeed-mics": 3}[impl]
    config = common.ds_config(micro_batch, stage)
    config["zero_optimization"]["mics_shard_size"] = SHARD
    return config


def setup_engine(impl: str, model: torch.nn.Module, micro_batch: int) -> tuple[StepFn, dict]:
    backend = impl.split("-")[0]
    engine_lib = importlib.import_module(backend)
    engine, optimizer, _, _ = engine_lib.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(impl, micro_batch)
    )

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = engine(batch.to(engine.device), labels=batch.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"optimizer": type(optimizer).__name__}


def partita_group_bytes() -> dict[str, int]:
    """partita's own per-group counters (zero when partita is not loaded)."""
    if "partita" not in sys.modules:
        return {}
    from partita import comm

    return {g: comm.COUNTERS.bytes(group=g) for g in ("dp_shard", "dp_replicate")}


def _setup_or_exit(
    args: argparse.Namespace, model: torch.nn.Module, rank: int
) -> tuple[StepFn, dict[str, Any]]:
    """The configuration's step function and extra fields; a configuration the library refuses
    ends the worker with its error as the row (written by rank 0)."""
    try:
        if args.worker == "ddp":
            return setup_ddp(model)
        if args.worker == "fsdp2-hsdp":
            return setup_hsdp(model)
        return setup_engine(args.worker, model, args.micro_batch)
    except Exception as exc:
        if rank == 0:
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            Path(args.result_file).write_text(json.dumps({"error": error}))
        sys.stdout.flush()
        os._exit(0)


def worker(args: argparse.Namespace) -> None:
    """One configuration on one rank: build, time, count bytes, (rank 0) write the result."""
    torch.set_num_threads(args.threads)
    BYTES.install()  # before partita or DeepSpeed bind torch.distributed's functions
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != WORLD:
        raise SystemExit(f"bench_hybrid: needs {WORLD} ranks, got {world}")
    backend = args.worker.split("-")[0]
    if backend in ("partita", "deepspeed"):
        importlib.import_module(backend)  # first, as training scripts do
    baseline = common.peak_rss_mb()
    model = common.build_gpt2(args.model, args.seed)
    params = common.count_params(model)
    step, extra = _setup_or_exit(args, model, rank)
    per_step: list[dict[str, float]] = []
    own_per_step: list[dict[str, int]] = []

    def counted(batch: torch.Tensor) -> torch.Tensor:
        before, own_before = BYTES.snapshot(), partita_group_bytes()
        BYTES.on = True
        try:
            loss = step(batch)
        finally:
            BYTES.on = False
        after, own_after = BYTES.snapshot(), partita_group_bytes()
        per_step.append({k: v - before.get(k, 0) for k, v in after.items()})
        own_per_step.append({k: v - own_before.get(k, 0) for k, v in own_after.items()})
        return loss

    batches = common.corpus_batches(rank, world, args.micro_batch, args.seq_len)
    times, losses, faults = common.time_steps(counted, batches, args.warmup, args.steps)
    last = per_step[-1]  # a timed step; every timed step moves the same bytes
    source = "counted (torch.distributed wrapped)"
    if args.worker == "ddp":  # DDP's C++ reducer calls the process group, not these functions
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        last = {"payload/world": float(grads), "sent/world": grads * 2 * (world - 1) / world}
        source = "computed: DDP all-reduces every gradient over the 4 ranks once per step"
    extra.update(
        params=params,
        bytes_per_step=last,
        bytes_by_op_total=dict(BYTES.by_op),
        bytes_steps_equal=all(s == per_step[-1] for s in per_step[args.warmup :]),
        bytes_source=source,
        partita_counters_per_step=own_per_step[-1],
    )
    ranks = [None] * world
    import torch.distributed as dist

    dist.all_gather_object(ranks, last)
    extra["bytes_per_step_by_rank"] = ranks
    result = common.collect_result(times, losses, baseline, extra, faults)
    if result is not None:
        Path(args.result_file).write_text(json.dumps(result))
    common.exit_worker()


# --- orchestrator ----------------------------------------------------------------------------


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def link_bytes(result: dict[str, Any], where: str) -> float:
    """Largest rank's bytes sent per step on ``where`` links (ring estimate, `GroupBytes`)."""
    return max(r.get(f"sent/{where}", 0) for r in result["bytes_per_step_by_rank"])


def columns(reference: dict[str, Any] | None) -> list[common.Column]:
    """Bytes per step per rank inside the shard group, across replicas, over all ranks, and the
    cross-replica bytes against FSDP2 HSDP's."""

    def cross(res: dict[str, Any]) -> float:  # a collective over all 4 ranks crosses too
        return link_bytes(res, "replicate") + link_bytes(res, "world")

    ref_cross = cross(reference) if reference else 0

    def vs_ref(res: dict[str, Any]) -> str:
        return f"{cross(res) / ref_cross:.2f}x" if ref_cross else "-"

    return [
        ("MB sent/step in shard group", lambda r: mb(link_bytes(r, "shard"))),
        ("MB sent/step across replicas", lambda r: mb(link_bytes(r, "replicate"))),
        ("MB sent/step over all 4 ranks", lambda r: mb(link_bytes(r, "world"))),
        (f"cross-node MB vs {IMPLS[REFERENCE].split(' (')[0]}", vs_ref),
    ]


def run_job(args: argparse.Namespace, impl: str, shared: list[str]) -> tuple[Any, str]:
    """(result, note): the job's result, or None and why."""
    print(f"running {IMPLS[impl]} ...", flush=True)
    try:
        result = common.launch_job(
            Path(__file__).resolve(), ["--worker", impl, *shared], WORLD, args.threads,
            args.job_timeout,
        )  # fmt: skip
    except Exception as exc:
        print(f"  FAILED:\n{exc}", file=sys.stderr, flush=True)
        return None, f"failed: {str(exc)[-300:]}"
    if "error" in result:
        print(f"  refused: {result['error']}", flush=True)
        return None, f"refused at initialize: {result['error']}"
    print(f"  median step {result['median_step_s'] * 1e3:.1f} ms, peak RSS "
          f"{[round(m) for m in result['peak_rss_mb']]} MB, bytes/step {result['bytes_per_step']}",
          flush=True)  # fmt: skip
    return result, ""


def own_counter_lines(rows: list[common.Row]) -> str:
    """Markdown lines with partita's own per-group counters of each row that has them."""
    own = [
        f"- {r.name}: partita's own counters per step: "
        + ", ".join(f"{g} {mb(v)} MB" for g, v in r.result["partita_counters_per_step"].items())
        for r in rows
        if r.result and r.result.get("partita_counters_per_step")
    ]
    return "\n" + "\n".join(own) + "\n" if own else ""


def main() -> None:
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
    notes: dict[str, str] = {}

    def run_one(impl: str) -> dict[str, Any] | None:
        result, notes[impl] = run_job(args, impl, shared)
        return result

    runs = common.run_rounds(impls, args.rounds, run_one)
    rows = []
    for impl in impls:
        label = IMPLS[impl]
        if impl.startswith("deepspeed"):
            label = label.replace("DeepSpeed", f"DeepSpeed {common.environment()['deepspeed']}")
        merged = common.merge_rounds(runs[impl]) if runs[impl] else None
        rows.append(common.Row(label, merged, notes.get(impl, ""), is_peer=impl in PEERS))
    by_impl = dict(zip(impls, rows, strict=True))
    reference = by_impl[REFERENCE].result if REFERENCE in by_impl else None
    params = next((r.result["params"] for r in rows if r.result), None)
    title = (
        f"Hybrid sharding, GPT-2 {args.model} ({params:,} parameters), {WORLD} CPU processes "
        f"(2 shard groups of {SHARD}) x {args.threads} thread, micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens, fp32, median of {args.steps} steps after {args.warmup} warm-up"
        + (f", x {args.rounds} interleaved rounds" if args.rounds > 1 else "")
    )
    ref_label = IMPLS[REFERENCE]
    markdown = common.render_markdown(
        rows, rss_reference=ref_label, title=title, time_reference=ref_label,
        extra_columns=columns(reference),
    )  # fmt: skip
    markdown += own_counter_lines(rows)
    print("\n" + markdown)
    gaps = common.loss_gaps(rows, reference=IMPLS["ddp"])
    payload = {
        "benchmark": "hybrid",
        "command": " ".join([".venv/bin/python", "benchmarks/bench_hybrid.py", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": common.environment(),
        "rows": [{"name": r.name, "note": r.note, "peer": r.is_peer, "result": r.result} for r in rows],
        "max_loss_gap_vs_ddp": gaps,
    }  # fmt: skip
    md_path, json_path = common.write_results(
        args.stem or f"hybrid_{args.model}", markdown, payload, args.results_dir
    )
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
