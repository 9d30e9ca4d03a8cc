"""Tensor-parallel training benchmark: partita's AutoTP training against DeepSpeed's AutoTP
training and torch's FSDP2 + ``parallelize_module`` (torchtitan's recipe), on one 4-rank job.

One 4-rank CPU job (gloo) per configuration: a tiny-width, realistic-depth Llama from
Transformers (built from a config, nothing downloaded; untied head, byte vocabulary), AdamW,
fp32, tensor parallelism over 2 consecutive ranks and data parallelism over the 2 lanes:

* ``partita``: ``tensor_parallel.autotp_size: 2``, ZeRO stage 1 over the data-parallel ranks
  (``partita-sp``: with ``sequence_parallel``; ``partita-z3``: ZeRO stage 3, which shards
  parameters, gradients and optimizer state over the data-parallel ranks as FSDP2 does);
* ``deepspeed``: the same config on DeepSpeed (``DS_ACCELERATOR=cpu``); when it refuses or
  fails, its error is the row;
* ``fsdp2-tp``: a 2-D ``DeviceMesh`` ("dp", "tp"), ``parallelize_module`` with ColwiseParallel
  q/k/v/gate/up and RowwiseParallel o/down per block, then ``fully_shard`` over "dp" per block
  and on the root; ``AdamW(fused=True)``.

Reported: median step time after warm-up, peak RSS per rank, and the collective payload each
rank hands to ``torch.distributed``'s functions per step (DTensor's functional collectives, which
FSDP2 + TP uses for the tensor-parallel all-reduces, bypass them and are not counted). Example::

    .venv/bin/python benchmarks/bench_tp.py --steps 20 --rounds 2

Writes ``benchmarks/results/tp_<stem>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

if __package__:  # imported from the benchmarks package (tests, python -m benchmarks.bench_tp)
    from benchmarks import common
    from benchmarks.bench_hybrid import BYTES
    from benchmarks.bench_zero import fused_adamw
else:  # python benchmarks/bench_tp.py: this folder is sys.path[0]
    import common
    from bench_hybrid import BYTES
    from bench_zero import fused_adamw


WORLD, TP = 4, 2
IMPLS: dict[str, str] = {
    "partita": "partita AutoTP tp 2 x ZeRO-1 dp 2",
    "partita-sp": "partita AutoTP tp 2 x ZeRO-1 dp 2, sequence_parallel",
    "partita-z3": "partita AutoTP tp 2 x ZeRO-3 dp 2 (FSDP2's sharding)",
    "deepspeed": "DeepSpeed AutoTP tp 2 x ZeRO-1 dp 2",
    "fsdp2-tp": "FSDP2 + parallelize_module (tp 2 x dp 2) + AdamW(fused=True)",
}
PEERS = ("deepspeed", "fsdp2-tp")
VOCAB = 256


def parse_args() -> argparse.Namespace:
    """Orchestrator and worker arguments (the worker is this script under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--micro_batch", type=int, default=4, help="sequences per dp rank per step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--rounds", type=int, default=1, help="jobs per configuration, in turn")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--job_timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--results_dir", type=Path, default=common.RESULTS_DIR, help="where to write")
    p.add_argument("--stem", help="results file stem (default tp_llama)")
    p.add_argument("--worker", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--result_file", help=argparse.SUPPRESS)
    return p.parse_args()


def build_llama(args: argparse.Namespace) -> torch.nn.Module:
    """The seeded tiny-width Llama every configuration starts from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def setup_engine(args: argparse.Namespace, model: torch.nn.Module) -> Any:
    """partita or DeepSpeed with the shared AutoTP config; returns the step function."""
    ours = args.worker.startswith("partita")
    lib = importlib.import_module("partita" if ours else "deepspeed")
    # The batch sizes are left to each library's arithmetic (DeepSpeed's AutoTP counts every
    # rank, tensor ranks included; partita does the same).
    section: dict[str, Any] = {"autotp_size": TP}
    if args.worker == "partita-sp":  # the stream between the blocks split by sequence
        section["sequence_parallel"] = True
    stage = 3 if args.worker == "partita-z3" else 1
    config = common.ds_config(args.micro_batch, stage, tensor_parallel=section)
    if stage == 3:  # every weight sharded, as FSDP2 does (this model's all fall below 1e5)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = lib.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step


def setup_fsdp2_tp(model: torch.nn.Module) -> Any:
    """torchtitan's recipe: TP inside each block on "tp", FSDP2 over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp", "tp"))
    plan = {
        **{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        **{f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(),
    }
    for block in model.model.layers:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # One fused AdamW per mesh: a fused step cannot take DTensors of two meshes at once.
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    opts = [fused_adamw(ps) for ps in by_mesh.values()]

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        clip_mixed_meshes(list(model.parameters()), common.CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    return step


def clip_mixed_meshes(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Gradient clipping over DTensors on two meshes (the blocks' (dp, tp), the rest's dp),
    which ``clip_grad_norm_`` cannot stack: one norm per mesh, made whole, then combined (as
    torchtitan's clipping does for its parameters)."""
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm**2)
    total = torch.stack(squares).sum().sqrt()
    for group in by_mesh.values():  # one foreach per mesh
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def worker(args: argparse.Namespace) -> None:
    """One configuration on one rank: build, time, count bytes, (rank 0) write the result."""
    torch.set_num_threads(args.threads)
    BYTES.install()  # before either library binds torch.distributed's functions
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.worker != "fsdp2-tp":
        importlib.import_module("deepspeed" if args.worker == "deepspeed" else "partita")
    baseline = common.peak_rss_mb()
    model = build_llama(args)
    params = common.count_params(model)
    try:
        if args.worker == "fsdp2-tp":
            import torch.distributed as dist

            dist.init_process_group("gloo")
            step_fn = setup_fsdp2_tp(model)
        else:
            step_fn = setup_engine(args, model)
    except Exception as exc:
        if rank == 0:
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            Path(args.result_file).write_text(json.dumps({"error": error[-600:]}))
        common.exit_worker()
    per_step: list[float] = []

    def step(batch: torch.Tensor) -> torch.Tensor:
        before = BYTES.snapshot()
        BYTES.on = True
        try:
            return step_fn(batch)
        finally:
            BYTES.on = False
            after = BYTES.snapshot()
            per_step.append(sum(v - before.get(k, 0) for k, v in after.items() if "payload" in k))

    # The ranks of one tensor slice read the same batch: data-parallel rank = rank // TP.
    batches = common.corpus_batches(rank // TP, world // TP, args.micro_batch, args.seq_len)
    times, losses, faults = common.time_steps(step, batches, args.warmup, args.steps)
    import torch.distributed as dist

    every: list[Any] = [None] * world
    dist.all_gather_object(every, per_step[-1])
    extra = {"params": params, "payload_per_step_by_rank": every}
    result = common.collect_result(times, losses, baseline, extra, faults)
    if result is not None:
        Path(args.result_file).write_text(json.dumps(result))
    common.exit_worker()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    impls = [name.strip() for name in args.impls.split(",") if name.strip()]
    keys = ("hidden", "layers", "heads", "threads", "micro_batch", "seq_len", "warmup", "steps",
            "seed")  # fmt: skip
    shared = [x for key in keys for x in (f"--{key}", str(getattr(args, key)))]
    rows = common.run_table(
        Path(__file__).resolve(), impls, IMPLS, PEERS, shared, WORLD, args.threads,
        args.job_timeout, args.rounds,
    )  # fmt: skip
    ref = rows[0].name
    params = next((r.result["params"] for r in rows if r.result), 0)
    title = (
        f"Tensor-parallel training, Llama {args.layers} x {args.hidden} ({params:,} parameters), "
        f"{WORLD} CPU processes (tp {TP} x dp {WORLD // TP}) x {args.threads} thread, micro-batch "
        f"{args.micro_batch} x {args.seq_len} tokens per dp rank, fp32, median of {args.steps} "
        f"steps after {args.warmup} warm-up"
        + (f", x {args.rounds} rounds" if args.rounds > 1 else "")
    )
    column: common.Column = (
        "MB payload/step per rank (max; DTensor's not counted)",
        lambda r: f"{max(r['payload_per_step_by_rank']) / 1e6:.2f}",
    )
    markdown = common.render_markdown(
        rows, rss_reference=ref, title=title, time_reference=ref, extra_columns=[column]
    )
    print("\n" + markdown)
    payload = {
        "benchmark": "tp",
        "command": " ".join([".venv/bin/python", "benchmarks/bench_tp.py", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": common.environment(),
        "rows": [{"name": r.name, "note": r.note, "peer": r.is_peer, "result": r.result} for r in rows],
    }  # fmt: skip
    md_path, json_path = common.write_results(
        args.stem or "tp_llama", markdown, payload, args.results_dir
    )
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
