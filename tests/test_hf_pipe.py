"""Hugging Face models split into pipeline stages by their ``base_model_pp_plan``
(`partita.parallel.hf_pipe.pipeline_from_hf`, [Note: Hugging Face pipeline plans]): a tiny
Llama (untied and tied head) and a tiny Qwen2 with sliding-window layers at 4 CPU ranks, pp 2 x
dp 2 with ZeRO 1 and 3 inside the stages and pp 4, 1F1B over 4 micro-batches, fp32: per-step
losses within rtol 1e-6 of one process running the model's own forward and loss with torch's
AdamW on the same micro-batches; the same run twice bitwise. The layers alone reproduce the
model's logits exactly, and a model without a plan is refused by name. One spawn."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_pipe_workers import VOCAB, grid, reference, tiny_model
from models import LOSS_RTOL
from partita.parallel.hf_pipe import hf_pipeline_layers, tied_logits
from partita.parallel.pipe_module import TiedLayerSpec
from partita.testing import run_distributed_grid

BASE = {"micro": 2, "gas": 4, "steps": 3}
FOUR = [
    {"arch": "llama", "tied": False, "stages": 2, "dp": 2, "stage": 1, **BASE},
    {"arch": "llama", "tied": True, "stages": 2, "dp": 2, "stage": 3, "clip": 0.05, **BASE},
    {"arch": "llama", "tied": True, "stages": 4, "dp": 1, **BASE},
    {"arch": "llama", "tied": True, "stages": 4, "dp": 1, **BASE},  # again: bitwise
    {"arch": "qwen2", "tied": False, "stages": 2, "dp": 2, "stage": 2, **BASE},
]


@pytest.fixture(scope="module")
def four() -> dict[str, Any]:
    cases = [{"kind": "train", "case": c} for c in FOUR]
    cases.append({"kind": "bad", "case": {"stages": 2}})
    out = run_distributed_grid(grid, 4, cases, timeout=300)
    return {"train": out[: len(FOUR)], "bad": out[len(FOUR)]}


@pytest.mark.parity
@pytest.mark.parametrize("index", [0, 1, 2, 4])
def test_hf_pipeline_matches_one_process(four: dict[str, Any], index: int) -> None:
    case = FOUR[index]
    want = reference(case)
    per_rank = four["train"][index]
    for rank, result in enumerate(per_rank):
        got = result["losses"]
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert abs(g - w) <= LOSS_RTOL * abs(w), (rank, step, got, want)
    assert len({tuple(r["losses"]) for r in per_rank}) == 1  # every stage reports the last's
    assert sorted({r["stage"] for r in per_rank}) == list(range(case["stages"]))


def test_hf_pipeline_is_bitwise_when_run_again(four: dict[str, Any]) -> None:
    assert four["train"][2] == four["train"][3]


def test_model_without_a_plan_is_refused_on_every_rank(four: dict[str, Any]) -> None:
    for message in four["bad"]:
        assert "GPT2LMHeadModel has no pipeline plan" in message, message


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", False)])
def test_layers_reproduce_the_models_logits(arch: str, tied: bool) -> None:
    """The pipeline layers run in order are the model's forward, bit for bit: one layer per
    decoder layer between the embedding and the norm, the head last (tied: the embedding's
    matrix)."""
    model = tiny_model(arch, tied)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    layers = hf_pipeline_layers(model)
    assert len(layers) == 1 + model.config.num_hidden_layers + 2
    assert isinstance(layers[0], TiedLayerSpec) == tied == isinstance(layers[-1], TiedLayerSpec)
    x: Any = ids
    shared = None
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            if shared is None:
                shared = layer.build()
                x = shared(x)
            else:
                x = tied_logits(shared, x)
        else:
            x = layer(x)
    with torch.no_grad():
        assert torch.equal(x, model(ids).logits)
