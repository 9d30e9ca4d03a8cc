"""Stage 0 (data parallel) engine: parity with single-process torch.optim, accumulation,
determinism, mixed precision, overflow handling and communication accounting."""

from __future__ import annotations

import pytest
import torch

from engine_workers import assert_no_grads_at_forward, base_config, train_grid
from models import STEPS as PARITY_STEPS
from models import assert_parity, pairs, reference_run, with_float64
from partita.testing import run_distributed

STEPS = 20
RTOL = 1e-6


@pytest.mark.parity
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_parity_accumulation_clipping_and_determinism(world: int) -> None:
    micro = 2
    cases = [
        {"config": base_config(micro=2, gas=1), "steps": PARITY_STEPS},
        {"config": base_config(micro=2, gas=4), "steps": PARITY_STEPS},
        {"config": base_config(micro=8, gas=1), "steps": PARITY_STEPS},
        {"config": base_config(micro=2, gas=1, clip=0.05), "steps": PARITY_STEPS},
        {"config": base_config(micro=2, gas=1), "steps": PARITY_STEPS},  # the first, again: bitwise
    ]
    results = run_distributed(train_grid, world, with_float64(cases), timeout=240)
    plain, accum, big_micro, clipped, again = pairs(results[0])

    ref = reference_run(PARITY_STEPS, batch=micro * world)
    assert_parity(plain, ref)
    ref8 = reference_run(PARITY_STEPS, batch=8 * world)
    assert_parity(accum, ref8)
    assert_parity(big_micro, ref8)
    ref_clip = reference_run(PARITY_STEPS, batch=micro * world, clip=0.05)
    assert_parity(clipped, ref_clip)
    # Clipping must have changed the trajectory well beyond the tolerance, or the clipped case
    # proves nothing. Adam is nearly blind to a uniform scaling of the gradients, so clipping
    # acts only through the clip coefficient changing from step to step: after 10 steps the
    # losses are 3e-5 to 6e-5 apart (30-60x the tolerance), in both precisions.
    for clipped_losses, losses in (
        (ref_clip.losses, ref.losses),
        (ref_clip.losses64, ref.losses64),
    ):
        gap = max(abs(a - b) / abs(b) for a, b in zip(clipped_losses, losses, strict=True))
        assert gap > 10 * RTOL, gap

    for twin in (0, 1):  # fp32 and float64: the same run twice is bitwise the same
        assert again[twin]["losses"] == plain[twin]["losses"]
        for a, b in zip(again[twin]["params"], plain[twin]["params"], strict=True):
            assert torch.equal(a, b)
    # Every rank holds the same weights.
    for rank_results in results[1:]:
        for rank_case, case in zip(rank_results, results[0], strict=True):
            for a, b in zip(rank_case["params"], case["params"], strict=True):
                assert torch.equal(a, b)
    assert plain[0]["global_steps"] == PARITY_STEPS
    assert accum[0]["global_samples"] == PARITY_STEPS * 8 * world


def test_mixed_precision_tracks_fp32_and_overflow_is_skipped_everywhere() -> None:
    world = 2
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    cases = [
        {"config": base_config(micro=2, gas=1, lr=5e-3), "steps": STEPS},
        {"config": base_config(micro=2, gas=1, lr=5e-3, bf16={"enabled": True}), "steps": STEPS},
        {"config": base_config(micro=2, gas=1, lr=5e-3, fp16=fp16), "steps": STEPS},
        # inf on rank 1 at step 5 with hysteresis 1: skip everywhere, halve the scale.
        {
            "config": base_config(micro=2, gas=1, lr=5e-3, fp16=fp16),
            "steps": 8,
            "inject_inf": (1, (5,)),
        },
        # default hysteresis 2: the first overflow keeps the scale, the second halves it.
        {
            "config": base_config(
                micro=2, gas=1, lr=5e-3, fp16={"enabled": True, "initial_scale_power": 8}
            ),
            "steps": 8,
            "inject_inf": (1, (4, 5)),
        },
        {
            "config": base_config(micro=2, gas=1, lr=5e-3, bf16={"enabled": True}),
            "steps": 8,
            "inject_inf": (0, (3,)),
        },
    ]
    results = run_distributed(train_grid, world, cases, timeout=240)
    for run in results[0]:  # after applied and skipped steps: [Note: released gradients]
        assert_no_grads_at_forward(run)
    fp32, bf16, fp16_run, hyst1, _, _ = results[0]
    assert bf16["dtype"] == "torch.bfloat16" and fp16_run["dtype"] == "torch.float16"
    assert fp32["losses"][-1] < 0.8 * fp32["losses"][0]  # the model learns
    for run in (bf16, fp16_run):
        assert run["losses"] != fp32["losses"]  # really ran in 16 bits
        assert abs(run["losses"][-1] - fp32["losses"][-1]) <= 1e-2 * abs(fp32["losses"][-1])
        assert run["skipped"] == 0

    for rank_results in results:
        h1, h2, b = rank_results[3], rank_results[4], rank_results[5]
        assert h1["applied"] == [True] * 5 + [False] + [True] * 2
        assert h1["unchanged"][5] and not h1["unchanged"][4]
        assert h1["skipped"] == 1
        assert h1["scales"][5] == h1["scales"][4] / 2
        assert h2["applied"][4:6] == [False, False] and h2["skipped"] == 2
        assert h2["scales"][4] == h2["scales"][3] and h2["scales"][5] == h2["scales"][3] / 2
        assert b["applied"][3] is False and b["unchanged"][3] and b["skipped"] == 1
    assert any("step 5" in m and "skipped" in m for m in hyst1["warnings"])


def test_gradient_all_reduce_bytes_equal_gradient_bytes() -> None:
    cases = [
        {
            "config": base_config(micro=2, gas=1, zero_optimization={"reduce_bucket_size": 3000}),
            "steps": 3,
        },
        {"config": base_config(micro=2, gas=4), "steps": 3},
        {"config": base_config(micro=2, gas=1, bf16={"enabled": True}), "steps": 3},
    ]
    for result in run_distributed(train_grid, 2, cases, timeout=240)[0]:
        for step_bytes in result["comm"]:
            grad = sum(v for (op, tag), v in step_bytes.items() if tag == "grad")
            assert step_bytes.get(("all_reduce", "grad")) == result["grad_bytes"] == grad


def test_monitors_receive_deepspeed_events(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine_workers import monitored_run

    files = run_distributed(monitored_run, 2, str(tmp_path), timeout=240)[0]
    for name in ("train_loss", "lr", "loss_scale", "samples_per_sec"):
        path = tmp_path / "job" / f"Train_Samples_{name}.csv"
        rows = path.read_text().strip().splitlines()
        assert rows[0] == f"step,{name}" and len(rows) == 4, rows  # header + 3 steps
    steps = [
        int(r.split(",")[0])
        for r in (tmp_path / "job" / "Train_Samples_lr.csv").read_text().split()[1:]
    ]
    assert steps == [4, 8, 12]  # global samples: 2 per rank x 2 ranks per step
    assert any(f.startswith("tb/events.out.tfevents") for f in files)
