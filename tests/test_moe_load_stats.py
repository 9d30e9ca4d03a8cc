"""Per-step expert load statistics in the monitor ([Note: expert load statistics] in
`partita.moe.load_stats`): a DeepSpeed-style MoE layer at 2 ranks whose gate sends every token
to expert 0, so the figures are known in closed form (imbalance E, dropped 1 - capacity / S),
with gradient accumulation and activation checkpointing (recomputed forwards not counted), the
CSV events written per layer, and the aux loss the layers returned, averaged over every rank's
forwards. One spawn."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partita.testing import run_distributed

EXPERTS, WIDTH, TOKENS, ACCUM, STEPS, CAPACITY_FACTOR = 4, 8, 16, 2, 2, 1.0


class _Net(nn.Module):
    """One MoE layer of linear experts, checkpointed, between two linears."""

    def __init__(self) -> None:
        super().__init__()
        from partita.compat.deepspeed.moe.layer import MoE

        self.moe = MoE(
            WIDTH, nn.Linear(WIDTH, WIDTH), num_experts=EXPERTS, ep_size=1, k=1,
            capacity_factor=CAPACITY_FACTOR, min_capacity=1, drop_tokens=True,
        )  # fmt: skip
        with torch.no_grad():  # every (positive) token's logit is largest for expert 0
            self.moe.deepspeed_moe.gate.wg.weight.zero_()
            self.moe.deepspeed_moe.gate.wg.weight[0].fill_(10.0)
        self.head = nn.Linear(WIDTH, 1)
        self.aux: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = torch.utils.checkpoint.checkpoint(self.moe, x, use_reentrant=False)
        self.aux.append(float(l_aux))
        return self.head(out).pow(2).mean() + 0.01 * l_aux


def _worker(out_dir: str) -> dict[str, Any]:
    import partita
    from partita import comm

    torch.manual_seed(0)
    model = _Net()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
        "steps_per_print": 1000,
    }
    engine, *_ = partita.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    figures = []
    for _ in range(STEPS):
        for _ in range(ACCUM):
            x = torch.rand(TOKENS, WIDTH, generator=g) + 0.1
            engine.backward(engine(x))
            engine.step()  # DeepSpeed's way: every micro-batch, stepping at the boundary
        figures.append(engine.moe_load_stats())
    aux = torch.tensor(model.aux[-ACCUM:], dtype=torch.float64).sum()
    comm.all_reduce(aux, tag="test")
    engine.destroy()
    return {"figures": figures, "aux_last_step": float(aux) / (ACCUM * comm.get_world_size())}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("moe-stats")
    return run_distributed(_worker, 2, str(out), timeout=240), out


def test_figures_are_the_routing_in_closed_form(results: tuple[list[dict], Path]) -> None:
    """Every route goes to expert 0: imbalance E; capacity ceil(S / E) of S routes kept; the
    routes of every rank's forwards, the checkpoint's recomputations not counted again."""
    ranks, _ = results
    capacity = math.ceil(TOKENS / EXPERTS * CAPACITY_FACTOR)
    for rank in ranks:
        assert len(rank["figures"]) == STEPS
        for step in rank["figures"]:
            ((layer, values),) = step.items()
            assert layer == "moe.deepspeed_moe"
            # Each rank's ACCUM forwards, top-1, counted once (not again when recomputed).
            assert values["routes"] == ACCUM * TOKENS * len(ranks)
            assert values["imbalance"] == pytest.approx(EXPERTS, rel=1e-12)
            assert values["dropped"] == pytest.approx(1 - capacity / TOKENS, rel=1e-12)


def test_aux_loss_is_the_mean_over_every_ranks_forwards(results: tuple[list[dict], Path]) -> None:
    """Averaged over the step's forwards on both ranks (not the checkpoint's recomputations:
    those are not counted, or the mean would weigh the recomputed ones twice)."""
    ranks, _ = results
    for rank in ranks:
        got = rank["figures"][-1]["moe.deepspeed_moe"]["l_aux"]
        assert got == pytest.approx(rank["aux_last_step"], rel=1e-12)


def test_monitor_writes_one_event_per_layer_and_figure(results: tuple[list[dict], Path]) -> None:
    ranks, out = results
    for figure in ("routes", "imbalance", "dropped", "l_aux"):
        name = f"Train_MoE_moe.deepspeed_moe_{figure}.csv"
        found = [os.path.join(d, name) for d, _, files in os.walk(out) if name in files]
        assert len(found) == 1, (name, sorted(p.name for p in out.rglob("*.csv")))
        with open(found[0], encoding="utf-8") as f:
            rows = list(csv.reader(f))[1:]
        assert len(rows) == STEPS
        want = [step["moe.deepspeed_moe"][figure] for step in ranks[0]["figures"]]
        assert [float(r[1]) for r in rows] == pytest.approx(want, rel=1e-6)
