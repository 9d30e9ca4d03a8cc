"""A module outlives its engine: after ``engine.destroy()`` a new ``initialize`` on the same
module (Hugging Face's Trainer does this: Accelerate's ``free_memory`` destroys the engine, the
next ``prepare`` builds another) starts from the weights the first engine trained, at any stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import partita
from partita.testing import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
    }


def _weights(engine: Any) -> list[torch.Tensor]:
    with partita.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def reuse(first_stage: int, second_stage: int) -> dict[str, Any]:
    model = _model()
    engine, *_ = partita.initialize(model=model, config=_config(first_stage))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 8, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()
    trained = _weights(engine)
    engine.destroy()
    again, *_ = partita.initialize(model=model, config=_config(second_stage))
    x = torch.randn(2, 8, generator=g)
    with torch.no_grad():
        out = again(x)
    reloaded = _weights(again)
    again.backward(again(x).square().mean())  # and it trains
    again.step()
    again.destroy()
    return {"trained": trained, "reloaded": reloaded, "finite": bool(torch.isfinite(out).all())}


@pytest.mark.parametrize(("first", "second"), [(3, 3), (3, 0), (2, 3)])
def test_a_new_engine_on_a_destroyed_engines_module_starts_from_its_weights(
    first: int, second: int
) -> None:
    for result in run_distributed(reuse, 2, first, second, timeout=120):
        assert result["finite"]
        for a, b in zip(result["trained"], result["reloaded"], strict=True):
            assert torch.equal(a, b)
