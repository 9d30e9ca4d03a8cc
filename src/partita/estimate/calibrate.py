"""The planner's short calibrations: the compute rate of the model's own training step, the
CPU Adam rate, each with the threads one rank will have.

[Note: what the compute calibration measures]
The step-time model counts 6 FLOPs per parameter per token (plus the recomputed forward with
checkpointing) and divides by a rate. A square matmul on every core of the machine is the wrong
rate for it twice over: a CPU rank gets ``cores // ranks per node`` threads (the launcher's and
the test harness's ``OMP_NUM_THREADS``), and a training step is not one large matmul (small
per-layer matmuls, attention, normalisation, activations, the loss over the vocabulary). On 2
CPU ranks of a 2-core machine, GPT-2 10m at 4 x 128 tokens: a 512 x 512 matmul on 2 threads
gave 179 GFLOP/s, i.e. 0.15 s of compute per step, where each rank's step took 0.57 s, 0.50-0.57 s
of it the model's forward and backward (process CPU time). So the rate is measured on the
model itself: its forward and backward at the micro-batch shape, in the precision, on the
rank's threads, expressed in the model's 6-FLOPs-per-parameter-per-token units, so that
`partita.estimate.plan.step_time` gets back the measured time. A deep model is calibrated on a
copy with fewer blocks (same width, vocabulary and sequence), so the calibration stays short.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "calibrate_adam_rate",
    "calibrate_flops",
    "calibrate_model_flops",
    "calibration_depth",
    "rank_threads",
]

CALIBRATION_FLOPS = 2e11
"""Counted FLOPs (6 per parameter per token) of the largest model copy the calibration runs
once: ~1-4 s of one CPU core for a forward and backward; deeper models lose blocks."""


def rank_threads(ranks_per_node: int, cpus: int | None = None) -> int:
    """Threads one CPU rank computes with: the node's usable CPUs shared by its ranks, as
    ``partita.launcher`` and the test harness set ``OMP_NUM_THREADS``."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // max(1, ranks_per_node))


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` (None: unchanged) for the block, then restored."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_time(run: Callable[[], Any], seconds: float, sync: Callable[[], None]) -> float:
    """Median seconds of `run` after one warm-up, repeated for ~`seconds` (at least 3 times)."""
    run()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def calibrate_flops(seconds: float = 0.3, threads: int | None = None) -> float:
    """FLOP/s of this machine's default device on a square matmul, measured for ~`seconds`
    with `threads` intra-op threads (None: torch's current setting). A peak, not a training
    step's rate: used when the model itself is not known (a parameter count)."""
    device = _device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 2048 if device == "cuda" else 512
    with _threads(threads):
        a = torch.randn(n, n, device=device, dtype=dtype)
        return 2 * n**3 / _median_time(lambda: a @ a, seconds, _sync(device))


def calibrate_adam_rate(
    numel: int = 1 << 22, seconds: float = 0.3, threads: int | None = None
) -> float:
    """Parameters/s partita's CPU AdamW steps on this host (fp32, `numel` elements, repeated
    for ~`seconds`, `threads` intra-op threads): the rate of offloaded and CPU-rank steps."""
    from partita.optim import CPUAdamW

    with _threads(threads):
        param = torch.nn.Parameter(torch.zeros(numel))
        param.grad = torch.full((numel,), 1e-3)
        opt = CPUAdamW([param], lr=1e-3)
        return numel / _median_time(opt.step, seconds, lambda: None)


def _layers_key(config: Any) -> str:
    """The config attribute that holds the number of blocks (Hugging Face names vary)."""
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, key, None), int):
            return key
    raise ValueError(f"{type(config).__name__} names no number of layers")


def calibration_depth(
    layers: int, block: int, rest: int, tokens: int, budget: float = CALIBRATION_FLOPS
) -> int:
    """Blocks of the model copy the calibration runs: as many of `layers` (each `block`
    trainable elements, `rest` outside them) as keep 6 x elements x `tokens` within `budget`,
    at least one."""
    room = budget / (6 * tokens) - rest
    return max(1, min(layers, int(room // block) if block > 0 else layers))


def calibrate_model_flops(
    config: Any,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    threads: int | None = None,
    seconds: float = 1.0,
    budget: float = CALIBRATION_FLOPS,
) -> float:
    """The rate of the model's own training step (see [Note: what the compute calibration
    measures]): a forward and backward of the Hugging Face `config`'s model (fewer blocks when
    it is deep: `calibration_depth`) at `micro_batch` x `seq_len` tokens in `dtype` on
    `threads` threads, as 6 x trainable parameters x tokens per second. When even one block
    with the embeddings and head would count over 8 x `budget`, the square-matmul peak on
    `threads` threads instead (`calibrate_flops`), an overestimate of the rate."""
    from partita.estimate.model import describe_module, meta_model

    key = _layers_key(config)
    shape = describe_module(meta_model(config, dtype))
    layers = getattr(config, key)
    block = shape.blocks // layers if layers else 0
    tokens = micro_batch * seq_len
    rest = shape.trainable - shape.blocks
    if 6 * (rest + block) * tokens > 8 * budget:
        return calibrate_flops(threads=threads)
    depth = calibration_depth(layers, block, rest, tokens, budget)
    small = copy.deepcopy(config)
    setattr(small, key, depth)
    device = _device()
    with _threads(threads):
        model = _built(small, dtype, device)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        ids = torch.randint(0, int(config.vocab_size), (micro_batch, seq_len), device=device)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        return 6 * params * tokens / _median_time(step, seconds, _sync(device))


def _built(config: Any, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The causal LM of `config` with random weights on `device`, in training mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    return model.train()
