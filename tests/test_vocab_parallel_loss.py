"""The vocabulary-parallel cross-entropy ([Note: vocabulary-parallel loss] in
`partita.parallel.vocab_loss`): its loss and gradients (of the logits and of the head's weight)
against torch's ``cross_entropy`` on the whole logits at tp 2 and 4, with ignored labels, every
reduction, label smoothing; and the Hugging Face path ([Note: vocabulary-parallel loss of a
Hugging Face causal LM]): tiny Llama and GPT-2 with untied heads trained at tp 2 x dp 2 and
tp 4 against one process, no logits all-gathered, the saved logits 1/tp of the gathered run's,
a rerun bitwise, and the switch that turns it off. One spawn of 4 ranks runs every case."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from models import assert_losses
from partita.parallel.vocab_loss import VocabParallelCausalLMLoss
from partita.testing import run_distributed_grid
from tp_training_workers import MICRO, SEQ
from vocab_parallel_workers import REDUCTIONS, STEPS, TOKENS, VOCAB, WIDTH, grid, reference

WORLD = 4
FUNCTION = [(tp, r, s) for tp in (2, 4) for r in REDUCTIONS for s in (0.0, 0.1)]
TRAIN = [("llama", 2, 1), ("gpt2", 2, 2), ("llama", 4, 0), ("gpt2", 4, 3)]
OFF = ("llama", 2, 1)
"""Trained again with ``vocab_parallel_lm_head: false``: the head all-gathers its logits."""
RERUN = ("llama", 2, 1)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    cases: list[dict[str, Any]] = [
        *[{"case": "function", "tp": tp, "reduction": r, "smoothing": s} for tp, r, s in FUNCTION],
        *[{"case": "train", "kind": k, "tp": tp, "stage": st} for k, tp, st in TRAIN],
        {"case": "train", "kind": OFF[0], "tp": OFF[1], "stage": OFF[2], "vocab_loss": False},
        {"case": "train", "kind": RERUN[0], "tp": RERUN[1], "stage": RERUN[2]},
    ]
    per_case = iter(run_distributed_grid(grid, WORLD, cases, timeout=300))
    return {
        "function": {c: next(per_case) for c in FUNCTION},
        "train": {c: next(per_case) for c in TRAIN},
        "off": next(per_case),
        "rerun": next(per_case),
    }


@functools.cache
def _reference(kind: str, dp: int) -> list[float]:
    return reference(kind, dp)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("case", FUNCTION, ids=lambda c: f"tp{c[0]}-{c[1]}-smooth{c[2]}")
def test_loss_and_gradients_equal_torch_on_the_whole_logits(
    results: dict[str, Any], case: tuple[int, str, float]
) -> None:
    """Two all-reduces forward, of [N] fp32 and [2, N] float64 ([3, N] with smoothing); none
    backward (the gradient of the head's input is the model's business, not the loss's). Loss
    and logits' gradient within rtol 1e-6 (atol 1e-9, for the entries torch rounds to near
    0)."""
    smoothing = case[2]
    for run in results["function"][case]:
        _close(run["loss"], run["ref"])
        _close(run["grad"], run["ref_grad"])
        # The weight's gradient sums TOKENS products of the logits' gradient and the hidden
        # states, which cancel: within 1e-6 of the sum of their magnitudes.
        error = (run["weight_grad"] - run["ref_weight_grad"]).abs()
        assert bool((error <= 1e-6 * run["weight_grad_scale"]).all()), error.max()
        assert run["forward_bytes"] == TOKENS * 4 + TOKENS * 8 * (3 if smoothing else 2)
        assert run["backward_bytes"] == 0


@pytest.mark.parametrize("case", TRAIN, ids=lambda c: f"{c[0]}-tp{c[1]}-stage{c[2]}")
def test_training_losses_match_one_process(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    kind, tp, _ = case
    for run in results["train"][case]:
        assert_losses(run["losses"], _reference(kind, WORLD // tp))


@pytest.mark.parametrize("case", TRAIN, ids=lambda c: f"{c[0]}-tp{c[1]}-stage{c[2]}")
def test_logits_are_never_gathered_with_labels(
    results: dict[str, Any], case: tuple[str, int, int]
) -> None:
    """No all-gather; the largest logits autograd saves (the loss's softmax) are this rank's
    1/tp slice of the micro-batch's; the output's logits are the slice with labels, whole
    without. Per step the tensor bytes are the blocks' (two all-reduces forward and two
    backward each), the head input's gradient all-reduce and the loss's [N] fp32 + [2, N]
    float64."""
    _, tp, _ = case
    act, tokens = MICRO * SEQ * WIDTH * 4, MICRO * SEQ
    for run in results["train"][case]:
        assert run["gathered"] == [0] * STEPS
        assert run["saved"] == [tokens * VOCAB // tp * 4] * STEPS
        assert (run["width"], run["width_without_labels"]) == (VOCAB // tp, VOCAB)
        assert run["tp_bytes"] == [2 * 4 * act + act + tokens * (4 + 2 * 8)] * STEPS


def test_switched_off_the_head_gathers_and_saves_tp_times_more(results: dict[str, Any]) -> None:
    tokens = MICRO * SEQ
    on = results["train"][OFF]
    for run, vocab_parallel in zip(results["off"], on, strict=True):
        assert run["saved"] == [tokens * VOCAB * 4] * STEPS
        assert [s * OFF[1] for s in vocab_parallel["saved"]] == run["saved"]
        assert all(g > 0 for g in run["gathered"]) and run["width"] == VOCAB
        assert_losses(run["losses"], _reference(OFF[0], WORLD // OFF[1]))


def test_rerun_is_bitwise(results: dict[str, Any]) -> None:
    for first, again in zip(results["train"][RERUN], results["rerun"], strict=True):
        assert first["losses"] == again["losses"]


def test_bf16_logits_get_a_bf16_gradient_of_the_fp32_loss() -> None:
    """One process (no group): computed in fp32 like Transformers' upcast, the gradient
    returned in the logits' dtype; a second backward through the same loss raises."""
    from partita.parallel.vocab_loss import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 40, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 40, (12,), generator=gen)
    labels[::3] = -100
    ref_x = x.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_x, labels)
    ref.backward()
    loss = vocab_parallel_cross_entropy(x, labels, None)
    loss.backward(retain_graph=True)
    assert loss.dtype == torch.float32 and x.grad is not None and x.grad.dtype == torch.bfloat16
    _close(loss, ref)
    assert ref_x.grad is not None
    # torch's fp32 gradient rounded to bf16, up to one bf16 step (2**-7 relative) where the
    # two fp32 gradients (within 1e-6) round to neighbours.
    torch.testing.assert_close(x.grad, ref_x.grad.bfloat16(), rtol=2**-7, atol=0)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def _split_llama(model: Any) -> VocabParallelCausalLMLoss | None:
    """`model` with its head as a tensor-parallel head of one rank (no group): what
    `parallelize` makes at tp 1, so the loss's path runs in one process."""
    from partita.parallel.tensor import ColumnParallelLinear, _Place
    from partita.parallel.vocab_loss import install_causal_lm_loss

    head = model.lm_head
    model.lm_head = ColumnParallelLinear(head.weight, None, _Place(None, 1, 0), gather_output=True)
    return install_causal_lm_loss(model, "lm_head")


def test_hugging_face_loss_terms_and_switch_back() -> None:
    """Transformers' ``ForCausalLMLoss`` terms (labels shifted, ``num_items_in_batch``'s "sum"
    over it) equal the original's at tp 1; ``remove`` puts the model's loss and head back."""
    from tp_training_workers import batches, build_model

    ids = batches(1)[0]
    plain, split = build_model("llama"), build_model("llama")
    installed = _split_llama(split)
    assert installed is not None and split.__dict__["_loss_function"] is installed
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(5)}):
        want = plain(input_ids=ids, labels=ids, **kwargs).loss
        _close(split(input_ids=ids, labels=ids, **kwargs).loss, want)
    installed.remove()
    assert split.__dict__["_loss_function"] is installed.original and installed.head.gather_output


def test_a_model_computing_its_loss_inline_is_refused() -> None:
    """A forward that reads the head's slice without ``self.loss_function`` raises, naming the
    switch (one process: the slice is the whole vocabulary, but the hook cannot tell)."""
    from transformers import LlamaForCausalLM

    from tp_training_workers import batches, build_model

    class Inline(LlamaForCausalLM):
        def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
            logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
            return torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:])

    model = build_model("llama")
    model.__class__ = Inline
    assert _split_llama(model) is not None
    ids = batches(1)[0]
    with pytest.raises(RuntimeError, match="vocab_parallel_lm_head to false"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # evaluation: the head gathers, the model's own code runs
        model(input_ids=ids, labels=ids)
