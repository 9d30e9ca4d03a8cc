"""partita's mixture of experts against DeepSpeed's own (0.19.8 on CPU, gloo): DeepSpeed's MoE
tutorial shape (dense layers around ``deepspeed.moe.layer.MoE``, loss = task loss + COEF *
l_aux, expert parameters in their own optimizer groups), dropless, fp32, trained by both in
the same 4 ranks with ep 2 x dp 2: per-step losses within 1e-5 of each other; and DeepSpeed's
gating functions against partita's on the same random draws, bitwise. Kept apart from
tests/test_moe.py: DeepSpeed is slow to start and may compile C++ ops on first use."""

from __future__ import annotations

import importlib.util

import pytest

from moe_workers import STEPS, deepspeed_then_partita
from partita.testing import run_distributed

if importlib.util.find_spec("deepspeed") is None:  # found, not imported: ranks import it
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

CASES = [{"ep": 2, "k": 1, "stage": 0}, {"ep": 2, "k": 2, "stage": 2}]
RTOL = 1e-5


@pytest.mark.parity
def test_losses_match_deepspeeds_moe() -> None:
    per_rank = run_distributed(
        deepspeed_then_partita,
        4,
        CASES,
        timeout=600,
        env={"DS_ACCELERATOR": "cpu", "PARTITA_AS_DEEPSPEED": "0"},
    )
    for rank, (gating, *results) in enumerate(per_rank):
        assert gating["gating_mismatches"] == [], rank
        for case, result in zip(CASES, results, strict=True):
            ds, ours = result["deepspeed"], result["partita"]
            assert len(ds) == len(ours) == STEPS
            for step, (a, b) in enumerate(zip(ours, ds, strict=True)):
                assert abs(a - b) <= RTOL * abs(b), (rank, case, step, ours, ds)
