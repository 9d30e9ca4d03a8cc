"""Long-sequence benchmark: partita's Ulysses against DeepSpeed's ALST, the longest sequence that
trains under one memory cap, and the step time at a length both train.

One 4-rank CPU job (gloo) per (library, sequence length), the same training script for both:
DeepSpeed's Arctic Long Sequence Training recipe as its tutorial and ArcticTraining write it. A
Hugging Face ``LlamaForCausalLM`` built from a config (tiny width, realistic depth, Llama 2's
32,000-token vocabulary, untied head, random weights, nothing downloaded, SDPA attention) with

* ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, ...)`` -> the mpu,
  ``initialize(..., mpu=mpu)``, ``UlyssesSPDataLoaderAdapter`` over a plain DataLoader;
* ``LlamaMLP.forward`` replaced by ``TiledMLP`` (the docstring's ``tiled_mlp_forward``:
  ceil(seqlen / hidden) shards, agreed by an all-reduce of the maximum);
* the loss of ArcticTraining's SFT trainer: the decoder's hidden states into
  ``TiledFusedLogitsLoss`` (logits never whole; ~1 GiB of fp32 logits per shard, its "auto"),
  the slices' losses averaged over the sequence group by a differentiable all-gather weighted
  by their tokens;
* Hugging Face activation checkpointing (``gradient_checkpointing_enable()``), ZeRO stage 3,
  AdamW, fp32 (bf16 matmuls are not what either library's CPU path is tuned for).

partita runs it through ``partita.compat.deepspeed`` (``import partita as deepspeed``), DeepSpeed
as written (``DS_ACCELERATOR=cpu``). Nothing was adapted for CPU beyond that: SDPA is one of the
attention implementations ALST names, and on CPU without a mask it is torch's flash kernel.

**Memory cap.** A length *fits* when every one of ``--search_steps`` training steps completes
and the sum over the 4 ranks of each rank's peak resident memory above its own baseline (VmHWM
at the end minus VmRSS after importing torch, Transformers and the library, before the model is
built: what a GPU's memory would hold, not the interpreter and libraries) stays at or under
``--cap_mb``. Both libraries run the same jobs and the same test; no process is killed or limited
(cgroups are the machinery's here, not ours). The whole-process peaks are reported too.

**Search.** Lengths are multiples of ``--multiple`` (sp x 64 by default: the adapter needs sp,
SDPA's flash kernel blocks of 64). From ``--start_len`` the length doubles while it fits, then
the gap is bisected down to ``--resolution`` (or one multiple). A job that fails (out of memory,
a crash, ``--job_timeout``) counts as not fitting, with its reason recorded.

**Step time** at a shared length (``--shared_len``, default: the longest length both fit;
``--timing_only`` skips the search): ``--warmup`` untimed then ``--steps`` timed steps per job,
``--rounds`` interleaved jobs. **All-to-all bytes** per layer and step, each rank, counted by
wrapping ``torch.distributed``'s functions before either library is imported (as
``bench_hybrid.py`` does), in the forward and in the backward (which under activation
checkpointing recomputes the forward: 2x), against the model's 4 x B x S x H / sp elements
(query, key, value and the output, each all-to-all's full input) x 4 bytes. Example::

    .venv/bin/python benchmarks/bench_sequence.py            # ~20 min on 2 cores
    .venv/bin/python benchmarks/bench_sequence.py --quick    # smoke run, ~4 min
    .venv/bin/python benchmarks/bench_sequence.py --timing_only --shared_len 6144 --rounds 2
    .venv/bin/python benchmarks/bench_sequence.py --from_json RUN.json   # its tables again

Writes ``benchmarks/results/sequence_<stem>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks...)
    from benchmarks import common
    from benchmarks.bench_hybrid import BYTES
else:  # python benchmarks/bench_sequence.py: this folder is sys.path[0]
    import common
    from bench_hybrid import BYTES


WORLD = 4
IMPLS: dict[str, str] = {
    "partita": "partita (import partita as deepspeed)",
    "deepspeed": "DeepSpeed ALST",
}
MODULES = {"partita": "partita.compat.deepspeed", "deepspeed": "deepspeed"}
FP32 = 4  # bytes per element: the benchmark trains in fp32
QUICK = {
    "layers": 4, "start_len": 1024, "max_len": 4096, "cap_mb": 2000.0, "search_steps": 1,
    "steps": 2, "warmup": 1, "resolution": 1024,
}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Orchestrator and worker arguments (the worker is this script under torchrun);
    ``--quick`` overrides the sizes with `QUICK`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset")
    p.add_argument("--sp", type=int, default=4, help="sequence-parallel size (divides 4)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=384, help="MLP width")
    p.add_argument("--heads", type=int, default=4, help="attention and key/value heads")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage")
    p.add_argument("--logits_shard_mb", type=float, default=1024.0,
                   help="fp32 logits per TiledFusedLogitsLoss shard (ArcticTraining: 1 GiB)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--cap_mb", type=float, default=6000.0,
                   help="memory cap: summed peak RSS above baseline over the 4 ranks, MB")  # fmt: skip
    p.add_argument("--start_len", type=int, default=4096, help="first length of the search")
    p.add_argument("--max_len", type=int, default=131072, help="longest length tried")
    p.add_argument("--multiple", type=int, default=0, help="lengths step (0: sp x 64)")
    p.add_argument("--resolution", type=int, default=1024, help="bisect until the gap is this")
    p.add_argument("--search_steps", type=int, default=2, help="steps a length must train")
    p.add_argument("--shared_len", type=int, default=0, help="step-time length (0: derived)")
    p.add_argument("--timing_only", action="store_true", help="no search: time --shared_len")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of a timing job")
    p.add_argument("--steps", type=int, default=3, help="timed steps of a timing job")
    p.add_argument("--rounds", type=int, default=1, help="timing jobs per library, in turn")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--job_timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--results_dir", type=Path, default=common.RESULTS_DIR, help="where to write")
    p.add_argument("--stem", help="results file stem (default sequence_sp<sp>_h<hidden>_l<layers>)")
    p.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    p.add_argument("--from_json", type=Path, help="only re-render a run's .json as markdown")
    p.add_argument("--worker", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--seq_len", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result_file", help=argparse.SUPPRESS)
    p.add_argument("--base_dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and not args.worker:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if not args.multiple:
        args.multiple = args.sp * 64
    return args


# --- pure helpers (tests/test_bench_sequence.py) ---------------------------------------------


def a2a_formula_bytes(batch: int, seq_len: int, hidden: int, sp: int, elem: int = FP32) -> int:
    """The model's all-to-all payload per layer, one way (forward, or the gradients back), on
    each rank: query, key, value and the attention output, each ``B x S x H / sp`` elements
    (key and value as wide as the query: no grouped heads), each all-to-all counted by its full
    input as `bench_hybrid.GroupBytes` counts it."""
    return 4 * batch * seq_len * hidden // sp * elem


def round_down(length: int, multiple: int) -> int:
    """`length` rounded down to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, length // multiple * multiple)


def search_longest(
    fits: Callable[[int], bool], start: int, limit: int, multiple: int, resolution: int
) -> tuple[int, list[tuple[int, bool]]]:
    """The longest length (a multiple of `multiple`, at most `limit`) for which `fits` holds,
    assuming that it holds up to some length and not beyond: double from `start` while it
    fits, then bisect the gap until it is at most `resolution` (or one `multiple`). Returns
    (longest, 0 when even `start` does not fit; every (length, fitted) tried, in order)."""
    tried: list[tuple[int, bool]] = []

    def probe(length: int) -> bool:
        ok = fits(length)
        tried.append((length, ok))
        return ok

    start, limit = round_down(start, multiple), round_down(limit, multiple)
    lo, length = 0, min(start, limit)  # lo: the longest that fitted so far (0: none)
    while probe(length):
        lo = length
        if length >= limit:
            return lo, tried
        length = min(limit, length * 2)
    hi = length  # the shortest that did not fit
    while hi - lo > max(resolution, multiple):
        mid = round_down((lo + hi) // 2, multiple)
        if not lo < mid < hi:
            break
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def shared_length(longest: Sequence[int], multiple: int) -> int:
    """The step-time length: the longest length every library fit (0 when one fit nothing)."""
    if not longest or min(longest) < multiple:
        return 0
    return round_down(min(longest), multiple)


def above_baseline_mb(result: dict[str, Any]) -> list[float]:
    """Each rank's peak resident memory above its baseline (after imports), MB."""
    return [
        peak - base
        for peak, base in zip(result["peak_rss_mb"], result["baseline_rss_mb"], strict=True)
    ]


def fits_cap(result: dict[str, Any] | None, cap_mb: float) -> bool:
    """Whether a finished job stayed under the cap (summed peaks above baseline)."""
    return result is not None and "error" not in result and sum(above_baseline_mb(result)) <= cap_mb


# --- worker: the training script -------------------------------------------------------------


def vm_status_mb(field: str) -> float:
    """A ``VmRSS`` / ``VmHWM``-style field of /proc/self/status, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return common.peak_rss_mb()  # not Linux: ru_maxrss


def patch_tiled_mlp(ds_ulysses: Any) -> None:
    """``LlamaMLP.forward`` as ``TiledMLP``'s docstring writes it (before the model is built)."""
    import torch.distributed as dist
    from transformers.models.llama import modeling_llama

    def tiled_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        _bs, seqlen, hidden = x.shape
        num_shards = math.ceil(seqlen / hidden)
        # to avoid deadlocks get all ranks to agree on the same num_shards by using the max value
        tensor = torch.tensor(num_shards, device=x.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        num_shards = tensor.item()
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

        def mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return ds_ulysses.TiledMLP.apply(mlp_forward, self, x, num_shards, compute_params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward


def build_llama(args: argparse.Namespace) -> torch.nn.Module:
    """The tiny-width, realistic-depth Llama: random weights, SDPA, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=max(args.seq_len, 2048),
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def sp_loss(
    model: Any, batch: dict[str, torch.Tensor], sp_group: Any, ds_ulysses: Any, shard_mb: float
) -> Any:
    """ArcticTraining's Ulysses loss: hidden states -> ``TiledFusedLogitsLoss`` (sum over this
    slice's tokens) -> this slice's mean -> the group's mean weighted by tokens, through a
    differentiable all-gather."""
    import torch.distributed.nn.functional as dist_nn

    shift_labels = batch["shift_labels"]
    out = model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    )
    hidden_states = out.last_hidden_state
    vocab = model.config.vocab_size
    # ArcticTraining's "auto": about 1 GiB (shard_mb) of fp32 logits per shard
    shards = max(1, math.ceil(shift_labels.numel() * vocab * FP32 / (shard_mb * 2**20)))

    def fused_logits_loss_fn(model_with_head: Any, hidden: Any, labels: Any) -> Any:
        logits = model_with_head.lm_head(hidden)
        if (labels == -100).all():
            return (logits.sum() * 0.0).float()
        good_items = (labels != -100).sum()
        loss = model_with_head.loss_function(
            logits=logits, labels=None, vocab_size=vocab, shift_labels=labels
        )
        return loss * good_items

    total = ds_ulysses.TiledFusedLogitsLoss.apply(
        fused_logits_loss_fn, model, hidden_states, shift_labels, None, shards,
        [model.lm_head.weight], "sum",
    )  # fmt: skip
    good = (shift_labels != -100).sum()
    loss = total / good
    losses = dist_nn.all_gather(loss, group=sp_group)
    goods = dist_nn.all_gather(good, group=sp_group)
    summed = sum(lo * g for lo, g in zip(losses, goods, strict=True) if g > 0)
    return summed / max(sum(goods), 1)


def samples(args: argparse.Namespace, count: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's `count` random sequences of ``--seq_len`` tokens (seeded per rank)."""
    gen = torch.Generator().manual_seed(args.seed + rank)
    out = []
    for _ in range(count):
        ids = torch.randint(0, args.vocab, (args.seq_len,), generator=gen)
        out.append(
            {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(len(ids))}
        )
    return out


class PhaseBytes:
    """All-to-all (and all) payload of each step's forward and backward, from `BYTES`."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._marks: dict[str, dict[str, int]] = {}

    @staticmethod
    def _now() -> dict[str, int]:
        a2a = sum(v for k, v in BYTES.by_op.items() if "all_to_all" in k)
        return {"a2a": a2a, "all": sum(BYTES.by_op.values())}

    def mark(self, name: str) -> None:
        self._marks[name] = self._now()

    def close_step(self) -> None:
        m = self._marks
        self.steps.append({
            "a2a_forward": m["fwd"]["a2a"] - m["start"]["a2a"],
            "a2a_backward": m["bwd"]["a2a"] - m["fwd"]["a2a"],
            "all_payload": m["end"]["all"] - m["start"]["all"],
        })  # fmt: skip


def _error_exit(args: argparse.Namespace, rank: int, exc: BaseException) -> None:
    """End this rank at once on an error (the other ranks may wait in a collective it will
    never join: torchrun ends them when it sees the exit status), its traceback on stderr."""
    traceback.print_exception(exc)
    if rank == 0:
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        Path(args.result_file).write_text(json.dumps({"error": error}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def worker(args: argparse.Namespace) -> None:
    """One library at one length on one rank: train ``--warmup + --steps`` steps, count bytes,
    measure memory, (rank 0) write the result."""
    torch.set_num_threads(args.threads)
    BYTES.install()  # before either library binds torch.distributed's functions
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds = importlib.import_module(MODULES[args.worker])
    ulysses = importlib.import_module(
        MODULES[args.worker] + ".runtime.sequence_parallel.ulysses_sp"
    )
    import torch.distributed as dist
    import transformers  # noqa: F401  (in the baseline, as the script imports it)
    from torch.utils.data import DataLoader  # noqa: F401  (in the baseline too)

    baseline = vm_status_mb("VmRSS")
    if args.base_dir:  # for the orchestrator's watch of the cap
        Path(args.base_dir, f"{os.getpid()}.base").write_text(str(baseline))
    ds.init_distributed(dist_backend="gloo")
    try:
        engine, optimizer, group, loader, params = _alst_setup(args, ds, ulysses, rank)
    except Exception as exc:
        _error_exit(args, rank, exc)
        return
    phases = PhaseBytes()

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        phases.mark("start")
        BYTES.on = True
        try:
            loss = sp_loss(engine.module, batch, group, ulysses, args.logits_shard_mb)
            phases.mark("fwd")
            engine.backward(loss)
            phases.mark("bwd")
            engine.step()
        finally:
            BYTES.on = False
        phases.mark("end")
        phases.close_step()
        return loss

    try:
        times, losses, faults = common.time_steps(step, loader, args.warmup, args.steps)
    except Exception as exc:
        _error_exit(args, rank, exc)
        return
    mine = {"peak": vm_status_mb("VmHWM"), "bytes": phases.steps[-1]}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    extra = {
        "seq_len": args.seq_len,
        "params": params,
        "optimizer": type(optimizer).__name__,
        "bytes_per_step_by_rank": [e["bytes"] for e in every],
        "vm_hwm_mb": [e["peak"] for e in every],
    }
    result = common.collect_result(times, losses, baseline, extra, faults)
    if result is not None:
        result["peak_rss_mb"] = result.pop("vm_hwm_mb")  # VmHWM: this process's own mm only
        Path(args.result_file).write_text(json.dumps(result))
    common.exit_worker()


def _alst_setup(args: argparse.Namespace, ds: Any, ulysses: Any, rank: int) -> tuple[Any, ...]:
    """The ALST recipe as DeepSpeed's docs write it: the tiled MLP, the model with gradient
    checkpointing, `register_with_transformers`, `initialize` with its mpu, the data-loader
    adapter. Returns (engine, optimizer, sequence group, loader, parameter count)."""
    from torch.utils.data import DataLoader

    patch_tiled_mlp(ulysses)
    model = build_llama(args)
    params = common.count_params(model)  # before ZeRO 3 empties the parameters
    model.gradient_checkpointing_enable()
    mpu = ulysses.UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa",
        sequence_parallel_size=args.sp, micro_batch_size=1, seq_length=args.seq_len,
        seq_length_is_variable=True,
    )  # fmt: skip
    config = common.ds_config(1, args.stage)
    engine, optimizer, _, _ = ds.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=mpu
    )
    group = mpu.get_sequence_parallel_group()
    loader = ulysses.UlyssesSPDataLoaderAdapter(
        DataLoader(samples(args, args.warmup + args.steps, rank), batch_size=1),
        sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
        sp_world_size=mpu.get_sequence_parallel_world_size(), device=engine.device,
    )  # fmt: skip
    return engine, optimizer, group, loader, params


# --- orchestrator ----------------------------------------------------------------------------


def _watch_mb(base_dir: Path) -> float | None:
    """Summed resident memory above baseline of the workers that wrote their baseline
    (None until all `WORLD` did, or when one has ended)."""
    import psutil

    bases = list(base_dir.glob("*.base"))
    if len(bases) < WORLD:
        return None
    total = 0.0
    for path in bases:
        try:
            rss = psutil.Process(int(path.stem)).memory_info().rss / 2**20
        except (psutil.Error, ValueError):
            return None
        total += rss - float(path.read_text() or 0)
    return total


def launch_capped(
    args: argparse.Namespace, worker_args: Sequence[str], cap_mb: float | None
) -> dict[str, Any]:
    """One torchrun job of this script (``--worker ...``): its rank 0's result, or
    ``{"error": why}`` when it failed, timed out or (with `cap_mb`) was stopped because its
    ranks' summed memory above baseline passed the cap: a length over the cap needs no more
    steps to be known not to fit, and the same watch stops both libraries."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={WORLD}", str(Path(__file__).resolve()),
            "--result_file", str(result_file), "--base_dir", tmp, *worker_args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": "",
               "DS_ACCELERATOR": "cpu"}  # fmt: skip
        log, load_before = Path(tmp) / "log.txt", os.getloadavg()[0]
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, env=env, cwd=common.ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            stopped, start = "", time.monotonic()
            while proc.poll() is None:
                seen = _watch_mb(Path(tmp)) if cap_mb is not None else None
                if seen is not None and seen > cap_mb:  # type: ignore[operator]
                    stopped = f"over the cap: {seen:.0f} MB above baseline (cap {cap_mb:.0f})"
                elif time.monotonic() - start > args.job_timeout:
                    stopped = f"timed out after {args.job_timeout:.0f} s"
                if stopped:
                    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: ours
                    proc.wait()
                    break
                time.sleep(0.5)
        load = [load_before, os.getloadavg()[0]]  # the 1-minute load, before and after
        if stopped:
            return {"error": stopped, "stopped": True, "load": load}
        if proc.returncode != 0 or not result_file.exists():
            text = log.read_text()
            first = next(
                (ln for ln in text.splitlines() if re.match(r"\w+(Error|Exception): ", ln)), ""
            )
            return {"error": f"exited {proc.returncode}: {first}\n{text[-3000:]}", "load": load}
        return {**json.loads(result_file.read_text()), "load": load}


def worker_args(
    args: argparse.Namespace, impl: str, seq_len: int, warmup: int, steps: int
) -> list[str]:
    """The worker command line of `impl` at `seq_len`."""
    keys = ("sp", "hidden", "ffn", "heads", "layers", "vocab", "stage", "logits_shard_mb",
            "threads", "seed")  # fmt: skip
    shared = [x for key in keys for x in (f"--{key}", str(getattr(args, key)))]
    return ["--worker", impl, "--seq_len", str(seq_len), "--warmup", str(warmup),
            "--steps", str(steps), *shared]  # fmt: skip


def search_impl(args: argparse.Namespace, impl: str) -> dict[str, Any]:
    """The longest length `impl` trains under the cap, and every probe's outcome."""
    probes: dict[int, dict[str, Any]] = {}

    def fits(length: int) -> bool:
        print(f"  {impl} at {length} tokens ...", flush=True)
        started = time.monotonic()
        result = launch_capped(
            args, worker_args(args, impl, length, args.search_steps - 1, 1), args.cap_mb
        )
        ok = fits_cap(result, args.cap_mb)
        summary = probe_summary(result, time.monotonic() - started)
        probes[length] = summary
        print(f"    {'fits' if ok else 'does not fit'}: {summary['note']}", flush=True)
        return ok

    longest, tried = search_longest(
        fits, args.start_len, args.max_len, args.multiple, args.resolution
    )
    return {"longest": longest, "tried": [[n, ok, probes[n]] for n, ok in tried]}


def probe_summary(result: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """What a search job showed: its memory (summed above baseline, whole-process peak per
    rank), its step time, or why it has none."""
    if "error" in result:
        return {"note": result["error"][-400:], "wall_s": round(wall_s, 1), "load": result["load"]}
    above = above_baseline_mb(result)
    return {
        "note": f"{sum(above):.0f} MB above baseline over 4 ranks, step {result['median_step_s']:.1f} s",
        "above_baseline_mb": above,
        "peak_rss_mb": result["peak_rss_mb"],
        "step_s": result["median_step_s"],
        "wall_s": round(wall_s, 1),
        "load": result["load"],
    }


def time_impls(args: argparse.Namespace, impls: Sequence[str], length: int) -> list[common.Row]:
    """Every library at `length`: ``--rounds`` interleaved timing jobs, merged."""
    notes: dict[str, str] = {}

    def run_one(impl: str) -> dict[str, Any] | None:
        print(f"timing {IMPLS[impl]} at {length} tokens ...", flush=True)
        result = launch_capped(args, worker_args(args, impl, length, args.warmup, args.steps), None)
        if "error" in result:
            notes[impl] = result["error"][-300:]
            print(f"  FAILED: {notes[impl]}", flush=True)
            return None
        print(f"  median step {result['median_step_s']:.2f} s", flush=True)
        return result

    runs = common.run_rounds(impls, args.rounds, run_one)
    return [
        common.Row(
            label_of(impl),
            common.merge_rounds(runs[impl]) if runs[impl] else None,
            notes.get(impl, ""),
            is_peer=impl != "partita",
        )
        for impl in impls
    ]


def label_of(impl: str) -> str:
    """The row label, DeepSpeed's with its installed version."""
    return IMPLS[impl].replace("DeepSpeed", f"DeepSpeed {common.environment()['deepspeed']}", 1)


def a2a_cell(result: dict[str, Any], args: argparse.Namespace, which: str, recompute: int) -> str:
    """Table cell: measured all-to-all bytes per layer of one phase (largest rank) and the
    formula's, times `recompute` (the backward of a checkpointed layer runs its forward again)."""
    measured = max(r[which] for r in result["bytes_per_step_by_rank"]) / args.layers
    formula = recompute * a2a_formula_bytes(1, result["seq_len"], args.hidden, args.sp)
    return f"{measured / 1e6:.3f} MB ({measured / formula:.3f}x of {recompute} x formula)"


def max_payload(result: dict[str, Any]) -> float:
    """The largest rank's payload of every collective in one step (parameter gathers,
    gradient reductions, all-to-alls, the loss's all-gathers), bytes."""
    return max(r["all_payload"] for r in result["bytes_per_step_by_rank"])


def render(args: argparse.Namespace, searches: dict[str, dict[str, Any]], rows: list[common.Row],
           length: int) -> str:  # fmt: skip
    """The markdown of a run: the longest sequences, the step-time table, the probes."""
    env = common.environment()
    lines = [] if not searches else [
        f"### Longest sequence under {args.cap_mb:.0f} MB (summed over {WORLD} ranks, above "
        f"baseline): Llama {args.layers} layers x {args.hidden} hidden, {args.heads} heads, "
        f"vocabulary {args.vocab}, Ulysses sp {args.sp}, ZeRO {args.stage}, fp32, "
        f"{args.search_steps} steps per probe, torch {env['torch']}",
        "", "| library | longest sequence (tokens) | vs DeepSpeed | probes (tokens: fits?) |",
        "|---|---:|---:|---|",
    ]  # fmt: skip
    ds_longest = searches.get("deepspeed", {}).get("longest", 0)
    for impl, found in searches.items():
        ratio = f"{found['longest'] / ds_longest:.2f}x" if ds_longest else "-"
        probes = ", ".join(f"{n}: {'yes' if ok else 'no'}" for n, ok, _ in found["tried"])
        lines.append(f"| {label_of(impl)} | {found['longest']} | {ratio} | {probes} |")
    lines.append("")
    if rows:
        ref = next((r.name for r in rows if r.is_peer), rows[0].name)
        columns: list[common.Column] = [
            ("all-to-all per layer, forward", lambda r: a2a_cell(r, args, "a2a_forward", 1)),
            ("all-to-all per layer, backward", lambda r: a2a_cell(r, args, "a2a_backward", 2)),
            ("MB above baseline (sum)", lambda r: f"{sum(above_baseline_mb(r)):.0f}"),
            ("MB all collectives/step (max rank)", lambda r: f"{max_payload(r) / 1e6:.1f}"),
        ]
        title = (
            f"Step time at {length} tokens (B=1, sp {args.sp}; Llama {args.layers} x "
            f"{args.hidden}, vocabulary {args.vocab}, ZeRO {args.stage}, fp32), median of "
            f"{args.steps} steps "
            f"after {args.warmup} warm-up"
            + (f", x {args.rounds} rounds" if args.rounds > 1 else "")
        )
        lines.append(common.render_markdown(
            rows, rss_reference=ref, title=title, time_reference=ref, extra_columns=columns
        ))  # fmt: skip
        lines.append(
            f"All-to-all formula: 4 x B x S x H / sp x 4 bytes = "
            f"{a2a_formula_bytes(1, length, args.hidden, args.sp) / 1e6:.3f} MB per layer each way; "
            "the backward of a checkpointed layer recomputes its forward, so 2x.\n"
        )
        loads = [f"{r.name} {r.result['load'][0]:.1f} -> {r.result['load'][1]:.1f}"
                 for r in rows if r.result and "load" in r.result]  # fmt: skip
        if loads:
            lines.append(
                "1-minute load before -> after the (first) timing job: " + "; ".join(loads) + ".\n"
            )
    return "\n".join(lines)


def rerender(payload: dict[str, Any]) -> str:
    """The markdown of a run from its .json (`main`'s payload)."""
    args = argparse.Namespace(**payload["args"])
    rows = [common.Row(r["name"], r["result"], r["note"], r["peer"]) for r in payload["rows"]]
    return render(args, payload["searches"], rows, payload["shared_len"])


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.from_json:
        print(rerender(json.loads(args.from_json.read_text())))
        return
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        sys.exit(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    if args.timing_only and not args.shared_len:
        sys.exit("--timing_only needs --shared_len")
    searches = {}
    for impl in [] if args.timing_only else impls:
        print(f"searching the longest sequence of {IMPLS[impl]} ...", flush=True)
        searches[impl] = search_impl(args, impl)
    length = args.shared_len or shared_length([s["longest"] for s in searches.values()],
                                              args.multiple)  # fmt: skip
    rows = time_impls(args, impls, length) if length else []
    markdown = render(args, searches, rows, length)
    print("\n" + markdown)
    payload = {
        "benchmark": "sequence",
        "command": " ".join([".venv/bin/python", "benchmarks/bench_sequence.py", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": common.environment(),
        "searches": searches,
        "shared_len": length,
        "rows": [{"name": r.name, "note": r.note, "peer": r.is_peer, "result": r.result} for r in rows],
    }  # fmt: skip
    stem = args.stem or f"sequence_sp{args.sp}_h{args.hidden}_l{args.layers}"
    results_dir = Path(tempfile.gettempdir()) if args.quick else args.results_dir
    md_path, json_path = common.write_results(stem, markdown, payload, results_dir)
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
