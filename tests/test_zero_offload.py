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


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_optimizer_offload_is_bitwise_equal_and_cleans_up(world: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cases = []
    for precision in ({}, {"bf16": {"enabled": True}}):
        cases.append({"config": base_config(2, 1, **precision, **_zero(3)), "steps": STEPS})
        cases.append(
            {
                "config": base_config(2, 1, **precision, **_zero(3, offload_optimizer=nvme)),
                "steps": STEPS,
            }
        )
    results = run_distributed(train_grid, world, cases, timeout=300)[0]
    for plain, offloaded in zip(results[::2], results[1::2], strict=True):
        assert offloaded["losses"] == plain["losses"]
        assert all(
            torch.equal(a, b) for a, b in zip(offloaded["params"], plain["params"], strict=True)
        )
        # Masters and Adam's moments are out of memory between steps; only the 4-byte step
        # counters (one per master) stay.
        assert offloaded["memory"]["master_params"] == 0
        assert offloaded["memory"]["optimizer_state"] <= 4 * 16
    assert list(tmp_path.iterdir()) == []  # swap files removed when the ranks exit


def test_nvme_offload_bad_paths_fail_before_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import partita
    from models import make_model
    from partita.config import ConfigError

    missing = tmp_path / "missing"
    for offload, expected in [
        ({"device": "nvme", "nvme_path": str(missing)}, "offload_optimizer.nvme_path"),
        ({"device": "nvme"}, "nvme_path"),
    ]:
        model = make_model()
        config = base_config(2, 1, **_zero(3, offload_optimizer=offload))
        with pytest.raises(ConfigError, match=expected):
            partita.initialize(model=model, config=config, dist_init_required=False)
    stage2 = base_config(
        2, 1, **_zero(2, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    )
    with pytest.raises(ConfigError, match=r"needs zero_optimization\.stage 3"):
        partita.initialize(model=make_model(), config=stage2, dist_init_required=False)
