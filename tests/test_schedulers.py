"""DeepSpeed learning-rate schedules: values against closed forms of DeepSpeed's formulas.

The expected numbers are written out from the formulas in deepspeed/runtime/lr_schedules.py
(not computed by calling partita), at steps chosen to hit each phase and boundary. Convention:
after construction ``last_batch_iteration`` is -1 and each ``step()`` adds one; ``lr_at(k)`` is
the lr the optimizer holds once the counter is k.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from partita.optim import (
    LRRangeTest,
    OneCycle,
    SchedulerConfigError,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def _optimizer(
    lrs: tuple[float, ...] = (0.1,), cls: type = torch.optim.AdamW
) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return cls(groups)


def _lrs_by_counter(sched: Any, opt: torch.optim.Optimizer, last: int) -> dict[int, list[float]]:
    """{counter: [group lrs]} for counters -1..last, stepping ``sched`` one at a time."""
    seen = {-1: [float(g["lr"]) for g in opt.param_groups]}
    for k in range(last + 1):
        sched.step()
        seen[k] = [float(g["lr"]) for g in opt.param_groups]
    return seen


def _approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-15)


# --- WarmupLR / WarmupDecayLR ---------------------------------------------------------------


def test_warmup_lr_log() -> None:
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.011, warmup_num_steps=10)
    lrs = _lrs_by_counter(sched, opt, 15)
    # gamma = ln(k + 1) / ln(10) = log10(k + 1) during warmup (k < 10), then 1.
    assert lrs[-1] == [0.001]  # construction applies min_lr
    assert lrs[0][0] == _approx(0.001)  # log(1) = 0
    assert lrs[4][0] == _approx(0.001 + 0.01 * math.log10(5))
    assert lrs[8][0] == _approx(0.001 + 0.01 * math.log10(9))
    assert lrs[9][0] == _approx(0.011)  # log10(10) = 1
    assert lrs[15][0] == _approx(0.011)
    assert sched.get_last_lr()[0] == _approx(0.011)


def test_warmup_lr_linear_defaults_and_min_steps() -> None:
    opt = _optimizer((0.05,))
    sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")  # max defaults to 0.05
    lrs = _lrs_by_counter(sched, opt, 5)
    assert [lrs[k][0] for k in range(-1, 6)] == [
        _approx(v) for v in (0.0, 0.0, 0.0125, 0.025, 0.0375, 0.05, 0.05)
    ]
    # warmup_num_steps is raised to at least 2 (log(1) would divide by zero).
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    lrs = _lrs_by_counter(sched, opt, 2)
    assert [lrs[k][0] for k in (0, 1, 2)] == [0.0, 0.5, 1.0]


def test_warmup_lr_per_group_lists() -> None:
    opt = _optimizer((0.1, 0.2))
    sched = WarmupLR(
        opt,
        warmup_min_lr=[0.0, 0.001],
        warmup_max_lr=[0.01, 0.021],
        warmup_num_steps=5,
        warmup_type="linear",
    )
    lrs = _lrs_by_counter(sched, opt, 6)
    assert lrs[-1] == [0.0, 0.001]
    assert lrs[2] == [_approx(0.01 * 2 / 5), _approx(0.001 + 0.02 * 2 / 5)]
    assert lrs[6] == [_approx(0.01), _approx(0.021)]
    with pytest.raises(
        SchedulerConfigError,
        match=r"warmup_max_lr: expected one value per param group \(2\), got a list of 3",
    ):
        WarmupLR(opt, warmup_max_lr=[0.1, 0.2, 0.3])


def test_warmup_decay_lr() -> None:
    opt = _optimizer()
    sched = WarmupDecayLR(
        opt, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=5, warmup_type="linear"
    )
    lrs = _lrs_by_counter(sched, opt, 25)
    # warmup: 0.1 * k / 5; after: 0.1 * (20 - k) / (20 - 5), floored at 0.
    assert lrs[3][0] == _approx(0.06)
    assert lrs[4][0] == _approx(0.08)
    assert lrs[5][0] == _approx(0.1)
    assert lrs[11][0] == _approx(0.1 * 9 / 15)
    assert lrs[19][0] == _approx(0.1 / 15)
    assert lrs[20][0] == 0.0
    assert lrs[25][0] == 0.0


def test_warmup_decay_lr_log_warmup_and_default_max() -> None:
    opt = _optimizer((0.5,))
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=8)
    lrs = _lrs_by_counter(sched, opt, 60)
    # warmup_max_lr defaults to 0.001 for WarmupDecayLR (not the group lr).
    assert lrs[2][0] == _approx(0.001 * math.log(3) / math.log(8))
    assert lrs[7][0] == _approx(0.001)
    assert lrs[60][0] == _approx(0.001 * 40 / 92)


# --- WarmupCosineLR -------------------------------------------------------------------------


def test_warmup_cosine_lr() -> None:
    opt = _optimizer((0.1, 0.3))
    sched = WarmupCosineLR(
        opt,
        total_num_steps=12,
        warmup_min_ratio=0.1,
        warmup_num_steps=4,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    lrs = _lrs_by_counter(sched, opt, 20)
    ratio = {
        0: 0.1,  # warmup_min_ratio + (k / 4) * (1 - warmup_min_ratio)
        2: 0.1 + 0.5 * 0.9,
        3: 0.1 + 0.75 * 0.9,
        # cosine from k = 4: progress (k - 4 + 1) / (12 - 4)
        4: 0.01 + 0.99 * (1 + math.cos(math.pi / 8)) / 2,
        7: 0.01 + 0.99 * (1 + math.cos(math.pi * 4 / 8)) / 2,
        11: 0.01,
        20: 0.01,
    }
    assert lrs[-1] == [0.0, 0.0]  # DeepSpeed applies ratio 0 at construction
    for k, r in ratio.items():
        assert lrs[k] == [_approx(0.1 * r), _approx(0.3 * r)], k


def test_warmup_cosine_lr_log_and_defaults() -> None:
    opt = _optimizer((0.2,))
    sched = WarmupCosineLR(opt, total_num_steps=1000, warmup_num_steps=10)
    lrs = _lrs_by_counter(sched, opt, 10)
    assert lrs[0][0] == 0.0  # warmup_min_ratio 0 and log(1) = 0
    assert lrs[4][0] == _approx(0.2 * math.log10(5))
    # first cosine step: progress 1/990; cos_min_ratio defaults to 1e-4
    expected = 1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi / 990)) / 2
    assert lrs[10][0] == _approx(0.2 * expected)


# --- OneCycle -------------------------------------------------------------------------------


def _cycle_lr(bi: int) -> float:
    """min 0.01, max 0.1, up over 4 batches, down over 6 (bi = counter + 1)."""
    scale = bi / 4 if bi <= 4 else (10 - bi) / 6
    return 0.01 + 0.09 * scale


def test_one_cycle_lr_and_momentum() -> None:
    opt = _optimizer()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_lr_rate=0.5,
        decay_step_size=2,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=0.1,
    )
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)  # min momentum; beta2 forced to 0.99
    lrs = {-1: 0.01}
    moms = {-1: 0.85}
    for k in range(16):
        sched.step()
        lrs[k] = opt.param_groups[0]["lr"]
        moms[k] = opt.param_groups[0]["betas"][0]
        assert opt.param_groups[0]["betas"][1] == 0.99
    for k in range(9):  # in the cycle: counter k < total size 10
        scale = (k + 1) / 4 if k + 1 <= 4 else (10 - k - 1) / 6
        assert lrs[k] == _approx(_cycle_lr(k + 1)), k
        assert moms[k] == _approx(0.95 - 0.1 * scale), k
    assert lrs[3] == _approx(0.1)
    assert moms[3] == _approx(0.85)
    assert lrs[8] == _approx(0.01 + 0.09 / 6)
    # decay from counter 10: d = k - 10 + 1; lr = min / (1 + 0.5 * d / 2),
    # beta1 = max_mom * (1 + 0.1 * d / 2)
    for k in (10, 11, 15):
        d = k - 9
        assert lrs[k] == _approx(0.01 / (1 + 0.5 * d / 2)), k
        assert moms[k] == _approx(0.95 * (1 + 0.1 * d / 2)), k


def test_one_cycle_stairs_and_no_decay() -> None:
    opt = _optimizer((0.1, 0.1))
    sched = OneCycle(
        opt,
        cycle_min_lr=[0.0, 0.1],
        cycle_max_lr=[1.0, 0.4],
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        cycle_first_stair_count=2,
        cycle_second_stair_count=3,
    )
    lrs = _lrs_by_counter(sched, opt, 14)
    # up: scale = floor(bi * 2 / 4) / 2; down: floor((10 - bi) * 3 / 6) / 3 (bi = k + 1)
    scales = {0: 0.0, 1: 0.5, 2: 0.5, 3: 1.0, 4: 2 / 3, 5: 2 / 3, 6: 1 / 3, 7: 1 / 3, 8: 0.0}
    for k, s in scales.items():
        assert lrs[k] == [_approx(s), _approx(0.1 + 0.3 * s)], k
    # after the cycle, no decay (decay_step_size 0): back at cycle_min_lr
    assert lrs[9] == [0.0, 0.1]
    assert lrs[14] == [0.0, 0.1]


def test_one_cycle_sgd_has_no_momentum_cycling() -> None:
    opt = _optimizer(cls=torch.optim.SGD)
    sched = OneCycle(
        opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_second_step_size=6
    )
    sched.step()
    assert "betas" not in opt.param_groups[0]
    assert opt.param_groups[0]["momentum"] == 0
    assert opt.param_groups[0]["lr"] == _approx(_cycle_lr(1))
    assert sched.get_mom() is None


# --- LRRangeTest ----------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    opt = _optimizer((0.5, 0.5))
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=[1e-3, 2e-3],
        lr_range_test_step_size=5,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=staircase,
    )
    lrs = _lrs_by_counter(sched, opt, 12)
    for k in (-1, 0, 3, 4, 9, 12):
        interval = (k + 1) / 5
        if staircase:
            interval = math.floor(interval)
        factor = 1 + 2.0 * interval
        assert lrs[k] == [_approx(1e-3 * factor), _approx(2e-3 * factor)], k
    # counter 3 is still on the first stair; the continuous test has already grown
    assert (lrs[3][0] == 1e-3) is staircase


# --- protocol: state_dict, explicit step, tensor lr -----------------------------------------

_ALL = [
    (WarmupLR, {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 7}),
    (WarmupDecayLR, {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"}),
    (WarmupCosineLR, {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
    (
        OneCycle,
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 4,
            "decay_lr_rate": 0.1,
            "decay_step_size": 3,
        },
    ),
    (LRRangeTest, {"lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.5}),
]


@pytest.mark.parametrize(("cls", "kwargs"), _ALL, ids=[c.__name__ for c, _ in _ALL])
def test_state_dict_resumes_the_sequence(cls: type, kwargs: dict) -> None:
    opt_a = _optimizer((0.1, 0.2))
    sched_a = cls(opt_a, **kwargs)
    for _ in range(7):
        sched_a.step()
    state = sched_a.state_dict()
    assert state == {"last_batch_iteration": 6}

    opt_b = _optimizer((0.1, 0.2))  # fresh run: same base lrs, as after a restart
    sched_b = cls(opt_b, **kwargs)
    sched_b.load_state_dict(state)
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    for _ in range(15):
        sched_a.step()
        sched_b.step()
        assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
        assert [g.get("betas") for g in opt_b.param_groups] == [
            g.get("betas") for g in opt_a.param_groups
        ]
        assert sched_b.get_last_lr() == sched_a.get_last_lr()


def test_step_with_explicit_iteration_and_resume_by_argument() -> None:
    opt = _optimizer()
    sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    sched.step(6)
    assert sched.last_batch_iteration == 6
    assert opt.param_groups[0]["lr"] == _approx(0.06)
    sched.step()
    assert opt.param_groups[0]["lr"] == _approx(0.07)
    # Built mid-run: nothing applied until the first step (DeepSpeed semantics).
    opt = _optimizer((0.5,))
    sched = WarmupLR(
        opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=3
    )
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(RuntimeError, match="call step"):
        sched.get_last_lr()
    sched.step()
    assert opt.param_groups[0]["lr"] == _approx(0.04)


def test_tensor_lr_is_updated_in_place() -> None:
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == _approx(0.1 * 0.5)


# --- build_scheduler ------------------------------------------------------------------------


def test_build_scheduler_deepspeed_and_torch_names() -> None:
    opt = _optimizer()
    sched = build_scheduler("warmuplr", {"warmup_max_lr": 0.3, "warmup_num_steps": 3}, opt)
    assert isinstance(sched, WarmupLR)
    sched = build_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    sched = build_scheduler("cosineannealinglr", {"T_max": 10}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.CosineAnnealingLR)


@pytest.mark.parametrize(
    ("sched_type", "params", "pattern"),
    [
        (
            "WarmupLRR",
            {},
            r"scheduler\.type: unknown scheduler 'WarmupLRR' \(did you mean 'WarmupLR'\?\)",
        ),
        (
            "WarmupLR",
            {"warmup_max_lrr": 0.1},
            r"scheduler\.params\.warmup_max_lrr: unknown .*did you mean 'warmup_max_lr'",
        ),
        (
            "WarmupDecayLR",
            {"warmup_max_lr": 0.1},
            r"scheduler\.params\.total_num_steps: required .* missing",
        ),
        ("OneCycle", {"cycle_min_lr": 0.1}, r"scheduler\.params\.cycle_max_lr: required"),
        (
            "WarmupLR",
            {"warmup_type": "lineer"},
            r"scheduler\.params\.warmup_type: expected 'log' or 'linear', got 'lineer' \(did you mean 'linear'\?\)",
        ),
        (
            "WarmupLR",
            {"warmup_num_steps": 0},
            r"scheduler\.params\.warmup_num_steps: expected an integer >= 1, got 0",
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": "100"},
            r"scheduler\.params\.total_num_steps: expected an integer >= 0, got '100'",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
            r"scheduler\.params\.cycle_first_step_size: must be > 0",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_momentum": "yes"},
            r"scheduler\.params\.cycle_momentum: expected true or false",
        ),
        (
            "LRRangeTest",
            {"lr_range_test_min_lr": [0.1, 0.2]},
            r"scheduler\.params\.lr_range_test_min_lr: expected one value per param group \(1\)",
        ),
        ("LambdaLR", {}, r"scheduler\.type: LambdaLR needs an lr_lambda function"),
        (
            "StepLR",
            {"stepsize": 2},
            r"scheduler\.params\.stepsize: unknown .*did you mean 'step_size'",
        ),
        (3, {}, r"scheduler\.type: expected a scheduler name"),
    ],
)
def test_build_scheduler_errors(sched_type: object, params: dict, pattern: str) -> None:
    with pytest.raises(SchedulerConfigError, match=pattern) as info:
        build_scheduler(sched_type, params, _optimizer())  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert info.value.key is not None and info.value.key.startswith("scheduler.")
