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

import partita
from models import assert_losses
from partita.engine.tensor_parallel import clear_recorded
from partita.testing import run_distributed_grid
from tp_training_workers import CLIP, MICRO, SEQ, STEPS, dropout_reference, reference, tp_grid

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
DROPOUT = [
    ("gpt2", 2, 1),
    ("gpt2", 2, 3),
    ("llama", 2, 1),
    ("llama", 2, 3),
    ("gpt2", 4, 3),
    ("llama", 4, 1),
]
"""With dropout on ([Note: dropout under tensor parallelism] in `partita.parallel.tp_dropout`),
each tensor rank seeded apart: against one process drawing the data-parallel ranks' masks."""
DROPOUT_RERUN = ("gpt2", 2, 3)
DROPOUT_RECOMPUTE = ("gpt2", 2, 1)
"""With Transformers' gradient checkpointing: the recomputation draws the forward's masks."""
SEQUENCE = [
    ("llama", 2, 0),
    ("llama", 2, 3),
    ("llama", 4, 1),
    ("gpt2", 2, 2),
    ("gpt2", 4, 3),
]
"""With ``tensor_parallel.sequence_parallel`` ([Note: sequence-parallel norms] in
`partita.parallel.tp_sequence`): the stream between the blocks split by sequence."""
SEQUENCE_DROPOUT = [("gpt2", 2, 1), ("llama", 2, 3)]
"""Sequence parallelism with dropout: GPT-2's residual-branch dropouts on sequence slices."""
SEQUENCE_RECOMPUTE = ("gpt2", 2, 1)
SEQUENCE_REENTRANT = ("llama", 2, 1)
"""Sequence parallelism under torch's reentrant checkpoint: the replicated gradients are made
and summed inside the recomputation's own backward."""
NORM_RTOL = 1e-5
"""Clipped gradient norms of the dropout runs: the fp32 reference itself moves by up to 4e-6 from
a float64 run with the same masks by step 3 (AdamW at lr 1e-2 amplifies rounding), so norms get
this; the losses keep 1e-6."""
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
        *[{**_train(c), "dropout": True} for c in DROPOUT],
        {**_train(DROPOUT_RERUN), "dropout": True},
        {**_train(DROPOUT_RECOMPUTE), "dropout": True, "recompute": True},
        *[{"case": "refusal", "what": what} for what in REFUSALS],
        *[{**_train(c), "sequence": True} for c in SEQUENCE],
        *[{**_train(c), "sequence": True, "dropout": True} for c in SEQUENCE_DROPOUT],
        {**_train(SEQUENCE_RECOMPUTE), "sequence": True, "dropout": True, "recompute": True},
        {**_train(SEQUENCE[0]), "sequence": True},  # again: bitwise
        {**_train(SEQUENCE_REENTRANT), "sequence": True, "recompute": "reentrant"},
        {"case": "odd_length"},
    ]
    per_case = iter(run_distributed_grid(tp_grid, WORLD, cases, timeout=300))
    return {
        "train": {c: next(per_case) for c in TRAIN},
        "rerun": next(per_case),
        "dropout": {c: next(per_case) for c in DROPOUT},
        "dropout_rerun": next(per_case),
        "dropout_recompute": next(per_case),
        "refusals": {what: next(per_case) for what in REFUSALS},
        "sequence": {c: next(per_case) for c in SEQUENCE},
        "sequence_dropout": {c: next(per_case) for c in SEQUENCE_DROPOUT},
        "sequence_recompute": next(per_case),
        "sequence_rerun": next(per_case),
        "sequence_reentrant": next(per_case),
        "odd_length": next(per_case),
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


@functools.cache
def _dropout_reference(kind: str, dp: int) -> dict[str, list[float]]:
    return dropout_reference(kind, dp)


def _assert_dropout_parity(runs: list[dict[str, Any]], kind: str, tp: int) -> None:
    ref = _dropout_reference(kind, WORLD // tp)
    for run in runs:
        assert_losses(run["losses"], ref["losses"])
        assert_losses(run["norms"], ref["norms"], rtol=NORM_RTOL)


@pytest.mark.parametrize("case", DROPOUT, ids=lambda c: f"{c[0]}-tp{c[1]}-stage{c[2]}")
def test_dropout_draws_the_one_process_masks(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    """Replicated dropouts (GPT-2's embeddings and residual branches) agree over the tensor
    ranks although each was seeded apart; the attention probabilities' (split by heads) are
    the one-process mask's slices: the losses of one process drawing the same masks."""
    _assert_dropout_parity(results["dropout"][case], case[0], case[1])


def test_dropout_rerun_is_bitwise(results: dict[str, Any]) -> None:
    first, again = results["dropout"][DROPOUT_RERUN], results["dropout_rerun"]
    for one, two in zip(first, again, strict=True):
        assert one["losses"] == two["losses"] and one["norms"] == two["norms"]


def test_dropout_with_activation_checkpointing_recomputes_the_same_masks(
    results: dict[str, Any],
) -> None:
    kind, tp, _ = DROPOUT_RECOMPUTE
    _assert_dropout_parity(results["dropout_recompute"], kind, tp)


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


def test_intra_node_tensor_groups_larger_than_a_node_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``tp_model_init(intra_node=True)``: a tensor group must lie within a node of
    LOCAL_WORLD_SIZE consecutive ranks; checked from sizes alone (no process group)."""
    from partita.config import ConfigError, load_config
    from partita.engine.tensor_parallel import check_intra_node, check_tensor_parallel
    from tp_training_workers import build_model

    check_intra_node(2, 4)
    check_intra_node(4, 8)
    with pytest.raises(ConfigError, match=r"autotp_size: 4 tensor ranks per group, not dividing"):
        check_intra_node(4, 6)
    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = load_config({"train_batch_size": 8}, world_size=8)
    model = partita.tp_model_init(build_model("llama"), tp_size=8, intra_node=True)
    try:
        with pytest.raises(ConfigError) as refused:
            check_tensor_parallel(config, model, 8, 8, 1, None)
    finally:
        clear_recorded()
    message = str(refused.value)
    assert (
        "tensor_parallel.autotp_size: 8 tensor ranks per group, larger than this node's 4"
        in (message)
        and "LOCAL_WORLD_SIZE=4" in message
        and "intra_node=True" in message
    ), message


PLAN_REFUSALS = {
    "unknown-layer": (
        {"layers.*.self_attn.qq_proj": "colwise"},
        "base_model_tp_plan entry 'layers.*.self_attn.qq_proj': 'colwise' names no layer of "
        "LlamaForCausalLM (did you mean 'layers.*.self_attn.q_proj'",
    ),
    "not-a-linear": (
        {"layers.*.mlp.act_fn": "colwise"},
        "model.layers.0.mlp.act_fn (SiLUActivation): base_model_tp_plan entry "
        "'layers.*.mlp.act_fn': 'colwise', but partita splits only nn.Linear and Conv1D",
    ),
}
"""A custom plan's entry -> the refusal it gets."""


@pytest.mark.parametrize(("entry", "expected"), PLAN_REFUSALS.values(), ids=PLAN_REFUSALS)
def test_custom_plan_naming_an_unknown_layer_is_refused_by_name(
    entry: dict[str, str], expected: str
) -> None:
    """A ``base_model_tp_plan`` set by the user must name the model's linears; checked from the
    model alone on every rank, before any collective."""
    from transformers import LlamaConfig

    from partita.config import ConfigError, load_config
    from partita.engine.tensor_parallel import check_tensor_parallel
    from tp_training_workers import build_model

    plan = {**LlamaConfig.base_model_tp_plan, **entry}
    model = build_model("llama", base_model_tp_plan=plan)
    config = load_config(
        {"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2}}, world_size=4
    )
    with pytest.raises(ConfigError) as refused:
        check_tensor_parallel(config, model, 2, 4, 1, None)
    assert f"tensor_parallel.autotp_size: 2: {expected}" in str(refused.value), refused.value
    # The config class's own plan is not "custom": the model is accepted.
    check_tensor_parallel(config, build_model("llama"), 2, 4, 1, None)


@pytest.mark.parametrize("shape", [(2, 4, 3, 3), (2, 3, 6)], ids=["heads", "features"])
def test_split_dropout_keeps_this_ranks_slice_of_the_whole_mask(
    shape: tuple[int, ...],
) -> None:
    """[Note: dropout under tensor parallelism]: tensor rank 1 of 2 draws, from the same
    generator state, exactly its slice of the mask one process draws for the whole tensor
    (heads at dim 1 of a 4-D tensor; else the last column-parallel linear's columns, here the
    strided [q | k | v] share of a fused projection), and the generator ends where one
    process's does."""
    from torch import nn

    from partita.parallel.tp_dropout import _Region, _Split

    region = _Region("attn", size=2, rank=1, heads=4)
    region.split = _Split(ranges=((2, 4), (6, 8), (10, 12)), width=12)
    whole_shape = (2, 8, 3, 3) if len(shape) == 4 else (2, 3, 12)
    mine = [slice(4, 8)] if len(shape) == 4 else [slice(2, 4), slice(6, 8), slice(10, 12)]
    x = torch.randn(whole_shape, dtype=torch.float64)
    torch.manual_seed(3)
    want = nn.functional.dropout(x, 0.4, True)
    after = torch.get_rng_state()
    dim = 1 if len(shape) == 4 else -1
    local = torch.cat([x[(slice(None),) * (dim % x.dim()) + (s,)] for s in mine], dim)
    torch.manual_seed(3)
    with region:
        got = nn.functional.dropout(local, 0.4, True)
    expected = torch.cat([want[(slice(None),) * (dim % x.dim()) + (s,)] for s in mine], dim)
    assert torch.equal(got, expected) and torch.equal(torch.get_rng_state(), after)
    torch.manual_seed(3)
    with region:  # as some models call it
        assert torch.equal(torch.dropout(local, 0.4, True), expected)
    region.split = None  # replicated: the plain dropout of this rank's whole tensor
    torch.manual_seed(3)
    with region:
        assert torch.equal(nn.functional.dropout(x, 0.4, True), want)


def test_sdpa_dropout_on_split_heads_is_refused_by_name() -> None:
    from torch import nn

    from partita.parallel.tp_dropout import _Region, _Split

    region = _Region("model.layers.0.self_attn", size=2, rank=0, heads=2)
    region.split = _Split(ranges=((0, 4),), width=8)
    q = torch.randn(1, 2, 3, 4)
    with region, pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn: .*eager"):
        nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


@pytest.mark.parametrize("case", SEQUENCE, ids=lambda c: f"{c[0]}-tp{c[1]}-stage{c[2]}")
def test_sequence_parallel_matches_one_process(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    """The norms and residual adds on 1/tp of the sequence, the norms' gradients summed over
    the tensor ranks: the one-process losses and clipped norms on the whole batch."""
    kind, tp, _ = case
    ref = _reference(kind, WORLD // tp)
    for run in results["sequence"][case]:
        assert_losses(run["losses"], ref["losses"])
        assert_losses(run["norms"], ref["norms"])


@pytest.mark.parametrize("case", SEQUENCE_DROPOUT, ids=lambda c: f"{c[0]}-tp{c[1]}-stage{c[2]}")
def test_sequence_parallel_dropout_keeps_this_ranks_rows_of_the_mask(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    _assert_dropout_parity(results["sequence_dropout"][case], case[0], case[1])


def test_sequence_parallel_with_activation_checkpointing(results: dict[str, Any]) -> None:
    kind, tp, _ = SEQUENCE_RECOMPUTE
    _assert_dropout_parity(results["sequence_recompute"], kind, tp)


def test_sequence_parallel_rerun_is_bitwise(results: dict[str, Any]) -> None:
    for first, again in zip(results["sequence"][SEQUENCE[0]], results["sequence_rerun"],
                            strict=True):  # fmt: skip
        assert first["losses"] == again["losses"] and first["norms"] == again["norms"]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sequence_parallel_collectives_move_what_the_plan_says(
    results: dict[str, Any], kind: str
) -> None:
    """Per block: forward an all-gather of the input and a reduce-scatter of the row-parallel
    output, backward their adjoints (a reduce-scatter and an all-gather); each is counted with
    the whole micro-batch's activation (an all-gather and a reduce-scatter together move on
    the wire what one all-reduce moves). Once per step: the first layer's cut (its backward
    all-gathers) and the final norm's join (an all-gather forward). The replicated parameters
    used on slices (norm weights and biases, row-parallel biases) all-reduce their gradients
    (flattened per decoder layer and for the final norm: the same bytes as one all-reduce per
    parameter); Llama's vocabulary-parallel head as in plain tensor parallelism."""
    act = MICRO * SEQ * 32 * 4
    layers, hidden_bytes = 2, 32 * 4
    blocks = layers * 2 * 4 * act
    if kind == "llama":
        head = act + MICRO * SEQ * (4 + 2 * 8)
        replicated = (2 * layers + 1) * hidden_bytes  # two RMSNorm weights a layer, the last
        case: tuple[str, int, int] = ("llama", 2, 0)
    else:
        head = 0
        replicated = (6 * layers + 2) * hidden_bytes  # ln_1, ln_2 (w, b), two c_proj biases
        case = ("gpt2", 2, 2)
    for run in results["sequence"][case]:
        assert run["tp_bytes"] == [blocks + 2 * act + head + replicated] * STEPS


LAYERS = 2
"""Decoder layers of both tiny models (`tp_training_workers.build_model`)."""


def _sequence_collectives(kind: str) -> int:
    """Tensor collectives of one forward and backward with sequence parallelism, any kind
    counted once (see the test below)."""
    stream = LAYERS * 2 * 4 + 2
    head = 3 if kind == "llama" else 0
    buckets = LAYERS + 1
    return stream + head + buckets


@pytest.mark.parametrize("case", SEQUENCE, ids=lambda c: f"{c[0]}-tp{c[1]}-stage{c[2]}")
def test_sequence_parallel_sums_replicated_gradients_once_per_bucket(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    """The replicated parameters used on slices (Llama: two RMSNorm weights a layer and the
    final norm's, 2 * 2 + 1 = 5; GPT-2: ln_1's and ln_2's weights and biases and the two c_proj
    biases a layer, ln_f's weight and bias, 6 * 2 + 2 = 14) have their gradients summed over the
    tensor group in one flattened all-reduce per bucket, a bucket being each decoder layer and
    the final norm ([Note: batched sums of the sliced parameters' gradients]): 2 + 1 = 3 per
    forward and backward, at every ZeRO stage and tensor size, not one per parameter. Counted
    among all the tensor collectives of a forward and backward (`_sequence_collectives`): per
    block the four of `test_sequence_parallel_collectives_move_what_the_plan_says`, the cut's
    and the final join's all-gathers, Llama's vocabulary-parallel loss (two all-reduces
    forward) and its head input's gradient (one backward); GPT-2's tied head is not split and
    moves nothing. (On gloo with more than two ranks the all-gathers and reduce-scatters run,
    and are counted, as all-reduces: hence all kinds together.)"""
    kind, _, _ = case
    per_parameter = 2 * LAYERS + 1 if kind == "llama" else 6 * LAYERS + 2
    assert per_parameter > LAYERS + 1
    for run in results["sequence"][case]:
        assert run["tp_calls"] == [_sequence_collectives(kind)] * STEPS


def test_sequence_parallel_with_reentrant_checkpointing(results: dict[str, Any]) -> None:
    """Under torch's reentrant checkpoint each layer's replicated gradients are made and
    summed inside the recomputation's backward, and reach ZeRO once per backward: the
    one-process losses and clipped norms; the collectives of a run without checkpointing (one
    sum per bucket still) and the recomputed blocks' forward ones (an all-gather of the input
    and a reduce-scatter of the output a block)."""
    kind, tp, _ = SEQUENCE_REENTRANT
    ref = _reference(kind, WORLD // tp)
    recomputed = LAYERS * 2 * 2
    for run in results["sequence_reentrant"]:
        assert_losses(run["losses"], ref["losses"])
        assert_losses(run["norms"], ref["norms"])
        assert run["tp_calls"] == [_sequence_collectives(kind) + recomputed] * STEPS


def test_sequence_length_not_dividing_is_refused_by_value(results: dict[str, Any]) -> None:
    for message in results["odd_length"]:
        assert "sequence_parallel: sequence length 7 does not divide by" in message, message


def test_sequence_parallel_refuses_models_it_cannot_cut() -> None:
    """Checked from the module tree alone: a dropout on the stream outside the blocks, and a
    model with no final norm after its layers."""
    from torch import nn

    from partita.parallel.tp_sequence import plan_sequence_parallel

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp, self.drop = Block(), nn.Dropout(0.1)

    class Model(nn.Module):
        def __init__(self, norm: bool) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])
            if norm:
                self.norm = nn.LayerNorm(4)

    styles = {
        f"layers.{i}.mlp.{n}": s
        for i in (0, 1)
        for n, s in (("up", "colwise"), ("down", "rowwise"))
    }
    with pytest.raises(ValueError, match=r"Model\.layers\.0\.drop is a dropout \(p=0\.1\)"):
        plan_sequence_parallel(Model(norm=True), styles)
    plain = Model(norm=False)
    for layer in plain.layers:
        layer.drop.p = 0.0
    with pytest.raises(ValueError, match="Model has no final norm after layers"):
        plan_sequence_parallel(plain, styles)
    plain.norm = nn.LayerNorm(4)
    plan = plan_sequence_parallel(plain, styles)
    assert (plan.layers, plan.blocks, plan.norm) == (
        "layers",
        ("layers.0.mlp", "layers.1.mlp"),
        "norm",
    )
