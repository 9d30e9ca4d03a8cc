"""The planner: the configurations that fit, ranked by a predicted step time, and the chosen
one written as a ``ds_config.json``.

Step time follows the engine's schedule (`partita.zero`):

- compute: 6 FLOPs per parameter per token, plus 2 per parameter inside the checkpointed blocks
  with activation checkpointing (their forward runs again in backward; the embedding, a tied
  LM head and the loss run once), at the given or calibrated rate (`partita.estimate.calibrate`:
  the model's own forward and backward on the rank's threads); a third of it is the forward;
- communication, from partita's comm model, times (N-1)/N per rank in the reduce dtype:
  stage 0 all-reduces the gradients in buckets during backward (2Ψ); stages 1-2 reduce-scatter
  them during backward (Ψ) and all-gather the updated parameters after the optimizer step (Ψ),
  which nothing overlaps: the next forward needs them; stage 3 gathers parameters in forward
  and again in backward, each unit waiting for its own, and reduce-scatters in backward (3Ψ).
  The gradient reductions run beside the backward: on a GPU they hide behind its compute, so
  only what exceeds it adds to the step; on CPU ranks the ranks' threads already fill the
  cores, so a reduction still takes its own CPU work (copies, sums, socket calls:
  `Rates.comm_cpu_share` of its time) from the compute and hides only its waits;
- optimizer: the CPU Adam step over this rank's shard with offload, plus the gradient shard
  down and the parameter shard up over the host link; on CPU ranks (``accelerator="cpu"``)
  every configuration steps with CPU Adam (stage 0 over all Ψ, sharded stages over Ψ/N) and
  nothing crosses a host link;
- NVMe: optimizer state read and written each step, parameter shards read in forward and
  backward, through the node's disk bandwidth shared by its ranks.

With sequence parallelism (sp) a rank computes on seq_len / sp tokens of each sequence and
waits for the Ulysses all-to-alls: query, key, value and the output of every layer, each a
``[b, h, S/sp, d]`` block of which (sp - 1)/sp crosses a link, in forward, in backward and
again in the recomputed forward under checkpointing (`partita.estimate.ulysses.
all_to_all_bytes`). Attention's quadratic FLOPs are not in the step time.

On several nodes a collective over ranks of more than one node goes at
`Rates.inter_node_bandwidth`. Stage 3 there is priced per group and link by
`partita.estimate.zeropp.price`, with or without ZeRO++'s options ([Note: ZeRO++ in the
planner] in ``zeropp_plan.py``): its gathers waited for, its reductions beside the backward.

Not modelled: the device optimizer step without offload, the copies of gradients into buckets
and of updated shards into the parameters, the wait of a rank for a slower one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

from partita.estimate.calibrate import calibrate_adam_rate, calibrate_flops
from partita.estimate.memory import DTYPE_BYTES, Candidate, Estimate, estimate
from partita.estimate.model import ModelShape
from partita.estimate.zeropp import ZeroPP
from partita.estimate.zeropp_plan import KEYS, link_seconds, priced

__all__ = [
    "HEADROOM",
    "Rates",
    "Timing",
    "calibrate_adam_rate",
    "calibrate_flops",
    "ds_config",
    "kept_out_by_headroom",
    "rank",
    "rank_need",
    "step_time",
]


HEADROOM = 0.08
"""Fraction of each memory the planner keeps free for what the estimate misses. The estimate is
meant to be at or a little above the measured peak, so this covers its errors below, not a
margin on top. Measured on 2 CPU ranks, fp32, 2026-12-04: the validation table (GPT-2 10m and
50m, stages 0-3, 3 steps, ``benchmarks/results/estimate_10m_50m.md``) had every prediction
from 0.03% below to 5.4% above the measured peak at 521a9dd (load 3-4), and from 0.1% to 6.7%
above it at d27b299 (gradients and pooled buffers released between steps, load 1-2); in the
planner check (10m, 16 configurations, ``plan_cap_10m.md``) before those releases
the runs at load 6-9 peaked up to 6.2% above their predictions (stage 2 with optimizer
offload and checkpointing: 349.2 MiB against 328.9) and the quiet run 0-10% below them (a
run's peak grows with the machine's load). 0.08 accepts up to 1/(1 - 0.08) = 1.087 x the
prediction: the worst seen plus ~2.5%. It was 0.15 when an older estimator read every
prediction 1-14% *above* measured, which made the planner refuse configurations that ran
well within the cap. With today's estimator, under load 10 (5f2edc5, 2026-12-04,
``benchmarks/results/peaks_under_load_10m.md``) every one of the 16 planner candidates peaked
at or under its prediction (the closest 0.1% under); it stays for what was not measured (GPUs,
other models), and ``partita plan --trial`` measures what it keeps out instead of guessing."""


@dataclass(frozen=True)
class Rates:
    """Throughputs the step time is predicted from (per rank unless said otherwise)."""

    flops: float
    """FLOP/s of one rank's training compute, counted as 6 per parameter per token
    (`partita.estimate.calibrate.calibrate_model_flops` measures it on the model)."""
    link_bandwidth: float = 100e9
    """Bytes/s one rank sends in collectives (bus bandwidth)."""
    host_bandwidth: float = 20e9
    """Bytes/s between one device and the host (PCIe)."""
    adam_rate: float = 1e9
    """Parameters/s the CPU Adam steps for one rank."""
    disk_bandwidth: float = 3e9
    """Bytes/s of a node's NVMe, shared by its ranks."""
    inter_node_bandwidth: float | None = None
    """Bytes/s one rank sends across nodes (its share of the network); None: `link_bandwidth`.
    Only jobs on several nodes use it."""
    comm_cpu_share: float = 1.0
    """On CPU ranks, the part of a collective's time its own CPU work takes (copies, sums,
    socket calls; the rest is waiting for the peer): what a collective that runs beside compute
    still takes from it. 1.0 (the default): nothing overlaps. The benchmark measures it as
    the process CPU time over the wall time of a gloo all-reduce between 2 ranks."""


@dataclass(frozen=True)
class Timing:
    """Predicted seconds of one step, by part."""

    compute: float
    """Forward and backward (with the recomputed forward under checkpointing)."""
    comm: float
    """What the collectives add to the step beyond the compute they overlap."""
    offload: float
    """The CPU Adam step and host-link copies (on CPU ranks: the optimizer step)."""
    nvme: float

    @property
    def total(self) -> float:
        """The step (the parts run one after another)."""
        return self.compute + self.comm + self.offload + self.nvme


def step_time(
    est: Estimate,
    params: int,
    tokens_per_rank: int,
    rates: Rates,
    recomputed: int | None = None,
    a2a_bytes: int = 0,
    units: tuple[tuple[int, ...], ...] | None = None,
) -> Timing:
    """Predicted step time of `est`'s configuration for `params` trainable parameters and
    `tokens_per_rank` tokens per rank per step (micro-batch x sequence length / sp); `recomputed`:
    the parameters inside the checkpointed blocks (`ModelShape.recomputed`; None: all);
    `a2a_bytes`: what one forward's Ulysses all-to-alls send from this rank over links, sent
    again by backward and by the recomputed forward under checkpointing, and waited for
    (attention needs its heads); `units`: the model's stage-3 units (`ModelShape.units`),
    which price stage 3 per group and link on several nodes or with ZeRO++."""
    c, hw = est.candidate, est.hardware
    n, p = hw.world, DTYPE_BYTES[c.precision]
    again = params if recomputed is None else recomputed
    forward = 2 * params * tokens_per_rank / rates.flops
    backward = (4 * params + (2 * again if c.checkpointing else 0)) * tokens_per_rank / rates.flops
    world_rate = _world_rate(hw.nodes, rates)
    # One pass over Ψ elements between ranks: what a reduce-scatter or an all-gather sends.
    one = params * p * (n - 1) / n / world_rate if n > 1 else 0.0
    cpu = hw.accelerator == "cpu"
    share = rates.comm_cpu_share if cpu else None
    if c.stage == 3 and units is not None and (hw.nodes > 1 or c.zeropp is not None):
        comm = _stage3_links(est, units, backward, rates, share)
    else:
        comm = _comm(c.stage, one, backward, share)
    comm += a2a_bytes * (3 if c.checkpointing else 2) / rates.link_bandwidth
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
    return Timing(forward + backward, comm, offload, nvme)


def _world_rate(nodes: int, rates: Rates) -> float:
    """Bytes/s of a collective over the world: the network's pace once it spans nodes."""
    if nodes > 1 and rates.inter_node_bandwidth is not None:
        return rates.inter_node_bandwidth
    return rates.link_bandwidth


def _stage3_links(
    est: Estimate,
    units: tuple[tuple[int, ...], ...],
    backward: float,
    rates: Rates,
    cpu_share: float | None,
) -> float:
    """Stage 3's collectives priced per group and link (`partita.estimate.zeropp.price`, one
    micro-batch): gathers waited for, reductions beside the backward as in `_comm`."""
    hw, opts = est.hardware, est.candidate.zeropp or ZeroPP()
    p = DTYPE_BYTES[est.candidate.precision]
    figures = priced(units, hw.world, opts, p)
    gather, reduce = link_seconds(
        figures, opts, hw.world, hw.nodes, rates.link_bandwidth, _world_rate(hw.nodes, rates)
    )
    if cpu_share is not None:
        return gather + cpu_share * reduce
    return gather + max(0.0, reduce - backward)


def _comm(stage: int, one: float, backward: float, cpu_share: float | None) -> float:
    """Seconds the step's collectives add (`one`: one pass over the parameters), by the
    engine's schedule. Waited for whole: stage 3's gathers (a unit computes only once its
    parameters have arrived; prefetch starts the next one early, but measured on 2 CPU ranks
    stage 3 ran 15% slower than stage 0, more than its collectives would be if hidden) and
    stages 1-2's all-gather after the optimizer step (the next forward needs it). Beside the
    backward: the gradient reductions (stage 0's all-reduce, the others' reduce-scatter), which
    on a GPU (`cpu_share` None) hide behind the backward's compute and on CPU ranks take their
    CPU share of it."""
    waited = {0: 0.0, 1: one, 2: one, 3: 2 * one}[stage]
    reduced = 2 * one if stage == 0 else one
    if cpu_share is not None:
        return waited + cpu_share * reduced
    return waited + max(0.0, reduced - backward)


def rank(
    estimates: list[Estimate],
    params: int,
    tokens_per_rank: int,
    rates: Rates,
    recomputed: int | None = None,
    a2a_bytes: int = 0,
    units: tuple[tuple[int, ...], ...] | None = None,
) -> list[tuple[Estimate, Timing]]:
    """The estimates that fit, fastest first; among equal predicted times the one with the
    smaller peak (more memory left for what the estimate misses), then `estimates`' order
    (`candidates` gives the simplest first, exact before ZeRO++). `recomputed`, `a2a_bytes`
    and `units` as in `step_time`."""
    timed = [
        (e, step_time(e, params, tokens_per_rank, rates, recomputed, a2a_bytes, units))
        for e in estimates
        if e.fits
    ]
    return sorted(timed, key=lambda et: (et[1].total, rank_need(et[0])))


def kept_out_by_headroom(
    model: ModelShape,
    estimates: list[Estimate],
    ranked: list[tuple[Estimate, Timing]],
    tokens_per_rank: int,
    rates: Rates,
    a2a_bytes: int = 0,
) -> list[tuple[Estimate, Timing]]:
    """Configurations predicted faster than the choice (``ranked[0]``, as `rank` ranks
    `estimates` of `model`) that fit the memory in full but not with the headroom kept free
    (every one of those when nothing is ranked), estimated again with ``headroom=0`` on the
    same model (no second trace). Fastest first. The planner does not take them (the headroom
    is there for what the estimate misses) unless a trial run shows one fits (``partita plan
    --trial``), but says what they would gain."""
    without = [estimate(model, e.candidate, replace(e.hardware, headroom=0.0)) for e in estimates]
    chosen = ranked[0][1].total if ranked else float("inf")
    fits_now = {e.candidate for e, _ in ranked}
    return [
        (e, t)
        for e, t in rank(
            without,
            model.trainable,
            tokens_per_rank,
            rates,
            model.recomputed,
            a2a_bytes,
            model.units,
        )
        if e.candidate not in fits_now and t.total < chosen
    ]


def rank_need(est: Estimate) -> int:
    """Per-rank bytes the configuration needs where it is tightest: the device, or on CPU
    ranks the host (their device is the host)."""
    if est.hardware.accelerator == "cpu":
        return est.device + est.total("host")
    return est.device


def ds_config(
    c: Candidate, micro_batch: int, nvme_path: str | None = None, sequence_parallel_size: int = 1
) -> dict[str, Any]:
    """The DeepSpeed config of candidate `c` (AdamW; ``nvme_path`` for NVMe offload; the
    ``sequence_parallel_size`` key when above 1)."""
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
    zero.update(_zeropp_keys(c.zeropp))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    if c.precision != "fp32":
        config[c.precision] = {"enabled": True}
    if sequence_parallel_size > 1:
        config["sequence_parallel_size"] = sequence_parallel_size
    return config


def _zeropp_keys(opts: ZeroPP | None) -> dict[str, Any]:
    """The ``zero_optimization`` keys of ZeRO++'s options (none when off)."""
    if opts is None:
        return {}
    values = (
        opts.quantized_weights,
        opts.quantized_gradients,
        opts.gradient_bits,
        opts.error_feedback,
        opts.hpz,
    )
    keys = dict(zip(KEYS, values, strict=True))
    if not opts.quantized_gradients:
        keys = {k: v for k, v in keys.items() if not k.startswith("zero_quantized_gradients_")}
    return keys


def write_ds_config(path: str, config: dict[str, Any]) -> None:
    """Writes `config` as indented JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
