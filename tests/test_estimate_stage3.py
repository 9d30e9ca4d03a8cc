"""partita.estimate at stage 3: the buffers that peak at different moments of a step are not
added together ([Note: stage-3 moments] in ``partita/estimate/stage3_moments.py``). No
processes: the measured side is ``benchmarks/bench_estimate.py``'s validation table."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partita.estimate import MODEL_STATES, Candidate, Estimate, Hardware, ModelShape, Settings
from partita.estimate import estimate as estimate_
from partita.estimate.memory import _stage3_moments
from partita.estimate.model import from_hf_config

# The validation table's smaller model: GPT-2 of ~9M parameters, micro-batch 4 x 128, fp32.
SHAPE: dict[str, Any] = {
    "n_layer": 6,
    "n_embd": 256,
    "n_head": 4,
    "n_positions": 256,
    "vocab_size": 16384,
}
CPU2 = Hardware(2, accelerator="cpu")


@pytest.fixture(scope="module")
def gpt2() -> ModelShape:
    from transformers import GPT2Config

    cfg = GPT2Config(**SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return from_hf_config(cfg, 4, 128, torch.float32)


def _training(e: Estimate) -> int:
    """Bytes in memory beyond the model states, before allocator slack and the runtime."""
    skip = {*MODEL_STATES, "allocator slack", "runtime"}
    return sum(i.device + i.host for i in e.items if i.name not in skip)


def _item(e: Estimate, where: str, name: str = "nvme buffers") -> int:
    return sum(getattr(i, where) for i in e.items if i.name == name)


def test_nvme_buffers_are_not_added_to_the_activation_peak(gpt2: Any) -> None:
    """The activation peak (the loss's backward) holds no NVMe buffer: the forward freed every
    shard it read ahead, nothing is written through before a unit reduces, and the step's
    sub-groups are out. So swapping the optimizer to NVMe removes its states from the peak
    and adds nothing. Measured (benchmarks/results/estimate_10m_50m.md): the NVMe cell's
    peak is the no-offload cell's less the model states. (With parameters on NVMe too, the
    shards read ahead of the head's backward can make that moment the peak.)"""
    for cand in (Candidate(3, "nvme", "none", "fp32"), Candidate(3, "nvme", "nvme", "fp32")):
        moms = _stage3_moments(cand, gpt2, 2, Settings(), 4)
        assert next(mo for mo in moms if mo.name == "loss backward").nvme == 0
    none = estimate_(gpt2, Candidate(3, precision="fp32"), CPU2)
    nvme = estimate_(gpt2, Candidate(3, "nvme", "none", "fp32"), CPU2)
    assert _training(nvme) == _training(none)
    assert any("loss backward" in note for note in nvme.notes)
    assert nvme.peaks["nvme buffers"] > 0  # they exist, at other moments


def test_the_step_writes_back_a_parameter_shard_beside_its_sub_groups() -> None:
    """Where the step decides the NVMe buffers (no activations; pipelined reads and writes
    keep three sub-groups resident, each with master, gradient and Adam's two moments), the
    shard of the unit being stepped is in memory too: the step copies its masters into it
    and writes it back after the unit's last sub-group (zero/stage3/strategy.py)."""
    model = ModelShape.from_count(10**9, 10**8)
    n, p = 4, 2
    shard = 10**8 // n
    est = estimate_(model, Candidate(3, "nvme", "nvme"), Hardware(n), Settings(nvme_pipeline=True))
    assert _item(est, "host") == 3 * shard * (4 + 4 + 8) + shard * p


def test_on_gpus_host_memory_holds_the_nvme_buffers_largest_moment(gpt2: Any) -> None:
    """GPU ranks keep NVMe buffers in host memory, a memory apart from the device's: its
    figure is the buffers' own largest, whichever moment decides the device's peak."""
    est = estimate_(gpt2, Candidate(3, "nvme", "nvme", "fp32"), Hardware(2))
    assert _item(est, "host") == est.peaks["nvme buffers"] > 0


def test_max_in_cpu_keeps_the_first_units_shards_in_host_memory() -> None:
    """``offload_param.max_in_cpu``: units take from it in build order while their shard fits
    (zero/stage3/strategy.py); those shards are host memory, the rest NVMe."""
    model = ModelShape.from_count(10**9, 10**8)  # 10 units of 1e8
    n, p, shard = 4, 2, 10**8 // 4
    cand = Candidate(3, "cpu", "nvme")
    est = estimate_(model, cand, Hardware(n), Settings(param_max_in_cpu=int(2.5 * shard)))
    params = next(i for i in est.items if i.name == "parameters")
    assert (params.host, params.nvme) == (2 * shard * p, 8 * shard * p)
    every = estimate_(model, cand, Hardware(n), Settings(param_max_in_cpu=10 * shard))
    assert _item(every, "host") == 0  # nothing swapped: nothing read ahead or written back
