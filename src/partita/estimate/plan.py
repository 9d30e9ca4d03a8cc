"""The planner: the configurations that fit, ranked by a predicted step time, and the chosen
one written as a ``ds_config.json``.

Step time is the sum of (no overlap is assumed, so it is an upper bound):

- compute: 6 FLOPs per parameter per token, plus 2 per parameter inside the checkpointed blocks
  with activation checkpointing (their forward runs again in backward; the embedding, a tied
  LM head and the loss run once), at the given or calibrated FLOP rate;
- communication, from partita's comm model: each step moves 2Ψ elements per rank in the reduce
  dtype for stages 0-2 (reduce-scatter or all-reduce of gradients, all-gather of parameters)
  and 3Ψ for stage 3 (parameters gathered in forward and again in backward), times (N-1)/N;
- optimizer offload: the CPU Adam step over this rank's shard, plus the gradient shard down and
  the parameter shard up over the host link; on CPU ranks (``accelerator="cpu"``) every
  configuration steps with CPU Adam (stage 0 over all Ψ, sharded stages over Ψ/N) and nothing
  crosses a host link;
- NVMe: optimizer state read and written each step, parameter shards read in forward and
  backward, through the node's disk bandwidth shared by its ranks.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from partita.estimate.memory import DTYPE_BYTES, Candidate, Estimate

__all__ = [
    "HEADROOM",
    "Rates",
    "Timing",
    "calibrate_adam_rate",
    "calibrate_flops",
    "ds_config",
    "rank",
    "step_time",
]


HEADROOM = 0.08
"""Fraction of each memory the planner keeps free for what the estimate misses. The estimate is
meant to be at or a little above the measured peak, so this covers its errors below, not a
margin on top. Measured on 2 CPU ranks, fp32, 2026-12-04: over the validation table (GPT-2 10m
and 50m, stages 0-3, 3 steps, ``benchmarks/results/estimate_10m_50m.md``) and the planner check
(10m, 16 configurations x 3 runs of 5 steps, ``plan_cap_10m.md``) the largest measured peak
was 6.2% above its prediction (10m, stage 2 with optimizer offload and checkpointing), most
stage 0-2 cells ran 2-6% above, ZeRO-3 and the 50m model ran below. 0.08 accepts up to
1/(1 - 0.08) = 1.087 x the prediction: the worst seen plus ~2.5% for what one machine on one
day did not show. It was 0.15 when an older table read every prediction 1-14% *above*
measured, which made the planner refuse configurations that ran well within the cap."""


@dataclass(frozen=True)
class Rates:
    """Throughputs the step time is predicted from (per rank unless said otherwise)."""

    flops: float
    """Sustained FLOP/s of one device."""
    link_bandwidth: float = 100e9
    """Bytes/s one rank sends in collectives (bus bandwidth)."""
    host_bandwidth: float = 20e9
    """Bytes/s between one device and the host (PCIe)."""
    adam_rate: float = 1e9
    """Parameters/s the CPU Adam steps for one rank."""
    disk_bandwidth: float = 3e9
    """Bytes/s of a node's NVMe, shared by its ranks."""


@dataclass(frozen=True)
class Timing:
    """Predicted seconds of one step, by part."""

    compute: float
    comm: float
    offload: float
    nvme: float

    @property
    def total(self) -> float:
        """The step (the parts run one after another)."""
        return self.compute + self.comm + self.offload + self.nvme


def step_time(
    est: Estimate, params: int, tokens_per_rank: int, rates: Rates, recomputed: int | None = None
) -> Timing:
    """Predicted step time of `est`'s configuration for `params` trainable parameters and
    `tokens_per_rank` tokens per rank per step (micro-batch x sequence length); `recomputed`:
    the parameters inside the checkpointed blocks (`ModelShape.recomputed`; None: all)."""
    c, hw = est.candidate, est.hardware
    n, p = hw.world, DTYPE_BYTES[c.precision]
    again = params if recomputed is None else recomputed
    flops = (6 * params + (2 * again if c.checkpointing else 0)) * tokens_per_rank
    factor = 3 if c.stage == 3 else 2
    comm = factor * params * p * (n - 1) / n / rates.link_bandwidth if n > 1 else 0.0
    shard = params / n
    offload = 0.0
    if hw.accelerator == "cpu":
        offload = (params if c.stage == 0 else shard) / rates.adam_rate
    elif c.offload_optimizer != "none":
        offload = shard / rates.adam_rate + shard * (4 + p) / rates.host_bandwidth
    if c.offload_param != "none" and hw.accelerator != "cpu":
        offload += 2 * shard * p / rates.host_bandwidth
    disk = 0.0
    if c.offload_optimizer == "nvme":
        disk += 2 * shard * (4 + 4 + 8)  # read and write masters, gradients, moments
    if c.offload_param == "nvme":
        disk += 2 * shard * p
    nvme = disk * hw.devices_per_node / rates.disk_bandwidth
    return Timing(flops / rates.flops, comm, offload, nvme)


def rank(
    estimates: list[Estimate],
    params: int,
    tokens_per_rank: int,
    rates: Rates,
    recomputed: int | None = None,
) -> list[tuple[Estimate, Timing]]:
    """The estimates that fit, fastest first; among equal predicted times the one with the
    smaller peak (more memory left for what the estimate misses), then `estimates`' order
    (`candidates` gives the simplest first). `recomputed` as in `step_time`."""
    timed = [
        (e, step_time(e, params, tokens_per_rank, rates, recomputed)) for e in estimates if e.fits
    ]
    return sorted(timed, key=lambda et: (et[1].total, _peak(et[0])))


def _peak(est: Estimate) -> int:
    """Per-rank bytes the configuration needs where it is tightest: the device, or on CPU
    ranks the host (their device is the host)."""
    if est.hardware.accelerator == "cpu":
        return est.device + est.total("host")
    return est.device


def calibrate_flops(seconds: float = 0.3) -> float:
    """FLOP/s of this machine's default device on a square matmul, measured for ~`seconds`."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 2048 if device == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a  # warm-up: kernel selection and allocation
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        count += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * count / (time.perf_counter() - start)


def calibrate_adam_rate(numel: int = 1 << 22, seconds: float = 0.3) -> float:
    """Parameters/s partita's CPU AdamW steps on this host (fp32, `numel` elements, repeated
    for ~`seconds`): the rate of offloaded and CPU-rank optimizer steps."""
    import torch

    from partita.optim import CPUAdamW

    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full((numel,), 1e-3)
    opt = CPUAdamW([param], lr=1e-3)
    opt.step()  # warm-up: state allocation
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        opt.step()
        count += 1
    return numel * count / (time.perf_counter() - start)


def ds_config(c: Candidate, micro_batch: int, nvme_path: str | None = None) -> dict[str, Any]:
    """The DeepSpeed config of candidate `c` (AdamW; ``nvme_path`` for NVMe offload)."""
    zero: dict[str, Any] = {"stage": c.stage}
    for key, where in (
        ("offload_optimizer", c.offload_optimizer),
        ("offload_param", c.offload_param),
    ):
        if where == "none":
            continue
        block: dict[str, Any] = {"device": where, "pin_memory": True}
        if where == "nvme":
            block["nvme_path"] = nvme_path or os.path.join(os.getcwd(), "nvme_offload")
        zero[key] = block
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    if c.precision != "fp32":
        config[c.precision] = {"enabled": True}
    return config


def write_ds_config(path: str, config: dict[str, Any]) -> None:
    """Writes `config` as indented JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
