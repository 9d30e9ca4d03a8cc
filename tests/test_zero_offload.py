"""CPU offload of optimizer state (stages 1-3) and parameters (stage 3): the same training,
bit for bit, as without offload.

On this CPU-only machine the host is also the compute device, so these runs exercise the
offload code paths (placement, cross-device copies, host-side norm) but not a real device-host
transfer; the GPU path is the same code with the tensors on different devices.
"""

from __future__ import annotations

import pytest
import torch

from engine_workers import base_config, train_grid
from partita.testing import run_distributed

STEPS = 10
CPU = {"device": "cpu"}


def _zero(stage: int, **extra: object) -> dict:
    z: dict = {"stage": stage, "reduce_bucket_size": 3000, **extra}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0)
    return {"zero_optimization": z}


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_offload_is_bitwise_equal_to_no_offload(world: int) -> None:
    cases = []
    variants = [
        (1, {"offload_optimizer": CPU}),
        (2, {"offload_optimizer": CPU}),
        (3, {"offload_optimizer": CPU}),
        (3, {"offload_optimizer": CPU, "offload_param": CPU}),
    ]
    for precision in ({}, {"bf16": {"enabled": True}}):
        for stage, offload in variants:
            cases.append({"config": base_config(2, 1, **precision, **_zero(stage)), "steps": STEPS})
            cases.append(
                {
                    "config": base_config(2, 1, **precision, **_zero(stage, **offload)),
                    "steps": STEPS,
                }
            )
    results = run_distributed(train_grid, world, cases, timeout=300)[0]
    for plain, offloaded in zip(results[::2], results[1::2], strict=True):
        assert offloaded["losses"] == plain["losses"]
        assert all(
            torch.equal(a, b) for a, b in zip(offloaded["params"], plain["params"], strict=True)
        )
