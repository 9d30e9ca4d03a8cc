"""The state-access interface (`partita.zero.state_access.ParamStates`) is one implementation
over every stage's layout: the same reads and writes give the same values in stages 0-3."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partita.testing import run_distributed
from state_access_workers import STAGES, state_probe_all_stages

WORLD = 2


@pytest.fixture(scope="module")
def probes() -> list[dict[int, dict[str, Any]]]:
    return run_distributed(state_probe_all_stages, WORLD, timeout=400)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage", STAGES[1:])
def test_full_values_equal_stage_0(probes: list[dict[int, dict[str, Any]]], stage: int) -> None:
    reference = probes[0][0]
    for rank in probes:
        got = rank[stage]
        assert got["owns"] == reference["owns"]
        for what in ("param", "grad", "exp_avg", "exp_avg_sq", "step"):
            assert _equal(got[what], reference[what]), (stage, what)


@pytest.mark.parametrize("stage", STAGES)
def test_local_parts_reassemble_and_writes_round_trip(
    probes: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    ranks = [r[stage] for r in probes]
    full = ranks[0]["param"]
    for i, value in enumerate(full):
        flat = torch.zeros(value.numel())
        for r in ranks:
            offset = 0
            for at, n in r["ranges"][i]:
                flat[at : at + n] = r["local_param"][i][offset : offset + n]
                offset += n
        assert torch.equal(flat, value.reshape(-1)), (stage, i)
        # Stage 0 replicates, sharded stages split: owned elements add up to the parameter.
        owned = sum(n for r in ranks for _, n in r["ranges"][i])
        assert owned == value.numel() * (WORLD if stage == 0 else 1)
    for r in ranks:
        assert torch.all(r["after_set_local"] == 0.25)
        assert torch.all(r["after_set_full_state"] == 3.0)
        # Only stage 3 holds frozen parameters (in their units); no stage trains them.
        assert all(r["holds_frozen"]) if stage == 3 else not any(r["holds_frozen"])
        assert (
            r["frozen_error"] is not None
            and "not trained by any partita engine" in r["frozen_error"]
        )
        assert r["grad_after_step"] == [None] * len(full)
        assert r["set_grad_error"] is not None and "run a backward first" in r["set_grad_error"]
