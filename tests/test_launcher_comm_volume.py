"""The bytes a training step moves per rank, per ZeRO stage, against the formulas
docs/scaling.md builds its step-time estimates on: 2Ψ elements for stages 0-2 (an all-reduce of
the gradients, or their reduce-scatter and the updated parameters' all-gather), 3Ψ for stage 3
(the parameters gathered in forward and again in backward, the gradients reduce-scattered).
Measured with partita's comm counters at world sizes 2 and 4 (gloo's own collectives)."""

from __future__ import annotations

import pytest

from multinode_comm_volume import NATIVE, step_traffic, volume_in_psi
from partita.testing import run_distributed_grid

FP32 = 4

# stage -> the model-state payload bytes per op/tag, as multiples of Ψ fp32 elements.
EXPECTED = {
    0: {"all_reduce/grad": 1},
    1: {"reduce_scatter/grad": 1, "all_gather/param": 1},
    2: {"reduce_scatter/grad": 1, "all_gather/param": 1},
    3: {"reduce_scatter/grad": 1, "all_gather/param": 2},
}


@pytest.mark.parametrize("world", [2, 4])
def test_step_traffic_is_2_psi_for_stages_0_to_2_and_3_psi_for_stage_3(world: int) -> None:
    cases = [{"stage": stage} for stage in EXPECTED]
    results = run_distributed_grid(step_traffic, world, cases, timeout=600, env=NATIVE)
    for stage, per_rank in zip(EXPECTED, results, strict=True):
        for traffic in per_rank:  # every rank moves the same
            psi = traffic["psi"]
            model_state = {
                k: v for k, v in traffic["bytes"].items() if k.split("/")[1] in ("grad", "param")
            }
            want = {k: n * psi * FP32 for k, n in EXPECTED[stage].items()}
            assert model_state == want, (stage, traffic)
            assert volume_in_psi(traffic) == (3 if stage == 3 else 2)
