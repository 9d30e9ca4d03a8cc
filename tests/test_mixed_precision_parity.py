"""bf16 and fp16 training, step by step, against mixed-precision training written in plain torch.

The reference (`mixed_precision_workers.reference_run16`, torch only) keeps a 16-bit copy of the
model for forward and backward and fp32 master weights stepped by fused ``torch.optim.AdamW``;
fp16 adds DeepSpeed's loss scaling (`RefScaler`). It mirrors what partita does, read from
src/partita/engine.py, precision/ and zero/:

- the fp32 loss is multiplied by the loss scale before backward, so gradients are 16-bit and
  scaled;
- each rank's 16-bit gradients are summed over ranks in 16-bit (``communication_data_type``
  defaults to the module dtype) and then multiplied by 1/world_size in 16-bit (DeepSpeed's
  default: no pre-division);
- the averaged gradient is upcast to fp32 and multiplied by 1/scale;
- any non-finite gradient skips the step on every rank and feeds the loss scaler; otherwise
  AdamW steps the fp32 masters, which are cast back (round to nearest even) into the module.

Tolerance: none. Every comparison is bitwise (per-rank per-step losses, the loss scale each step
used, which steps were applied, the final 16-bit weights and fp32 masters). That is derivable,
not hoped for: the reference computes each rank's gradient with the same ops on the same
micro-batch shape (inside the spawned rank, so with the same intra-op thread count); with one or
two ranks a sum over ranks has a single rounding whatever order the collective takes
(a + b == b + a), so gloo's all-reduce, partita's two-rank exchange and the reference's 16-bit
add give the same bits; and partita's CPU Adam is bitwise torch's fused kernel.

Four ranks are not compared here: gloo's all-reduce then rounds partial sums to 16 bits at each
hop, in an order that depends on how it chunks the buffer (stage 0's buckets and stage 1-3's
segments differ), so no rank-order reference reproduces it; per-step losses then drift by
about 1e-4 relative within a few steps (Adam turns last-bit gradient differences into lr-sized
steps), and no tight bound follows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mixed_precision_workers import mixed_case
from partita.testing import GridCache

STEPS = 8
GAS_STEPS = 4
DYNAMIC = {
    "loss_scale": 0,
    "initial_scale_power": 16,  # DeepSpeed's default: the tiny model overflows at times
    "loss_scale_window": 3,  # short, so the scale also grows within the run
    "hysteresis": 2,
    "min_loss_scale": 1,
}
# A scale small enough never to overflow by itself, so only the injected infs do: the first
# spends the hysteresis, the second (the next step) halves the scale.
INJECTED = {**DYNAMIC, "initial_scale_power": 8}
INJECT_STEPS = (3, 4)
STATIC = {"loss_scale": 1024}
# Overflows two steps apart with hysteresis 2 (no growth within the run): DeepSpeed's default
# halves the scale at the second; with consecutive_hysteresis the clean step between refills
# the hysteresis and the scale stays.
APART_STEPS = (2, 4)
APART = {**INJECTED, "loss_scale_window": 100}
APART_CONSECUTIVE = {**APART, "consecutive_hysteresis": True}
CLIP = {"gradient_clipping": 0.05}  # below every step's gradient norm: every step clips


def _cases(world: int) -> list[dict[str, Any]]:
    last = world - 1  # the inf enters on the last rank (the other rank(s) must skip too)
    cases: list[dict[str, Any]] = []
    # The loss scaler is the engine's, not a stage's: its hysteresis variants run on stage 0.
    cases += [
        {"precision": "fp16", "stage": 0, "steps": 6, "fp16": f, "inject": (last, APART_STEPS)}
        for f in (APART, APART_CONSECUTIVE)
    ]
    # Clipping on stage 0 only: stages 1-3 take the global norm over flat shards, a different
    # summation than torch's per-tensor norms, so it agrees only to rounding (see the module
    # docstring); stage 0 computes it as torch.nn.utils.clip_grad_norm_ does.
    cases += [
        {"precision": "bf16", "stage": 0, "steps": STEPS, "extra": CLIP},
        {"precision": "fp16", "stage": 0, "steps": STEPS, "fp16": DYNAMIC, "extra": CLIP},
    ]
    for stage in (0, 1, 2, 3):
        cases += [
            {"precision": "bf16", "stage": stage, "steps": STEPS},
            {"precision": "fp16", "stage": stage, "steps": STEPS, "fp16": DYNAMIC},
            {
                "precision": "fp16",
                "stage": stage,
                "steps": STEPS,
                "fp16": INJECTED,
                "inject": (last, INJECT_STEPS),
            },
            {
                "precision": "fp16",
                "stage": stage,
                "steps": STEPS,
                "fp16": STATIC,
                "inject": (last, (2,)),
            },
            {"precision": "bf16", "stage": stage, "steps": STEPS, "inject": (0, (5,))},
            # Accumulation: stages 0-1 sum micro steps' 16-bit gradients locally and reduce
            # once, stages 2-3 reduce every micro step and sum in fp32.
            {"precision": "bf16", "stage": stage, "steps": GAS_STEPS, "gas": 2},
            {"precision": "fp16", "stage": stage, "steps": GAS_STEPS, "gas": 2, "fp16": DYNAMIC},
            # fp32 communication: stage 0 rounds the fp32 sum back into its 16-bit gradients,
            # stages 1-3 keep it in fp32.
            {"precision": "bf16", "stage": stage, "steps": STEPS, "comm_dtype": "fp32"},
            {
                "precision": "fp16",
                "stage": stage,
                "steps": STEPS,
                "fp16": DYNAMIC,
                "comm_dtype": "fp32",
            },
            # Averaging around the sum: 1/f before and f/world after, or 1/world before.
            {
                "precision": "bf16",
                "stage": stage,
                "steps": STEPS,
                "extra": {"gradient_predivide_factor": 2.0},
            },
            {
                "precision": "fp16",
                "stage": stage,
                "steps": STEPS,
                "fp16": DYNAMIC,
                "extra": {"prescale_gradients": True},
            },
        ]
    return cases


def _case_id(case: dict[str, Any]) -> str:
    scaling = {
        id(DYNAMIC): "-dynamic",
        id(INJECTED): "-dynamic",
        id(STATIC): "-static",
        id(APART): "-hysteresis",
        id(APART_CONSECUTIVE): "-consecutive_hysteresis",
    }
    kind = case["precision"] + scaling.get(id(case.get("fp16")), "")
    inject = "-inf" if "inject" in case else ""
    gas = f"-gas{case['gas']}" if "gas" in case else ""
    comm = f"-comm_{case['comm_dtype']}" if "comm_dtype" in case else ""
    averaging = "".join(f"-{k}" for k in case.get("extra", {}))
    return f"stage{case['stage']}-{kind}{inject}{gas}{comm}{averaging}"


GRID = [(world, i, case) for world in (1, 2) for i, case in enumerate(_cases(world))]


@pytest.mark.parametrize(
    ("world", "index", "case"), GRID, ids=[f"w{w}-{_case_id(c)}" for w, _, c in GRID]
)
def test_matches_plain_torch_mixed_precision_bitwise(
    distributed_grid: GridCache, world: int, index: int, case: dict[str, Any]
) -> None:
    per_rank = distributed_grid.case(mixed_case, world, _cases(world), index, timeout=300)
    ref = per_rank[0]["reference"]
    for rank, got in enumerate(per_rank):
        assert got["losses"] == ref["losses"][rank], f"rank {rank}: per-step losses"
        assert got["scales"] == ref["scales"], f"rank {rank}: loss scale used by each step"
        assert got["final_scale"] == ref["final_scale"]
        assert got["applied"] == ref["applied"], f"rank {rank}: applied steps"
        for i, (w, want) in enumerate(zip(got["weights"], ref["weights"], strict=True)):
            assert w.dtype == want.dtype and torch.equal(w, want), f"rank {rank}: weight {i}"
        for i, (m, want) in enumerate(zip(got["masters"], ref["masters"], strict=True)):
            assert torch.equal(m, want), f"rank {rank}: fp32 master {i}"
        if case["stage"] == 0:  # the same per-tensor norms as torch's get_total_norm
            assert _same_floats(got["norms"], ref["norms"]), f"rank {rank}: gradient norms"
    _check_case_exercises_what_it_claims(case, ref)


def _same_floats(a: list[float], b: list[float]) -> bool:
    """Equal lists, where nan equals nan (an overflowed step's norm)."""
    return torch.equal(
        torch.tensor(a, dtype=torch.float64).nan_to_num(nan=-1.0),
        torch.tensor(b, dtype=torch.float64).nan_to_num(nan=-1.0),
    )


def _check_case_exercises_what_it_claims(case: dict[str, Any], ref: dict[str, Any]) -> None:
    """Guards against a vacuous pass: the injected steps are skipped and, with dynamic
    scaling, the scale moved as DeepSpeed's rules say for this case."""
    skipped = [s for s, ok in enumerate(ref["applied"]) if not ok]
    scales = ref["scales"]
    if "inject" in case:
        assert set(case["inject"][1]) <= set(skipped)
    if case.get("fp16") is INJECTED:
        first, second = INJECT_STEPS
        assert skipped == [first, second]
        assert scales[second] == scales[first]  # the first overflow only spends hysteresis
        assert scales[second + 1] == scales[first] / 2  # the second halves the scale
        # three clean steps after the last overflow double it again
        assert ref["final_scale"] == scales[first]
    if case.get("fp16") is APART:
        assert skipped == list(APART_STEPS) and scales[-1] == scales[0] / 2
    if case.get("fp16") is APART_CONSECUTIVE:
        assert skipped == list(APART_STEPS) and set(scales) == {scales[0]}
    if case.get("extra") is CLIP:
        finite = [n for n, ok in zip(ref["norms"], ref["applied"], strict=True) if ok]
        assert min(finite) > CLIP["gradient_clipping"]
    if case.get("fp16") is STATIC:
        assert set(scales) == {1024.0} and ref["final_scale"] == 1024.0
    if case.get("fp16") is DYNAMIC and case["steps"] >= 2 * DYNAMIC["loss_scale_window"]:
        assert max(scales) > scales[0]  # the window grew the scale at least once
