"""Hugging Face MoE models with expert parallelism by their expert plan
(`partita.moe.expert_parallel`, [Note: Hugging Face expert plan] in `partita.moe.hf_experts`):
a tiny Mixtral (8 experts, top-2, dropless) from Transformers at 4 CPU ranks as ep 2 x dp 2 and
ep 4, ZeRO stages 0-3, and a tiny Qwen3-MoE at ZeRO 2-3: per-step losses within rtol 1e-6 of
one process holding every expert on the whole batch (AdamW; and SGD with clipping, which a
mis-scaled expert gradient or a norm counting experts twice would move); DeepSpeed's AutoEP
section trains bitwise as the API; each rank holds E/ep experts; checkpoints saved at one ep and
stage load at others (and at ep 1) with the one-process losses; layouts partita cannot split,
and frozen stacked expert weights saved by rows and loaded at other degrees. One spawn runs every case."""

from __future__ import annotations

import pytest
import torch

from hf_moe_workers import CKPT_STEPS, EXPERTS, SAVE_AT, grid, reference
from models import assert_losses
from partita.testing import run_distributed

WORLD = 4
CASES = [{"ep": ep, "stage": s} for ep in (2, 4) for s in (0, 1, 2, 3)]
CASES += [{"ep": 2, "stage": s, "sgd": True} for s in (0, 2, 3)]
CASES += [{"ep": 2, "stage": s, "kind": "qwen3_moe"} for s in (2, 3)]
AUTOEP = [{"ep": 2, "stage": 2, "autoep": True}]
"""DeepSpeed's AutoEP section instead of the API call (the same run as CASES[2])."""
BAD = [{"refused": {"enabled": True, "autoep_size": 3}}, {"refused": {"comm_backend": "x"}}]


SAVE16 = [(2, 1), (4, 3)]
"""`consolidated_16bit_state_dict` (what save_16bit_model and Hugging Face's save write) at
(ep, stage)."""
RESUMED = [((2, 1), [(2, 1), (4, 3), (1, 2)]), ((4, 3), [(2, 0), (1, 3)])]
"""Checkpoints: saved at (ep, stage), loaded at each (ep, stage) listed (ep 1: every expert on
every rank, no expert parallelism)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return [str(tmp_path_factory.mktemp(f"hf-moe-ckpt{i}")) for i in range(len(RESUMED))]


@pytest.fixture(scope="module")
def results(folders: list[str]) -> list[list[dict]]:
    resumed = [
        {"resumed": {"folder": f, "save": save, "loads": loads}}
        for f, (save, loads) in zip(folders, RESUMED, strict=True)
    ]
    consolidated = [{"consolidated": {"ep": ep, "stage": stage}} for ep, stage in SAVE16]
    return run_distributed(grid, WORLD, CASES + AUTOEP + BAD + resumed + consolidated, timeout=300)


@pytest.mark.parity
def test_losses_match_one_process_holding_every_expert(results: list[list[dict]]) -> None:
    want = {
        (False, "mixtral"): reference(WORLD),
        (True, "mixtral"): reference(WORLD, sgd=True),
        (False, "qwen3_moe"): reference(WORLD, kind="qwen3_moe"),
    }
    for i, case in enumerate(CASES):
        for rank in results:
            key = (case.get("sgd", False), case.get("kind", "mixtral"))
            assert_losses(rank[i]["losses"], want[key])


def test_autoep_config_section_trains_as_the_api(results: list[list[dict]]) -> None:
    """``"expert_parallel": {"enabled": true, "autoep_size": 2}`` splits the experts in
    `initialize`: the same run, bitwise, as `expert_parallel` called by the script."""
    for rank in results:
        assert rank[len(CASES)]["losses"] == rank[2]["losses"]


def test_bad_autoep_sections_are_refused_by_name(results: list[list[dict]]) -> None:
    for rank in results:
        size, unknown = rank[len(CASES) + 1 : len(CASES) + 1 + len(BAD)]
        assert "expert_parallel" in size and "not divisible by ep_size 3" in size
        assert "expert_parallel.comm_backend" in unknown


def test_each_rank_holds_its_share_of_the_experts(results: list[list[dict]]) -> None:
    for i, case in enumerate(CASES + AUTOEP):
        for r, rank in enumerate(results):
            got = rank[i]
            first = r - r % case["ep"]
            assert got["ep_ranks"] == list(range(first, first + case["ep"]))
            if case["stage"] < 3:
                assert got["local_experts"] == EXPERTS // case["ep"]
            assert got["moe_bytes"] > 0  # tokens went through the all-to-all


@pytest.mark.parity
def test_checkpoints_load_at_other_expert_degrees_and_stages(results: list[list[dict]]) -> None:
    """Saved after step 2 of 4 at ep 2 ZeRO 1 and at ep 4 ZeRO 3 ([Note: stacked expert rows]
    in `partita.checkpoint.experts`): each reload trains steps 3-4 with the one-process
    losses, at ep 4, 2 or 1 (a model holding every expert) and another stage; at the saving
    layout, bitwise the run that never stopped."""
    want = reference(WORLD, steps=CKPT_STEPS)
    first = len(CASES + AUTOEP + BAD)
    for i, (save, loads) in enumerate(RESUMED):
        for rank in results:
            got = rank[first + i]
            assert_losses(got["saved"], want)
            for (ep, stage), losses in zip(loads, got["loaded"], strict=True):
                assert_losses(losses, want[SAVE_AT:])
                if (ep, stage) == save:
                    assert losses == got["saved"][SAVE_AT:]


def test_frozen_stacked_experts_save_their_rows_and_load_at_other_degrees(
    results: list[list[dict]],
) -> None:
    """The first layer's stacked ``down_proj`` frozen (the experts a LoRA run leaves alone):
    each expert-parallel group's rows are saved under their own key and joined on load
    ([Note: stacked expert rows]); a load at another ep and stage, from a scrambled weight,
    gets back exactly the saved rows it holds and trains on as the saving run did (bitwise at
    the saving layout), which trains as one process with the same weight frozen."""
    first = len(CASES + AUTOEP + BAD)
    want = reference(WORLD, steps=CKPT_STEPS, freeze=True)
    for i, (save, loads) in enumerate(RESUMED):
        for rank in results:
            got = rank[first + i]["frozen"]
            # Training itself: stage 3 once cut a frozen expert weight over every rank.
            assert_losses(got["saved"], want)
            for (ep, stage), run in zip(loads, got["loaded"], strict=True):
                assert run["rows"], (save, ep, stage)
                assert_losses(run["losses"], got["saved"][SAVE_AT:])
                if (ep, stage) == save:
                    assert run["losses"] == got["saved"][SAVE_AT:]


def test_models_partita_cannot_split_are_refused_by_name() -> None:
    """GPT-OSS's experts (transposed, with biases) and a model without an expert plan fail in
    `expert_parallel`, naming the module or the model, before anything is cut."""
    import transformers as tf

    from partita.moe import expert_parallel

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32,
             "num_hidden_layers": 1, "num_attention_heads": 4}  # fmt: skip
    gpt_oss = tf.GptOssForCausalLM(
        tf.GptOssConfig(**small, num_key_value_heads=2, head_dim=8, num_local_experts=4)
    )
    with pytest.raises(ValueError, match=r"GptOssExperts.*cannot split it"):
        expert_parallel(gpt_oss, 2, ep_rank=0)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no base_model_ep_plan"):
        expert_parallel(tf.LlamaForCausalLM(tf.LlamaConfig(**small)), 2, ep_rank=0)


def test_grouped_expert_matmuls_are_the_per_expert_loop_bitwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: grouped expert matmuls]: rows in arrival order (not sorted by expert), one local
    expert with no rows; the grouped path's output and gradients (rows, both stacked weights)
    equal the per-expert loop's bit for bit."""
    from types import SimpleNamespace

    from partita.moe import hf_experts

    assert hf_experts.grouped_mm_supported(torch.zeros(1))  # the CPU path is the grouped one
    experts, hidden, inner = 4, 16, 8
    which = torch.tensor([2, 0, 3, 0, 2, 2, 3, 0, 2, 3, 0])  # expert 1: no rows
    results = []
    for grouped in (True, False):
        gen = torch.Generator().manual_seed(0)
        module = SimpleNamespace(
            gate_up_proj=torch.randn(experts, 2 * inner, hidden, generator=gen).requires_grad_(),
            down_proj=torch.randn(experts, hidden, inner, generator=gen).requires_grad_(),
            act_fn=torch.nn.functional.silu,
        )
        x = torch.randn(len(which), hidden, generator=gen).requires_grad_()
        grad = torch.randn(len(which), hidden, generator=gen)
        monkeypatch.setattr(hf_experts, "grouped_mm_supported", lambda t, g=grouped: g)
        out = hf_experts._local_experts(module, x, which)
        out.backward(grad)
        results.append((out, x.grad, module.gate_up_proj.grad, module.down_proj.grad))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    assert torch.count_nonzero(results[0][2][1]) == 0  # the idle expert: no gradient


@pytest.mark.parametrize(
    "index", range(len(SAVE16)), ids=lambda i: f"ep{SAVE16[i][0]}-z{SAVE16[i][1]}"
)
def test_16bit_state_dict_holds_every_expert(results: list[list[dict]], index: int) -> None:
    """[Note: experts in the 16-bit model] in `partita.zero.save16`: the consolidated state
    dict of expert-parallel training (a frozen stacked weight among its experts) loads strictly
    into a model holding every expert, whose loss on a batch is the engine's."""
    got = results[0][len(CASES + AUTOEP + BAD) + len(RESUMED) + index]
    assert got["rows"] == EXPERTS
    assert abs(got["whole"] - got["distributed"]) <= 1e-5 * got["distributed"]
    for rank in results[1:]:  # the same batch everywhere: every rank's engine loss agrees
        assert (
            rank[len(CASES + AUTOEP + BAD) + len(RESUMED) + index]["distributed"]
            == got["distributed"]
        )
