"""Section 4: step time, tokens/s, MFU and peak device memory of a ~1B GPT at world size 1.

Every configuration trains the same bf16 model (fp32 masters or fp32 sharded parameters with
bf16 compute for FSDP2), AdamW, clipping 1.0, on the same tokens, for a few timed steps after
a warm-up. The micro-batch is the largest of the mode's candidates that the plain-torch
baseline fits; a configuration that runs out of memory at it retries at half (said in its
note). Time-boxed: a configuration that would start after the budget is ``not run (time)``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .core import (
    H200_BF16_DENSE_FLOPS,
    PASS,
    SKIP,
    Case,
    Context,
    free_device_memory,
    peak_device_gb,
)
from .model import Shape, batches, build, flops_per_token
from .trainers import TorchTrainer, engine_config

S4 = "4 speed"
Step = Callable[[tuple[torch.Tensor, torch.Tensor]], Any]
CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


def run_section4(ctx: Context) -> None:
    """Baseline first (it fixes the micro-batch), then partita, FSDP2, DeepSpeed."""
    mode = ctx.mode
    need = 35.0 if mode.is_cuda else 0.0
    state: dict[str, Any] = {"micro": None}
    ctx.run(S4, "torch + fused AdamW", lambda: _baseline(ctx, state), min_s=need)
    # Should the baseline fail, the others still run at the mode's default micro-batch.
    micro = state["micro"] or mode.big.micro
    configs: list[tuple[str, Callable[[int], tuple[Step, str]], float]] = [
        ("partita stage 0", lambda mb: _partita(ctx, 0, mb), need),
        ("partita stage 3", lambda mb: _partita(ctx, 3, mb), need),
        ("FSDP2 (fully_shard per block)", lambda mb: _fsdp2(ctx), need),
        ("partita stage 3 + CPU offload", lambda mb: _partita(ctx, 3, mb, CPU_OFFLOAD), 2 * need),
    ]
    for name, make, min_s in configs:
        ctx.run(S4, name, lambda n=name, m=make: _measure(ctx, n, m, micro), min_s=min_s)
    _deepspeed(ctx, micro, need)


def _time(ctx: Context, step: Step, micro: int) -> dict[str, Any]:
    """Warm-up then timed steps (device synchronised around each); the figures."""
    mode, shape = ctx.mode, ctx.mode.big.with_(micro=micro)
    data = batches(shape, mode.speed_warmup + mode.speed_steps, micro, mode.device)
    times, losses = [], []
    for i, batch in enumerate(data):
        if mode.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(float(step(batch)))
        if mode.is_cuda:
            torch.cuda.synchronize()
        if i >= mode.speed_warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_s = micro * shape.seq / step_s
    n = gpt_params(shape)
    flops = flops_per_token(shape, n) * tokens_s
    return {
        "micro": micro, "seq": shape.seq, "params": n, "step_ms": step_s * 1e3,
        "step_times_ms": [t * 1e3 for t in times], "tokens_per_s": tokens_s,
        "tflops": flops / 1e12, "mfu": flops / H200_BF16_DENSE_FLOPS if mode.is_cuda else None,
        "peak_gb": peak_device_gb(), "losses": losses,
    }  # fmt: skip


def gpt_params(shape: Shape) -> int:
    """Parameters of `gpu_check.model.GPT` (tied head counted once), without building it."""
    d = shape.dim
    block = 12 * d * d + 13 * d  # qkv, proj, fc, out weights and biases, two norms
    return (shape.vocab + shape.seq) * d + 2 * d + shape.layers * block


def _measure(ctx: Context, name: str, make: Callable[[int], tuple[Step, str]], micro: int) -> Case:
    """Builds and times one configuration, halving the micro-batch on out-of-memory."""
    note = ""
    while True:
        free_device_memory()
        try:
            step, optimizer = make(micro)
            try:
                figures = _time(ctx, step, micro)
            finally:
                getattr(step, "close", lambda: None)()
            break
        except torch.OutOfMemoryError:
            step = None  # type: ignore[assignment]
            if micro == 1:
                raise
            note += f"out of memory at micro-batch {micro}; "
            micro //= 2
    del step
    free_device_memory()
    note += ctx.busy_note()
    figures.update(optimizer=optimizer, note=note.strip("; "))
    return Case(S4, name, PASS, _describe(figures), figures)


def _describe(f: dict[str, Any]) -> str:
    mfu = f"MFU {f['mfu']:.1%}, " if f.get("mfu") is not None else ""
    peak = f"peak {f['peak_gb']:.1f} GB, " if f.get("peak_gb") is not None else ""
    return f"{f['step_ms']:.1f} ms/step, {f['tokens_per_s']:.0f} tokens/s, {mfu}{peak}micro-batch {f['micro']} {f.get('note', '')}".strip()


def _baseline(ctx: Context, state: dict[str, Any]) -> Case:
    """Plain torch at the largest candidate micro-batch that fits (one step each)."""
    mode = ctx.mode
    for micro in mode.micro_batches:
        free_device_memory()
        try:
            step, _ = _torch(ctx)
            _one_step(ctx, step, micro)
        except torch.OutOfMemoryError:
            step = None  # type: ignore[assignment]
            continue
        del step
        state["micro"] = micro
        case = _measure(ctx, "torch + fused AdamW", lambda mb: _torch(ctx), micro)
        state["micro"] = case.figures["micro"]
        return case
    raise RuntimeError(f"no micro-batch of {mode.micro_batches} fits")


def _one_step(ctx: Context, step: Step, micro: int) -> None:
    step(batches(ctx.mode.big, 1, micro, ctx.mode.device)[0])


def _torch(ctx: Context) -> tuple[Step, str]:
    trainer = TorchTrainer(build(ctx.mode.big, 0, ctx.mode.device), torch.bfloat16, clip=1.0)
    return (lambda b: trainer.step(b)[0]), "AdamW(fused=True), fp32 masters"


def _engine_step(
    ctx: Context, initialize: Any, stage: int, micro: int, zero: dict | None
) -> tuple[Step, Any, Any]:
    """A bf16 training step through a DeepSpeed-style engine (partita's or DeepSpeed's
    ``initialize``): the step, the engine and the optimizer it returned."""
    model = build(ctx.mode.big, 0, ctx.mode.device)
    config = engine_config(stage, "bf16", micro, clip=1.0, **(zero or {}))
    engine, optimizer, _, _ = initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    step.close = engine.destroy  # type: ignore[attr-defined]
    return step, engine, optimizer


def _partita(ctx: Context, stage: int, micro: int, zero: dict | None = None) -> tuple[Step, str]:
    import partita

    step, engine, _ = _engine_step(ctx, partita.initialize, stage, micro, zero)
    return step, type(engine.optimizer).__name__


def _fsdp2(ctx: Context) -> tuple[Step, str]:
    """fully_shard per block and at the root; fp32 sharded parameters, bf16 compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(ctx.mode.big, 0, ctx.mode.device)
    mesh = init_device_mesh(ctx.mode.device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    from .core import BETAS, EPS, LR, WEIGHT_DECAY

    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = model(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, "AdamW(fused=True)"


DS_OPS = ("FusedAdamBuilder", "CPUAdamBuilder")
_BUILD = """
import json
import deepspeed.ops.op_builder as b
for name in {ops!r}:
    try:
        getattr(b, name)().load()
        print(json.dumps([name, "built"]), flush=True)
    except Exception as exc:
        print(json.dumps([name, f"does not build: {{type(exc).__name__}}: {{str(exc)[:160]}}"]), flush=True)
"""


def start_ds_build(ctx: Context) -> None:
    """Starts building (or loading the cached) DeepSpeed FusedAdam and CPUAdam ops in a child
    process at the start of the run, so the build overlaps sections 1-3 (GPU only: on CPU the
    build alone would take minutes). Outcomes go to ``deepspeed_build.jsonl``, its log to
    ``deepspeed_build.log``.

    [Note: never kill the build] torch's extension builder holds a lock file in the build
    folder while it compiles; a build killed midway leaves it behind, and every later load of
    that op (the next check on the same machine) waits on it forever. So the child runs in its
    own session with no pipe to this process, and is left to finish when the check stops
    waiting for it."""
    if ctx.mode.dry or importlib.util.find_spec("deepspeed") is None:
        return
    results = os.path.join(ctx.out_dir, "deepspeed_build.jsonl")
    # In this process too: the DeepSpeed rows load the op through the same parser.
    if "TORCH_CUDA_ARCH_LIST" in os.environ:  # see ds_arch_list
        os.environ["TORCH_CUDA_ARCH_LIST"] = ds_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    with open(results, "w") as out, open(results[:-6] + ".log", "w") as log:
        ctx.jobs["ds_build"] = subprocess.Popen(
            [sys.executable, "-c", _BUILD.format(ops=DS_OPS)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=log, start_new_session=True,
        )  # fmt: skip
    ctx.jobs["ds_build_results"] = results


def ds_arch_list(archs: str) -> str:
    """`TORCH_CUDA_ARCH_LIST` without architecture suffixes ("9.0a" -> "9.0"): DeepSpeed
    0.19.8's op builder parses each entry's minor version as an integer and fails on torch's
    arch-specific names ("invalid literal for int() with base 10: '0a'", seen on the H200
    image, whose list names 9.0a); the plain architecture builds the same FusedAdam."""
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", archs)


def _wait_ds_build(ctx: Context, timeout: float) -> dict[str, str]:
    """Each op's outcome, waiting at most ``timeout`` s for the build (see [Note: never kill
    the build])."""
    proc: subprocess.Popen | None = ctx.jobs.get("ds_build")
    if proc is None:
        return {}
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(1.0, timeout))
    ops = {op: f"build not done {timeout:.0f} s after the sections before it" for op in DS_OPS}
    with open(ctx.jobs["ds_build_results"]) as fh:
        for line in fh:
            if line.startswith('["'):
                name, outcome = json.loads(line)
                ops[name] = outcome
    return ops


def _deepspeed(ctx: Context, micro: int, need: float) -> None:
    """DeepSpeed 0.19.8 stage 3, and with ZeRO-Offload, where it is installed and its ops
    build within the time left."""
    names = ("DeepSpeed stage 3", "DeepSpeed stage 3 + ZeRO-Offload")
    why = ""
    if importlib.util.find_spec("deepspeed") is None:
        why = "not installed"
    elif ctx.mode.dry:
        why = "dry run: DeepSpeed rows run on the GPU only (its ops would compile for minutes)"
    if why:
        for name in names:
            ctx.run(S4, name, lambda n=name: Case(S4, n, SKIP, why))
        return
    ops: dict[str, str] = {}

    def build() -> Case:
        import deepspeed

        ops.update(_wait_ds_build(ctx, ctx.left() - 2 * need))
        detail = f"deepspeed {deepspeed.__version__}: " + "; ".join(
            f"{k} {v}" for k, v in ops.items()
        )
        return Case(S4, "DeepSpeed ops build", PASS, detail, dict(ops))

    ctx.run(S4, "DeepSpeed ops build", build, min_s=need)
    wants = {names[0]: (DS_OPS[0], None), names[1]: (DS_OPS[1], CPU_OFFLOAD)}
    for name, (op, zero) in wants.items():
        if ops.get(op) != "built":
            ctx.run(
                S4, name, lambda n=name, o=op: Case(S4, n, SKIP, f"{o}: {ops.get(o, 'not tried')}")
            )
            continue
        make = lambda mb, z=zero: _ds_engine(ctx, mb, z)  # noqa: E731
        ctx.run(
            S4,
            name,
            lambda n=name, m=make: _measure(ctx, n, m, micro),
            min_s=need * (1 + bool(zero)),
        )


def _ds_engine(ctx: Context, micro: int, zero: dict | None) -> tuple[Step, str]:
    import deepspeed

    step, _, optimizer = _engine_step(ctx, deepspeed.initialize, 3, micro, zero)
    inner = getattr(optimizer, "optimizer", None)
    return step, f"{type(optimizer).__name__}({type(inner).__name__})"
