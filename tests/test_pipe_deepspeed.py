"""partita's pipeline engine against DeepSpeed's own (0.19.8 on CPU, gloo): the same GPT-ish
`PipelineModule` script (seeded layers, 1F1B over 4 micro-batches, fp32, ZeRO 0), untied and
with the head tied to the embedding at 2 ranks, and tied at 4 ranks as pp 2 x dp 2 and pp 4,
trained by both in the same processes: per-step losses within rtol 1e-6 of each other (on the
machine that wrote this they are bitwise equal). Kept apart from tests/test_pipe_engine.py:
DeepSpeed compiles C++ ops on first use in a fresh venv."""

from __future__ import annotations

import importlib.util

import pytest

from models import LOSS_RTOL
from partita.testing import run_distributed
from pipe_workers import deepspeed_then_partita

if importlib.util.find_spec("deepspeed") is None:  # found, not imported: ranks import it
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

CASES = [
    {"tied": tied, "stages": 2, "dp": 1, "micro": 2, "gas": 4, "steps": 4} for tied in (False, True)
]
FOUR = [
    {"tied": True, "stages": stages, "dp": 4 // stages, "micro": 2, "gas": 4, "steps": 4}
    for stages in (2, 4)
]
"""At 4 ranks: pp 2 x dp 2 and pp 4, the tied head."""


@pytest.mark.parity
@pytest.mark.parametrize("world, cases", [(2, CASES), (4, FOUR)], ids=["pp2", "pp2xdp2-pp4"])
def test_losses_match_deepspeeds_pipeline_engine(world: int, cases: list[dict]) -> None:
    # 600 s: DeepSpeed compiles its C++ ops on first use in a venv (minutes on two busy cores).
    per_rank = run_distributed(
        deepspeed_then_partita,
        world,
        cases,
        timeout=600,
        env={"DS_ACCELERATOR": "cpu", "PARTITA_AS_DEEPSPEED": "0"},
    )
    for rank, results in enumerate(per_rank):
        for case, result in zip(cases, results, strict=True):
            ds, ours = result["deepspeed"], result["partita"]
            assert len(ds) == len(ours) == case["steps"]
            for step, (a, b) in enumerate(zip(ours, ds, strict=True)):
                assert abs(a - b) <= LOSS_RTOL * abs(b), (rank, case, step, ours, ds)
