"""Mixture of experts with expert parallelism (`partita.moe`, ``deepspeed.moe.layer.MoE``):
DeepSpeed's tutorial shape trained at 4 CPU ranks as ep 2 x dp 2 and ep 4, ZeRO stages 0-3,
fp32, dropless, against one process holding every expert; a rerun bitwise; the groups; the
optimizer state split over expert ranks; and the refusals, each naming itself before any
collective. One spawn runs every 4-rank case ([Note: expert parallelism] in
`partita.comm.dims`)."""

from __future__ import annotations

import pytest

from models import assert_losses
from moe_workers import moe_grid, reference
from partita.testing import run_distributed_grid

WORLD = 4
STAGES = (0, 1, 2, 3)
TRAIN = [  # top-1 at ep 2, top-2 at ep 4
    {"kind": "train", "ep": ep, "stage": stage, "k": 1 if ep == 2 else 2}
    for ep in (2, 4)
    for stage in STAGES
]
RERUN = {"kind": "train", "ep": 2, "stage": 2, "k": 1}
EXTRA = {
    # SGD shows any scaling of the expert gradients; clipping at 0.05 reads the global norm
    "sgd_clip_stage0": {"kind": "train", "ep": 2, "stage": 0, "k": 2, "sgd": True, "clip": 0.05},
    "sgd_clip_stage2": {"kind": "train", "ep": 4, "stage": 2, "k": 1, "sgd": True, "clip": 0.05},
    "sgd_clip_stage3": {"kind": "train", "ep": 2, "stage": 3, "k": 2, "sgd": True, "clip": 0.05},
    "residual": {"kind": "train", "ep": 2, "stage": 1, "k": 1, "residual": True},
    "unsplit_groups": {"kind": "train", "ep": 2, "stage": 2, "k": 1, "split": False},
    # capacity factor 1 with token drops (DeepSpeed's rule)
    "capacity_ep2_stage2": {"kind": "train", "ep": 2, "stage": 2, "k": 2, "drop": True},
    "capacity_ep4_stage3": {"kind": "train", "ep": 4, "stage": 3, "k": 2, "drop": True},
}
REFUSALS = ["experts_not_divisible", "k_too_large", "ep_not_dividing", "stage3_zeropp"]
SAVE16 = [(2, 0), (4, 3)]
"""`consolidated_16bit_state_dict` at (ep, stage)."""


@pytest.fixture(scope="module")
def results() -> dict:
    refusals = [{"kind": "refusal", "what": what} for what in REFUSALS]
    save16 = [{"kind": "consolidated", "ep": ep, "stage": stage} for ep, stage in SAVE16]
    cases = [*TRAIN, RERUN, *EXTRA.values(), *refusals, *save16]
    per_case = iter(run_distributed_grid(moe_grid, WORLD, cases, timeout=300))
    return {
        "train": {(c["ep"], c["stage"]): next(per_case) for c in TRAIN},
        "rerun": next(per_case),
        "extra": {name: next(per_case) for name in EXTRA},
        "refusals": {what: next(per_case) for what in REFUSALS},
        "save16": {key: next(per_case) for key in SAVE16},
    }


def _check(per_rank: list[dict], want: list[list[float]]) -> None:
    for rank, got in enumerate(per_rank):
        assert_losses(got["losses"], [step[rank] for step in want])


@pytest.mark.parity
@pytest.mark.parametrize("ep", [2, 4])
def test_losses_match_one_process_holding_every_expert(results: dict, ep: int) -> None:
    """Each rank's per-step loss (task loss + COEF * its l_aux) within rtol 1e-6 of one
    process computing every rank's micro-batch loss with all experts and stepping on their
    mean, at ZeRO stages 0-2."""
    want = reference(WORLD, k=1 if ep == 2 else 2)
    for stage in STAGES:
        _check(results["train"][(ep, stage)], want)


@pytest.mark.parity
def test_sgd_clipping_residual_and_unsplit_groups_match_one_process(results: dict) -> None:
    """SGD (no normalisation hides a mis-scaled expert gradient) with clipping at 0.05 (the
    norm counts each expert once) at stages 0, 2 and 3; a residual MoE; optimizer groups that mix
    expert and dense parameters (the engine splits them)."""
    extra = results["extra"]
    _check(extra["sgd_clip_stage0"], reference(WORLD, k=2, sgd=True, clip=0.05))
    _check(extra["sgd_clip_stage2"], reference(WORLD, k=1, sgd=True, clip=0.05))
    _check(extra["sgd_clip_stage3"], reference(WORLD, k=2, sgd=True, clip=0.05))
    _check(extra["residual"], reference(WORLD, k=1, residual=True))
    _check(extra["unsplit_groups"], reference(WORLD, k=1))


@pytest.mark.parity
def test_capacity_drops_match_one_process_with_the_same_capacity_rule(results: dict) -> None:
    """With a capacity factor of 1 (tokens beyond an expert's capacity dropped, DeepSpeed's
    rule, per micro-batch) at ep 2 ZeRO 2 and ep 4 ZeRO 3: within rtol 1e-6 of one process
    running the same layer at ep 1 over every rank's micro-batch; and unlike the dropless
    run (the drops happen)."""
    from moe_workers import capacity_reference

    want = capacity_reference(WORLD, k=2)
    extra = results["extra"]
    for name in ("capacity_ep2_stage2", "capacity_ep4_stage3"):
        _check(extra[name], want)
    dropless = [step[0] for step in reference(WORLD, k=2)]
    assert [step[0] for step in want] != pytest.approx(dropless, rel=1e-4)


def test_same_run_twice_is_bitwise_equal(results: dict) -> None:
    first, again = results["train"][(2, 2)], results["rerun"]
    assert [r["losses"] for r in first] == [r["losses"] for r in again]


def test_groups_are_laid_out_as_deepspeeds(results: dict) -> None:
    """ep 2 at 4 ranks: expert-parallel [0,1],[2,3]; expert-data-parallel [0,2],[1,3]."""
    per_rank = results["train"][(2, 0)]
    assert [r["ep_ranks"] for r in per_rank] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["edp_ranks"] for r in per_rank] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["ep_ranks"] for r in results["train"][(4, 0)]] == [[0, 1, 2, 3]] * 4


def test_expert_optimizer_state_is_split_over_expert_ranks(results: dict) -> None:
    """Stage 0 holds its local experts' state whole (2 of 4 experts at ep 2, 1 at ep 4) and
    every dense element; stages 1-2 cut the experts' state over the expert-data-parallel
    group (2 ranks at ep 2: well under the whole, up to alignment padding) and the dense
    state over all 4 ranks; stage 3 cuts them alike, its expert units over the
    expert-data-parallel group."""
    from moe_workers import CLASSES, DIM, EXPERTS, FF, IN

    expert = DIM * FF + FF + FF * DIM + DIM
    dense = IN * DIM + DIM + DIM * EXPERTS + DIM * CLASSES + CLASSES
    for ep in (2, 4):
        local, edp = EXPERTS // ep * expert, WORLD // ep
        for got in results["train"][(ep, 0)]:
            assert got["state_numel"] == {"expert": local, "dense": dense}
        for stage in (1, 2, 3):
            for got in results["train"][(ep, stage)]:
                numel = got["state_numel"]
                assert dense / WORLD <= numel["dense"] < dense / 2, (ep, stage, numel)
                assert local / edp <= numel["expert"], (ep, stage, numel)
                if edp > 1:
                    assert numel["expert"] < 0.75 * local, (ep, stage, numel)


def test_bad_set_ups_are_refused_by_name(results: dict) -> None:
    refused = results["refusals"]
    for rank_errors in zip(*[refused[w] for w in REFUSALS], strict=True):
        not_divisible, too_large, not_dividing, zeropp = rank_errors
        assert "num_experts: 3 is not divisible by ep_size 2" in not_divisible
        assert "k: 5 must be between 1 and num_experts (4)" in too_large
        assert "ep_size: 3 must divide the data-parallel world size 4" in not_dividing
        assert "zero_optimization" in zeropp and "MoE" in zeropp and "ZeRO++" in zeropp


def test_full_expert_gradients_agree_across_stages(results: dict) -> None:
    """``safe_get_full_grad`` of a rank's first expert weight after the first backward (every
    stage starts from the same weights): at stages 1-2 its pieces are assembled over the
    expert-data-parallel group, giving stage 0's gradient; at stage 3 from the expert unit's
    shards, cut over that group."""
    import torch

    for ep in (2, 4):
        want = [torch.tensor(r["expert_grads"][0]) for r in results["train"][(ep, 0)]]
        for stage in (1, 2, 3):
            for rank, got in enumerate(results["train"][(ep, stage)]):
                first = torch.tensor(got["expert_grads"][0])
                torch.testing.assert_close(first, want[rank], rtol=1e-6, atol=0.0)


def test_all_to_all_bytes_are_the_dispatch_buffers(results: dict) -> None:
    """Each step sends four dispatch buffers of [experts, capacity, hidden] fp32 per rank and
    MoE layer (tokens out and back, their gradients out and back), and nothing else."""
    for key, per_rank in results["train"].items():
        for got in per_rank:
            for sent, buffer in got["all_to_all"]:
                assert sent == 4 * buffer > 0, (key, sent, buffer)


@pytest.mark.parametrize("key", SAVE16, ids=lambda k: f"ep{k[0]}-z{k[1]}")
def test_16bit_state_dict_holds_every_expert_under_its_global_index(
    results: dict, key: tuple[int, int]
) -> None:
    """[Note: experts in the 16-bit model] in `partita.zero.save16`: each rank's local
    ``deepspeed_experts.<i>`` under its global index; the state dict loads strictly into the
    model holding every expert, whose loss on a batch is the engine's."""
    got = results["save16"][key][0]
    assert abs(got["whole"] - got["distributed"]) <= 1e-5 * got["distributed"]
