"""The offloaded step writes updated weights slice by slice (`CPUAdamW.step_slices`,
`CopyBack`, `step_with_copy_back`): bitwise what a whole torch fused step followed by a cast
gives, in every weight dtype, through direct writes and through the staging buffers; and
stages 1-2 in 16-bit precision train bitwise like stage 0 with it."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from engine_workers import base_config, train_grid
from partita.offload.copy_back import CopyBack
from partita.optim import CPUAdamW, adam_kernel
from partita.optim.cpu_adam import Slice
from partita.testing import run_distributed
from partita.zero.shard_step import slice_plan, step_with_copy_back

# Only where the kernel's own path is asserted; elsewhere torch's step and a copy must agree too.
needs_kernel = pytest.mark.skipif(
    not adam_kernel.available(), reason=f"kernel unavailable: {adam_kernel.why_not()}"
)

SIZES = (100_003, 37, 4096, 19)


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    for p in params[:-1]:  # the last one has no gradient: unchanged, still copied
        p.grad = torch.randn(p.numel(), generator=gen)
    return params


def _optimizer(cls: type, params: list[torch.nn.Parameter]) -> Any:
    groups = [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "lr": 3e-3, "betas": (0.3, 0.99)},  # torch's other lerp branch
    ]
    return cls(groups, lr=1e-2, fused=True)


def _targets(
    params: list[torch.nn.Parameter], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[list[tuple[int, torch.Tensor]]]]:
    """A weights tensor per parameter, cut into three views at odd offsets."""
    weights = [torch.empty(p.numel(), dtype=dtype) for p in params]
    pieces = []
    for w in weights:
        cuts = sorted({0, w.numel() // 3 + 1, w.numel() // 2 + 3, w.numel()})
        pieces.append([(a, w[a:b]) for a, b in itertools.pairwise(cuts) if a < b])
    return weights, pieces


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_step_slices_is_bitwise_a_whole_step_then_a_cast(dtype: torch.dtype, staged: bool) -> None:
    ours, theirs = _params(0), _params(0)
    opt, ref = _optimizer(CPUAdamW, ours), _optimizer(torch.optim.AdamW, theirs)
    weights, pieces = _targets(ours, dtype)
    # 16-element sub-groups are the finest cut; 4000 mixes slice and view boundaries.
    for step, max_numel in enumerate((4000, 16, 10**9)):
        if step == 1:  # different parameters at different steps (restored from elsewhere)
            for o in (opt, ref):
                o.state[o.param_groups[0]["params"][1]]["step"] += 5
        plan, dsts = slice_plan(ours, pieces, max_numel)
        sink = CopyBack(dsts, staged=staged)
        assert sink.staged == staged and (sink.nbytes > 0) == staged
        step_with_copy_back(opt, plan, sink)
        ref.step()
        for p, q, w in zip(ours, theirs, weights, strict=True):
            assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))
            assert torch.equal(w.view(torch.uint8), q.detach().to(dtype).view(torch.uint8))
        for p, q in zip(ours[:-1], theirs[:-1], strict=True):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], ref.state[q][key]), key


def test_other_optimizers_step_whole_then_copy() -> None:
    ours, theirs = _params(1), _params(1)
    opt = torch.optim.SGD(ours, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    weights, pieces = _targets(ours, torch.bfloat16)
    plan, dsts = slice_plan(ours, pieces, 1000)
    step_with_copy_back(opt, plan, CopyBack(dsts))
    ref.step()
    for w, q in zip(weights, theirs, strict=True):
        assert torch.equal(w, q.detach().to(torch.bfloat16))


@needs_kernel
def test_slices_must_cover_every_stepped_parameter() -> None:
    params = _params(2)
    opt = _optimizer(CPUAdamW, params)
    _, pieces = _targets(params, torch.float32)
    plan, dsts = slice_plan(params, pieces, 1000)
    with pytest.raises(ValueError, match="cover each stepped parameter"):
        opt.step_slices(plan[1:], CopyBack(dsts[1:]))
    with pytest.raises(ValueError, match="do not cover"):
        slice_plan(params[:1], [pieces[0][1:]], 1000)


def test_sharded_stages_in_16_bit_train_bitwise_like_stage_0() -> None:
    """Stage 0 steps whole masters and casts them with torch; stages 1-3 (with and without
    optimizer offload, and with small sub-groups) write the cast in the step."""
    cases = []
    precisions = (
        {"bf16": {"enabled": True}},
        {"fp16": {"enabled": True, "initial_scale_power": 8}},
    )
    for precision in precisions:
        cases.append({"config": base_config(2, 1, **precision), "steps": 6})
        for stage in (1, 2, 3):
            for extra in ({}, {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 100}):
                zero = {"stage": stage, "reduce_bucket_size": 3000, **extra}
                if stage == 3:
                    zero["stage3_param_persistence_threshold"] = 0
                config = base_config(2, 1, zero_optimization=zero, **precision)
                cases.append({"config": config, "steps": 6})
    results = run_distributed(train_grid, 2, cases, timeout=240)
    per_precision = len(cases) // len(precisions)
    for rank_results in results:
        for i in range(0, len(cases), per_precision):
            stage0, *sharded = rank_results[i : i + per_precision]
            for run in sharded:
                assert run["losses"] == stage0["losses"]
                assert all(
                    torch.equal(a, b) for a, b in zip(run["params"], stage0["params"], strict=True)
                )


def test_step_hooks_run_and_kernel_less_cases_still_copy() -> None:
    """step_slices runs inside `step`: registered step hooks fire; with amsgrad (torch's
    kernel) the update is torch's and the weights still get their cast."""
    for amsgrad in (False, True):
        ours, theirs = _params(3), _params(3)
        opt = CPUAdamW(ours, lr=1e-2, amsgrad=amsgrad)
        ref = torch.optim.AdamW(theirs, lr=1e-2, amsgrad=amsgrad, fused=True)
        calls: list[str] = []
        opt.register_step_pre_hook(lambda *_, calls=calls: calls.append("pre"))
        opt.register_step_post_hook(lambda *_, calls=calls: calls.append("post"))
        weights, pieces = _targets(ours, torch.bfloat16)
        plan, dsts = slice_plan(ours, pieces, 1000)
        step_with_copy_back(opt, plan, CopyBack(dsts))
        ref.step()
        assert calls == ["pre", "post"]
        for p, q, w in zip(ours, theirs, weights, strict=True):
            assert torch.equal(p, q) and torch.equal(w, q.detach().to(torch.bfloat16))


@needs_kernel
def test_step_planned_steps_only_its_parameters() -> None:
    """NVMe offload steps one resident sub-group at a time: the others keep their values, step
    counters and (absent) state although they have gradients."""
    ours, theirs = _params(4), _params(4)
    opt, ref = CPUAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs[:1], lr=1e-2, fused=True)
    before = [p.detach().clone() for p in ours]
    weights = torch.empty(ours[0].numel(), dtype=torch.bfloat16)
    assert opt.step_planned([[Slice(ours[0], 0, ours[0].numel())]], CopyBack([[weights]]))
    ref.step()
    assert torch.equal(ours[0], theirs[0]) and torch.equal(weights, theirs[0].detach().bfloat16())
    assert all(torch.equal(p, b) for p, b in zip(ours[1:], before[1:], strict=True))
    assert set(opt.state) == {ours[0]}
    amsgrad = CPUAdamW(ours, lr=1e-2, amsgrad=True)
    assert not amsgrad.step_planned([[Slice(ours[0], 0, ours[0].numel())]], CopyBack([[weights]]))
    assert not amsgrad.state  # nothing done: the caller steps another way
