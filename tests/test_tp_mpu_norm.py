"""Gradient norm, clipping and the fp16 skip with a tensor-parallel ``mpu`` (issue 36).

Four ranks run a Megatron-style block as tensor parallel 2 x data parallel 2, given to
`partita.initialize` through a DeepSpeed/Megatron ``mpu`` (see tests/tp_mpu_workers.py). The
global norm is the whole model's: squares summed over the data-parallel group and then the
tensor-parallel group, parameters replicated over the tensor ranks counted once (DeepSpeed's
rule). So the engine's norm equals the one-process reference's pre-clip norm, and each rank's
weight slices follow the reference's under active clipping at every ZeRO stage. In fp16 an
inf on one rank's gradient makes all four ranks skip the step and lower the loss scale alike.

All cases run in one spawn of four ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from partita.testing import run_distributed
from tp_mpu_workers import CLIP, INF_STEP, REPLICATED, STEPS, tp_mpu_worker

STAGES = (0, 1, 2, 3)
FP32 = [{"stage": s} for s in STAGES] + [{"stage": 3, "nvme": True}]
"""The parity cases: every stage, and stage 3 with its optimizer state swapped to files."""
FP16 = [{"stage": s, "fp16": True} for s in STAGES] + [
    {"stage": 2, "fp16": True, "inf_in": "norm.weight"}
]
"""The skip cases: an inf in a split parameter's gradient at every stage, and in a replicated
one's on tensor rank 1 (the rank whose replicated squares do not count)."""
CASES = FP32 + FP16
RTOL = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    nvme = str(tmp_path_factory.mktemp("tp-swap"))
    return run_distributed(tp_mpu_worker, 4, CASES, nvme, timeout=240)


def _prefixed(at: str) -> Callable[[str], str]:
    """An ``assert_close`` message that says where."""
    return lambda message: f"{at}: {message}"


def _runs(ranks: list[dict[str, Any]], case: dict[str, Any]) -> list[dict[str, Any]]:
    i = CASES.index(case)
    return [r["runs"][i] for r in ranks]


def test_reference_clips_every_step(ranks: list[dict[str, Any]]) -> None:
    """The test means something: the reference's norm exceeds the clip at every step."""
    assert all(n > 2 * CLIP for n in ranks[0]["reference"]["norms"]), ranks[0]["reference"]


@pytest.mark.parametrize("case", FP32, ids=str)
def test_norm_and_weights_match_the_whole_model(
    ranks: list[dict[str, Any]], case: dict[str, Any]
) -> None:
    for rank, (info, run) in enumerate(zip(ranks, _runs(ranks, case), strict=True)):
        ref = info["reference"]
        where = f"{case}, rank {rank}"
        for step, (got, want) in enumerate(zip(run["norms"], ref["norms"], strict=True)):
            assert got == pytest.approx(want, rel=RTOL), f"{where}, step {step}: norm"
        want_slices = ref["slices"][info["tp_rank"]]
        for i, (got, want) in enumerate(zip(run["params"][-1], want_slices, strict=True)):
            torch.testing.assert_close(
                got, want, rtol=RTOL, atol=0.0, msg=_prefixed(f"{where}, param {i}")
            )
        # The engine knows its tensor-parallel place (DeepSpeed's get_model_parallel_rank).
        assert run["dims"] == (rank % 2, 2, rank // 2, 2), where


@pytest.mark.parametrize("case", FP16, ids=str)
def test_fp16_inf_on_one_tensor_rank_skips_every_rank(
    ranks: list[dict[str, Any]], case: dict[str, Any]
) -> None:
    runs = _runs(ranks, case)
    where = str(case)
    # Every rank: the step with the inf is skipped and halves the scale; the others apply.
    scales = {tuple(r["scales"]) for r in runs}
    assert len(scales) == 1, f"{where}: loss scales differ across ranks: {scales}"
    (scale,) = scales
    assert scale[INF_STEP] == scale[INF_STEP - 1] / 2, f"{where}: {scale}"
    for rank, run in enumerate(runs):
        at = f"{where}, rank {rank}"
        assert run["skipped"] == [0] + [1] * (STEPS - 1), f"{at}: {run['skipped']}"
        assert not math.isfinite(run["norms"][INF_STEP]), f"{at}: {run['norms']}"
        before, skipped, after = (run["params"][s] for s in (INF_STEP - 1, INF_STEP, INF_STEP + 1))
        for a, b in zip(before, skipped, strict=True):
            assert torch.equal(a, b), f"{at}: weights changed in the skipped step"
        assert any(not torch.equal(a, b) for a, b in zip(skipped, after, strict=True)), at
    # The replicated parameters (LayerNorm, last bias) stay equal across the tensor ranks.
    for pair in ((0, 1), (2, 3)):
        for i in REPLICATED:
            a, b = (runs[r]["params"][-1][i] for r in pair)
            assert torch.equal(a, b), f"{where}, ranks {pair}, param {i}"


def test_inconsistent_tensor_groups_are_refused(ranks: list[dict[str, Any]]) -> None:
    for rank, info in enumerate(ranks):
        liar, same = info["refused"]
        assert "mpu.get_tensor_model_parallel_world_size()=4" in liar, liar
        assert f"rank {rank}: mpu.get_tensor_model_parallel_group()" in same, same
        assert "must cross in this rank only" in same and "cover the 4 ranks" in same, same
