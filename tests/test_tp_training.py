"""Tensor-parallel training (``tensor_parallel.autotp_size``, `partita.parallel.tensor`): tiny
Hugging Face Llama (grouped key/value heads, untied head split by vocabulary) and GPT-2 (fused
QKV Conv1D, tied head) at 4 CPU ranks as tp 2 x dp 2 and tp 4, ZeRO stages 0-3, fp32, clipping
active, against one process with ``torch.optim`` on the whole batch; a rerun bitwise;
`tp_model_init`; the tensor collectives' bytes equal to the plan's; the refusals, each naming
the value before any collective. One spawn runs every case ([Note: tensor-parallel training]
in `partita.parallel.tensor`)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from models import assert_losses
from partita.testing import run_distributed_grid
from tp_training_workers import CLIP, MICRO, SEQ, STEPS, reference, tp_grid

WORLD = 4
TRAIN = [
    *[("llama", 2, stage) for stage in (0, 1, 2, 3)],
    ("llama", 4, 1),
    ("gpt2", 2, 2),
    ("gpt2", 4, 3),
]
CHECKPOINTS = (("llama", 2, 1), ("gpt2", 2, 2))
"""Saved after training at tp 2 x dp 2, loaded at tensor degree 1 (Llama's slices contiguous,
GPT-2's fused QKV strided)."""
RERUN = ("llama", 2, 2)
"""Run again, its size from `tp_model_init` instead of the config: the same numbers bitwise."""
REFUSALS = {
    "tp3": "autotp_size: 3 does not divide the world size 4",
    "heads": "2 attention heads do not split evenly over tensor_parallel.autotp_size 4",
    "kv_heads": "2 key/value heads do not split evenly over tensor_parallel.autotp_size 4",
    "vocab": "vocabulary size 66 does not split evenly over tensor_parallel.autotp_size 4",
    "features": "gate_proj (output features): size 66 does not split evenly over tp_size 4",
    "inner_tp_size": "tensor_parallel.tensor_parallel.tp_size: 4 does not match",
    "ce_backend": "tensor_parallel.vocab_parallel_ce_backend: not supported",
    "preset": "tensor_parallel.preset_model: not supported",
}


def _train(
    case: tuple[str, int, int], via: str = "config", folder: str | None = None
) -> dict[str, Any]:
    kind, tp, stage = case
    return {"case": "train", "model_kind": kind, "tp": tp, "stage": stage, "via": via,
            "folder": folder}  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folders = {c: str(tmp_path_factory.mktemp(f"tp-{c[0]}")) for c in CHECKPOINTS}
    cases = [
        *[_train(c, folder=folders.get(c)) for c in TRAIN],
        _train(RERUN, via="tp_model_init"),
        *[{"case": "refusal", "what": what} for what in REFUSALS],
    ]
    per_case = iter(run_distributed_grid(tp_grid, WORLD, cases, timeout=300))
    return {
        "train": {c: next(per_case) for c in TRAIN},
        "rerun": next(per_case),
        "refusals": {what: next(per_case) for what in REFUSALS},
    }


@functools.cache
def _reference(kind: str, dp: int) -> dict[str, list[float]]:
    return reference(kind, dp)


@pytest.mark.parametrize("case", TRAIN, ids=lambda c: f"{c[0]}-tp{c[1]}-stage{c[2]}")
def test_losses_match_one_process_on_the_whole_batch(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    kind, tp, _ = case
    ref = _reference(kind, WORLD // tp)
    assert all(n > CLIP for n in ref["norms"]), ref  # clipping acts at every step
    for rank, run in enumerate(results["train"][case]):
        assert_losses(run["losses"], ref["losses"])
        assert_losses(run["norms"], ref["norms"])
        assert run["dims"] == (rank % tp, tp, rank // tp, WORLD // tp, tp), rank
        # DeepSpeed's AutoTP arithmetic: every rank counts, tensor ranks too.
        assert run["train_batch_size"] == MICRO * WORLD


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tensor_collectives_move_what_the_plan_says(results: dict[str, Any], kind: str) -> None:
    """Per block: two row-parallel all-reduces forward; backward one all-reduce per input of
    the column-parallel linears (the attention's and the MLP's: Llama's q, k and v share one,
    gate and up one). Each moves a whole micro-batch of fp32 activations. Llama's untied head,
    split by vocabulary, feeds the vocabulary-parallel loss (`partita.parallel.vocab_loss`):
    no all-gather of the logits, the loss's two all-reduces of [N] fp32 and [2, N] float64
    forward, the head input's gradient all-reduce backward."""
    act = MICRO * SEQ * 32 * 4
    per_block = 2 + 2
    head = act + MICRO * SEQ * (4 + 2 * 8) if kind == "llama" else 0
    case = ("llama", 2, 1) if kind == "llama" else ("gpt2", 2, 2)
    for run in results["train"][case]:
        assert run["tp_bytes"] == [2 * per_block * act + head] * STEPS


def test_split_parameters_are_marked(results: dict[str, Any]) -> None:
    split = results["train"][("llama", 2, 0)][0]["split"]
    assert "lm_head.weight" in split and "model.layers.1.mlp.down_proj.weight" in split
    assert not any("norm" in name or "embed" in name for name in split), split
    gpt2 = results["train"][("gpt2", 2, 2)][0]["split"]
    assert "transformer.h.0.attn.c_attn.weight" in gpt2 and "transformer.h.0.mlp.c_fc.bias" in gpt2
    assert "transformer.h.0.attn.c_proj.bias" not in gpt2  # row-parallel bias: replicated


def test_rerun_through_tp_model_init_is_bitwise(results: dict[str, Any]) -> None:
    for first, again in zip(results["train"][RERUN], results["rerun"], strict=True):
        assert again["dims"] == first["dims"]
        assert first["losses"] == again["losses"] and first["norms"] == again["norms"]


@pytest.mark.parametrize("case", CHECKPOINTS, ids=lambda c: c[0])
def test_checkpoint_saved_per_slice_loads_whole_at_tp1(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    for trained in results["train"][case]:
        run = trained["reloaded"]
        assert run["tp"] == 1
        torch.testing.assert_close(run["joined"], run["split"], rtol=0.0, atol=1e-5)


@pytest.mark.parametrize("what", REFUSALS)
def test_refusal_names_the_value(results: dict[str, Any], what: str) -> None:
    for message in results["refusals"][what]:
        assert message.startswith("ConfigError") and REFUSALS[what] in message, message


def test_shared_input_is_one_copy_per_tensor_and_held_only_until_used() -> None:
    """[Note: one all-reduce per shared input]: the members reading one tensor get one copy;
    another tensor gets its own; nothing is held once every member has read it."""
    from partita.parallel.tensor import SharedInput

    shared = SharedInput(members=2)
    x, other = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    first = shared.copy(x, None)
    assert shared.copy(x, None) is first
    assert shared._x is None and shared._y is None
    assert shared.copy(other, None) is not first
    assert shared.copy(x, None) is not first  # a new step: a new copy


def test_moe_layers_with_autotp_are_refused_by_name() -> None:
    """Checked from the config and the model alone (no process group), as on every rank."""
    from torch import nn

    from partita.config import ConfigError, load_config
    from partita.engine.tensor_parallel import check_tensor_parallel
    from partita.moe.layer import MoE

    model = nn.Sequential(MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2))
    config = load_config(
        {"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2}}, world_size=4
    )
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size: 2: .*MoE layers"):
        check_tensor_parallel(config, model, 2, 4, 1, None)
