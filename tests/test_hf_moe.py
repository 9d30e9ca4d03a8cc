"""Hugging Face MoE models with expert parallelism by their expert plan
(`partita.moe.expert_parallel`, [Note: Hugging Face expert plan] in `partita.moe.hf_experts`):
a tiny Mixtral (8 experts, top-2, dropless) from Transformers at 4 CPU ranks as ep 2 x dp 2
and ep 4, ZeRO stages 0-3, per-step losses within rtol 1e-6 of one process holding every
expert on the whole batch (AdamW; and SGD with clipping, which a mis-scaled expert gradient or
a norm counting experts twice would move); each rank holds E/ep experts; checkpoints refused by name. One
spawn runs every case."""

from __future__ import annotations

import pytest

from hf_moe_workers import EXPERTS, grid, reference
from models import assert_losses
from partita.testing import run_distributed

WORLD = 4
CASES = [{"ep": 2, "stage": s} for s in (0, 1, 2, 3)] + [{"ep": 4, "stage": s} for s in (0, 3)]
CASES += [{"ep": 2, "stage": s, "sgd": True} for s in (0, 2, 3)]


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_distributed(grid, WORLD, CASES, timeout=300)


@pytest.mark.parity
def test_losses_match_one_process_holding_every_expert(results: list[list[dict]]) -> None:
    want = {False: reference(WORLD), True: reference(WORLD, sgd=True)}
    for i, case in enumerate(CASES):
        for rank in results:
            assert_losses(rank[i]["losses"], want[case.get("sgd", False)])


def test_each_rank_holds_its_share_of_the_experts(results: list[list[dict]]) -> None:
    for i, case in enumerate(CASES):
        for r, rank in enumerate(results):
            got = rank[i]
            first = r - r % case["ep"]
            assert got["ep_ranks"] == list(range(first, first + case["ep"]))
            if case["stage"] < 3:
                assert got["local_experts"] == EXPERTS // case["ep"]
            assert got["moe_bytes"] > 0  # tokens went through the all-to-all


def test_checkpoints_are_refused_by_name(results: list[list[dict]]) -> None:
    for rank in results:
        for got in rank:
            assert "expert_parallel" in got["checkpoint"] and "save_checkpoint" in got["checkpoint"]
