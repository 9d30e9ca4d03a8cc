"""Ulysses sequence parallelism (``sequence_parallel_size``, `partita.parallel.ulysses`): a tiny
Llama-like model (grouped-query attention, rotary positions) trained at 4 CPU ranks as sp 2 x
dp 2 and sp 4 x dp 1, ZeRO stages 0-3, against one process on the same tokens; a rerun bitwise;
the groups; `DistributedAttention` against plain attention; and the refusals, each naming
itself before any collective. One spawn runs every 4-rank case ([Note: sequence parallelism]
in `partita.comm.dims`, [Note: Ulysses attention] in `partita.parallel.ulysses`)."""

from __future__ import annotations

import pytest
import torch

from models import assert_losses, weight_atol_float64
from partita.parallel.ulysses import check_heads
from partita.testing import run_distributed_grid
from ulysses_workers import HF_STEPS, STEPS, hf_reference, reference, ulysses_grid

WORLD = 4
STAGES = (0, 1, 2, 3)
TRAIN = [{"kind": "train", "sp": sp, "stage": stage} for sp in (2, 4) for stage in STAGES]
RERUN = {"kind": "train", "sp": 2, "stage": 3}
EXTRA = {  # the norm over every rank (clipping reads it), and float64 weights
    "clip": {"kind": "train", "sp": 2, "stage": 2, "clip": 0.05},
    "float64_sp2": {"kind": "train", "sp": 2, "stage": 1, "dtype": "float64"},
    "float64_sp4": {"kind": "train", "sp": 4, "stage": 3, "dtype": "float64"},
    "mpu": {"kind": "train", "sp": 2, "stage": 2, "mpu": True},  # parallel_state_sp's groups
    "gas": {"kind": "train", "sp": 2, "stage": 2, "gas": 2},
}
SGD = {  # SGD shows any scaling of the gradient; each of the three loss conventions
    "share": {"kind": "train", "sp": 2, "stage": 1, "sgd": True, "loss_style": "share"},
    "local_mean": {"kind": "train", "sp": 2, "stage": 2, "sgd": True, "loss_style": "local_mean"},
    "gathered": {"kind": "train", "sp": 4, "stage": 3, "sgd": True, "loss_style": "gathered"},
}
HF = {  # Transformers' Llama through ALST's API (register_with_transformers, the adapter)
    (2, 1): {"kind": "hf", "sp": 2, "stage": 1},
    (4, 3): {"kind": "hf", "sp": 4, "stage": 3},
}
ATTENTION = [
    {"kind": "attention", "sp": 2, "batch_dim_idx": 0, "kv_heads": 2},  # kv heads split
    {"kind": "attention", "sp": 4, "batch_dim_idx": 0, "kv_heads": 2},  # kv heads repeated
    {"kind": "attention", "sp": 4, "batch_dim_idx": 1, "kv_heads": 4},  # [s, b, h, d]
]
REFUSALS = ["sp3", "sp8", "dp_size_bad", "dp_size_ok", "mpu_dp_bad", "mpu_dp_ok", "heads",
            "kv_heads", "seq_len"]  # fmt: skip
MOE = {  # DeepSpeed-MoE layers (top-1, dropless) with their experts split over the world
    (2, 0): {"kind": "train", "sp": 2, "stage": 0, "moe_ep": 2},
    (2, 2): {"kind": "train", "sp": 2, "stage": 2, "moe_ep": 4},
    (2, 3): {"kind": "train", "sp": 2, "stage": 3, "moe_ep": 2},
    (4, 1): {"kind": "train", "sp": 4, "stage": 1, "moe_ep": 2},
}
RESUMES = {  # saved at (sp, stage), then loaded at each of `loads`
    (2, 2): [(2, 2), (1, 1), (4, 3)],
    (4, 3): [(4, 3), (2, 0)],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    refusals = [{"kind": "refusal", "what": what} for what in REFUSALS]
    root = tmp_path_factory.mktemp("sp_checkpoints")
    resumes = [
        {"kind": "resume", "sp": sp, "stage": stage, "save_dir": str(root / f"sp{sp}_z{stage}"),
         "loads": loads}
        for (sp, stage), loads in RESUMES.items()
    ]  # fmt: skip
    cases = [*TRAIN, RERUN, *EXTRA.values(), *SGD.values(), *HF.values(), *ATTENTION, *refusals]
    cases += [*resumes, *MOE.values()]
    per_case = iter(run_distributed_grid(ulysses_grid, WORLD, cases, timeout=300))
    return {
        "train": {(c["sp"], c["stage"]): next(per_case) for c in TRAIN},
        "rerun": next(per_case),
        "extra": {name: next(per_case) for name in EXTRA},
        "sgd": {name: next(per_case) for name in SGD},
        "hf": {key: next(per_case) for key in HF},
        "attention": [next(per_case) for _ in ATTENTION],
        "refusals": {what: next(per_case) for what in REFUSALS},
        "resume": {key: next(per_case) for key in RESUMES},
        "moe": {key: next(per_case) for key in MOE},
    }


@pytest.mark.parity
@pytest.mark.parametrize("sp", [2, 4])
def test_losses_match_one_process_on_the_same_tokens(results: dict, sp: int) -> None:
    """Every stage, every rank: the per-step loss of the whole global batch (2 sequences per
    data-parallel rank) within rtol 1e-6 of one process training on it whole."""
    want = reference(STEPS, batch=2 * (WORLD // sp), dtype=torch.float32)
    for stage in STAGES:
        for rank, got in enumerate(results["train"][(sp, stage)]):
            assert len(got["losses"]) == STEPS, (stage, rank)
            assert_losses(got["losses"], want["losses"])


@pytest.mark.parity
def test_clipping_mpu_accumulation_and_float64_weights_match_one_process(results: dict) -> None:
    """Clipping at 0.05 (every step clips) reads the norm of the whole gradient; groups from
    a Ulysses mpu (DeepSpeed's parallel_state_sp) and 2 accumulation steps train alike;
    float64 runs hold every final weight to the parity suite's bound ([Note: parity bound] in
    tests/models.py)."""
    extra = results["extra"]
    want = reference(STEPS, batch=4, dtype=torch.float32, clip=0.05)
    for got in extra["clip"]:
        assert_losses(got["losses"], want["losses"])
    want = reference(STEPS, batch=4, dtype=torch.float32)
    for got in extra["mpu"]:
        assert_losses(got["losses"], want["losses"])
        assert got["dp_world"] == 2 and got["zero_world"] == WORLD
    for got in extra["gas"]:
        assert_losses(got["losses"], want["losses"])
    for name, sp in (("float64_sp2", 2), ("float64_sp4", 4)):
        want = reference(STEPS, batch=2 * (WORLD // sp), dtype=torch.float64)
        for got in extra[name]:
            assert_losses(got["losses"], want["losses"])
            for a, b in zip(got["params"], want["params"], strict=True):
                assert a.dtype == torch.float64
                torch.testing.assert_close(a, b, rtol=0.0, atol=weight_atol_float64(STEPS))


@pytest.mark.parity
@pytest.mark.parametrize("style", list(SGD))
def test_every_loss_convention_trains_as_one_process_under_sgd(results: dict, style: str) -> None:
    """A rank's loss as its slice's share summed over the group, as the mean over its slice
    (Megatron-DeepSpeed), or as the gathered token-weighted mean (Transformers' Trainer): with
    SGD, where a gradient sp times too large (DeepSpeed's average over dp only) or sp times
    too small would show, each follows one process within rtol 1e-6."""
    case = SGD[style]
    want = reference(STEPS, batch=2 * (WORLD // case["sp"]), dtype=torch.float32, sgd=True)
    for got in results["sgd"][style]:
        assert_losses(got["losses"], want["losses"])


@pytest.mark.parity
def test_transformers_llama_through_alst_api_matches_one_process(results: dict) -> None:
    """register_with_transformers puts Ulysses in place of SDPA and returns the mpu;
    initialize(mpu=...) takes its groups; UlyssesSPDataLoaderAdapter shares each rank's
    sequences with its group and cuts them: every step equals one process on the 4 sequences
    the ranks read (per-step loss within rtol 1e-6). Each rank's all-to-all bytes are those of
    the model: per layer and micro-batch, query, key, value and output of its sequence slice
    (key/value heads repeated up to sp), once forward and once backward."""
    want = hf_reference(HF_STEPS, WORLD, torch.float32)
    for (sp, _), per_rank in results["hf"].items():
        heads, kv, head_dim, local = 4, max(2, sp), 8, 16 // sp
        per_layer = (2 * heads + 2 * kv) * local * head_dim * 4  # fp32 bytes, one way
        micro_batches = HF_STEPS * sp
        for got in per_rank:
            assert got["sp"] == sp and got["dp_world"] == WORLD // sp
            assert_losses(got["losses"], want)
            assert got["a2a_bytes"] == 2 * per_layer * 2 * micro_batches  # 2 layers, fwd + bwd


def test_rerun_is_bitwise_and_sequence_ranks_hold_the_same_weights(results: dict) -> None:
    first, again = results["train"][(2, 3)], results["rerun"]
    for a, b in zip(first, again, strict=True):
        assert a["losses"] == b["losses"]
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y)
    for (sp, stage), per_rank in results["train"].items():
        for other in per_rank[1:]:
            for x, y in zip(per_rank[0]["params"], other["params"], strict=True):
                assert torch.equal(x, y), (sp, stage)


def test_sequence_groups_are_consecutive_and_zero_spans_the_world(results: dict) -> None:
    for (sp, _), per_rank in results["train"].items():
        for rank, got in enumerate(per_rank):
            first = rank - rank % sp
            assert got["sp_ranks"] == list(range(first, first + sp))
            assert got["dp_ranks"] == list(range(rank % sp, WORLD, sp))
            assert got["dp_world"] == WORLD // sp and got["zero_world"] == WORLD
            dp_rank = rank // sp
            assert got["groups"] == [sp, rank % sp, WORLD // sp, dp_rank, WORLD, True]


def test_deepspeed_names_resolve_to_partitas() -> None:
    from partita.compat.deepspeed.sequence.layer import DistributedAttention as FromCompat
    from partita.parallel.ulysses import DistributedAttention

    assert FromCompat is DistributedAttention


def test_distributed_attention_equals_plain_attention(results: dict) -> None:
    for case, per_rank in zip(ATTENTION, results["attention"], strict=True):
        for got in per_rank:
            assert got["out"] <= 1e-6, case
            assert max(got["grads"]) <= 1e-6, case
            local = 16 // case["sp"]
            seq_dim = 1 - case["batch_dim_idx"]
            assert got["shape"][seq_dim] == local


def test_bad_inputs_name_themselves_on_every_rank(results: dict) -> None:
    errors = results["refusals"]
    for what in ("sp3", "sp8"):
        for message in errors[what]:
            assert message.startswith("ConfigError") and "sequence_parallel_size" in message
    assert "3" in errors["sp3"][0] and "8" in errors["sp8"][0]
    for message in errors["dp_size_bad"]:  # DeepSpeed's (data, sequence) mesh keys
        assert message.startswith("ConfigError") and "data_parallel_size" in message, message
        assert "3" in message and "is 2" in message
    assert errors["dp_size_ok"] == [""] * WORLD
    for message in errors["mpu_dp_bad"]:  # a config and an mpu that disagree
        assert message.startswith("ConfigError") and "data_parallel_size" in message, message
        assert "4" in message and "mpu's data-parallel group has 2 ranks" in message
    assert errors["mpu_dp_ok"] == [""] * WORLD
    for message in errors["heads"]:
        assert "6 query heads" in message and "sequence-parallel size 4" in message
    for message in errors["kv_heads"]:
        assert "3 key/value heads" in message and "4" in message
    for message in errors["seq_len"]:
        assert "sequence length 7" in message and "2" in message


def test_head_counts_split_or_repeat_or_refuse() -> None:
    assert check_heads(8, 8, 4) == 1
    assert check_heads(8, 4, 4) == 1
    assert check_heads(8, 2, 4) == 2  # GQA: each kv head repeated sp / kv times
    assert check_heads(8, 1, 8) == 8
    for heads, kv, sp in ((6, 6, 4), (12, 3, 2), (12, 6, 4)):
        with pytest.raises(ValueError, match=f"{sp}"):
            check_heads(heads, kv, sp)


@pytest.mark.parity
@pytest.mark.parametrize("saved", list(RESUMES), ids=lambda k: f"sp{k[0]}-stage{k[1]}")
def test_checkpoint_under_sequence_parallelism_resumes_and_reshards(
    results: dict, saved: tuple[int, int]
) -> None:
    """Saved after step 2 of 5 at (sp, stage): loaded at the same (sp, stage), the last 3 steps
    and the final weights are bitwise those of the uninterrupted run; loaded at another
    sequence-parallel size and stage (down to plain data parallelism over the 4 ranks), the
    last 3 losses stay within rtol 1e-6 of one process on the same tokens."""
    want = reference(STEPS, batch=4, dtype=torch.float32)["losses"]
    for got in results["resume"][saved]:
        assert_losses(got["whole"], want)
        same = got[saved]
        assert same == got["whole"][2:]
        for x, y in zip(got[("params", *saved)], got["whole_params"], strict=True):
            assert torch.equal(x, y)
        for load in RESUMES[saved][1:]:
            assert_losses(got[load], want[2:])


@pytest.mark.parity
@pytest.mark.parametrize("key", list(MOE), ids=lambda k: f"sp{k[0]}-stage{k[1]}")
def test_moe_layers_under_sequence_parallelism_match_one_process(
    results: dict, key: tuple[int, int]
) -> None:
    """MoE layers beside Ulysses attention: each rank routes the tokens of its sequence slice
    to their experts, split over ep ranks of the whole job (the dense parameters' holders),
    so an expert's gradient sums every slice's tokens; against one process holding every
    expert on whole sequences, within rtol 1e-6, at ZeRO 0-3 and ep 2 and 4."""
    sp, _ = key
    want = reference(STEPS, batch=2 * (WORLD // sp), dtype=torch.float32, moe=True)
    for run in results["moe"][key]:
        assert_losses(run["losses"], want["losses"])
