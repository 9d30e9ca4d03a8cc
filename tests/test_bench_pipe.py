"""benchmarks/bench_pipe.py's compute stand-in ([Note: a compute stand-in for more stages than
cores]): each block pays its forward, input-gradient and weight-gradient cost exactly once per
micro-batch, in a whole backward and in zero-bubble's split one (input pass, then weight pass),
and the theory column (no processes spawned)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from benchmarks import bench_pipe as bp


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Counter[float]:
    """Counts the stand-in's sleeps by length instead of sleeping."""
    seen: Counter[float] = Counter()
    monkeypatch.setattr(bp.time, "sleep", lambda s: seen.update([s]))
    return seen


def _block_and_input(ms: float) -> tuple[Any, torch.Tensor]:
    torch.manual_seed(0)
    block = bp.Block(8, sleep_ms=ms)
    x = torch.randn(2, 3, 8, requires_grad=True)
    return block, x


def test_a_whole_backward_pays_each_cost_once(sleeps: Counter[float]) -> None:
    block, x = _block_and_input(1.0)
    block(x).sum().backward()
    assert sleeps == Counter({0.001: 3})  # forward, input gradient, weight gradient


def test_the_split_backward_pays_input_then_weight_cost_once(sleeps: Counter[float]) -> None:
    block, x = _block_and_input(2.0)
    out = block(x).sum()
    assert sleeps == Counter({0.002: 1})
    torch.autograd.grad(out, [x], retain_graph=True)  # the input pass
    assert sleeps == Counter({0.002: 2})
    torch.autograd.grad(out, [block.fc1.weight, block.norm.weight])  # the weight pass
    assert sleeps == Counter({0.002: 3})


def test_no_stand_in_without_sleep_and_none_without_gradients(sleeps: Counter[float]) -> None:
    block, x = _block_and_input(0.0)
    block(x).sum().backward()
    timed, y = _block_and_input(1.0)
    with torch.no_grad():
        timed(y)
    assert not sleeps
    assert bp.Job().method == "parameters" and bp.Job(sleep_ms=1.0).method == "type:Block"


def test_theory_is_the_1f1b_bubble() -> None:
    assert bp.theory(4, 8, 1) == pytest.approx(3 / 11)
    assert bp.theory(4, 8, 2) == pytest.approx(3 / 19)
    assert bp.theory(2, 4, 1) == pytest.approx(1 / 5)
