"""``optimizer.params`` and ``scheduler.params``: typed, checked at load time (before any
process group exists), with the dotted key, the expected type and a "did you mean"."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
import torch

from partita.config import ConfigError, load_config
from partita.config.sections.optim_params import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from partita.optim import schedulers
from partita.testing import run_python

BASE: dict[str, Any] = {"train_batch_size": 8}


def _problems(extra: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **extra}, world_size=1)
    return [(p.path, p.message) for p in info.value.problems]


def _opt(type_: str, **params: Any) -> dict[str, Any]:
    return {"optimizer": {"type": type_, "params": params}}


def _sched(type_: str, **params: Any) -> dict[str, Any]:
    return {"scheduler": {"type": type_, "params": params}}


# (config fragment, dotted key expected, fragment of the message)
MALFORMED = [
    (_opt("AdamW", lr="fast"), "optimizer.params.lr", "expected a number, got str 'fast'"),
    (_opt("adam", lr=-1e-3), "optimizer.params.lr", "greater than or equal to 0"),
    (_opt("Adam", betas=[0.9]), "optimizer.params.betas", "2 items"),
    (_opt("Adam", betas=[0.9, 1.5]), "optimizer.params.betas", "in [0, 1)"),
    (_opt("AdamW", weight_decya=0.1), "optimizer.params.weight_decya", "did you mean 'weight_decay'"),
    (_opt("AdamW", torch_adam="yes"), "optimizer.params.torch_adam", "boolean"),
    (_opt("Adagrad", lr_decay="x"), "optimizer.params.lr_decay", "expected a number"),
    (_opt("SGD", momentun=0.9), "optimizer.params.momentun", "did you mean 'momentum'"),
    (_opt("SGD", nesterov=True), "optimizer.params.nesterov", "momentum > 0"),
    (
        _sched("WarmupLR", warmup_num_step=10),
        "scheduler.params.warmup_num_step",
        "did you mean 'warmup_num_steps'",
    ),
    (_sched("WarmupLR", warmup_type="cosine"), "scheduler.params.warmup_type", "'log' or 'linear'"),
    (_sched("WarmupLR", warmup_num_steps=0.5), "scheduler.params.warmup_num_steps", "whole"),
    (_sched("WarmupDecayLR", warmup_num_steps=10), "scheduler.params.total_num_steps", "missing"),
    (_sched("WarmupCosineLR", total_num_steps="100"), "scheduler.params.total_num_steps", "integer"),
    (_sched("OneCycle", cycle_min_lr=0.1), "scheduler.params.cycle_max_lr", "missing"),
    (
        _sched("OneCycle", cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0),
        "scheduler.params.cycle_first_step_size",
        "greater than 0",
    ),
    (_sched("LRRangeTest", lr_range_test_staircase=1), "scheduler.params.lr_range_test_staircase", "boolean"),
    (_sched("LRRangeTest", lr_range_test_min_lr=[0.1, "a"]), "scheduler.params.lr_range_test_min_lr", "number"),
]  # fmt: skip


@pytest.mark.parametrize(("fragment", "path", "message"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_params_are_rejected_at_load(
    fragment: dict[str, Any], path: str, message: str
) -> None:
    problems = _problems(fragment)
    assert any(p == path and message in m for p, m in problems), problems


def test_all_param_problems_are_listed_together() -> None:
    problems = _problems({**_opt("AdamW", lr="fast", eps="tiny"), **_sched("WarmupLR", x=1)})
    assert {p for p, _ in problems} == {
        "optimizer.params.lr",
        "optimizer.params.eps",
        "scheduler.params.x",
    }


def test_auto_leftover_in_params_is_reported_once() -> None:
    problems = _problems(_opt("AdamW", lr="auto"))
    assert [p for p, _ in problems] == ["optimizer.params.lr"], problems
    assert '"auto"' in problems[0][1]


# Configs as DeepSpeed's documentation and Hugging Face examples write them.
VALID = [
    _opt("Adam", lr=0.001, betas=[0.8, 0.999], eps=1e-8, weight_decay=3e-7),
    _opt("AdamW", lr=3e-5, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, torch_adam=True),
    _opt("Adam", lr=1, adam_w_mode=False, bias_correction=True, set_grad_none=True, amsgrad=True),
    _opt("adamw", lr=2e-4, fused=False, foreach=True),
    _opt("Adagrad", lr=0.01, lr_decay=0.0, initial_accumulator_value=0.1, eps=1e-10),
    _opt("SGD", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    _opt("RMSprop", lr=0.01, alpha=0.9),  # any torch.optim class: its own names, checked later
    _sched("WarmupLR", warmup_min_lr=0, warmup_max_lr=0.001, warmup_num_steps=1000),
    _sched("WarmupLR", warmup_min_lr=[0, 0], warmup_max_lr=[1e-3, 1e-4], warmup_type="linear"),
    _sched(
        "WarmupDecayLR",
        total_num_steps=10000,
        warmup_min_lr=0,
        warmup_max_lr=0.001,
        warmup_num_steps=1000,
    ),
    _sched(
        "WarmupCosineLR",
        total_num_steps=1e4,
        warmup_min_ratio=0.0,
        warmup_num_steps=100,
        cos_min_ratio=1e-4,
    ),
    _sched(
        "OneCycle",
        cycle_min_lr=1e-4,
        cycle_max_lr=1e-3,
        decay_lr_rate=0.001,
        cycle_first_step_size=1000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=1000,
        cycle_momentum=True,
        cycle_min_mom=0.85,
        cycle_max_mom=0.99,
        decay_mom_rate=0.0,
    ),
    _sched(
        "LRRangeTest",
        lr_range_test_min_lr=0.0001,
        lr_range_test_step_size=200,
        lr_range_test_step_rate=5,
        lr_range_test_staircase=False,
    ),
    _sched("StepLR", step_size=10, gamma=0.5),  # torch.optim.lr_scheduler: checked later
]


@pytest.mark.parametrize("fragment", VALID, ids=[json.dumps(v)[:60] for v in VALID])
def test_deepspeed_style_params_load(fragment: dict[str, Any]) -> None:
    cfg = load_config({**BASE, **fragment}, world_size=1)
    section = cfg.optimizer or cfg.scheduler
    assert section is not None
    # The params stay as written: the factories apply DeepSpeed's semantics to them.
    assert dict(section.params) == next(iter(fragment.values()))["params"]


def _kwargs_of(target: Any, skip: int = 1) -> set[str]:
    params = list(inspect.signature(target).parameters.values())[skip:]
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}


@pytest.mark.parametrize("name", sorted(SCHEDULER_PARAMS))
def test_scheduler_models_match_the_schedule_classes(name: str) -> None:
    cls = {c.__name__.lower(): c for c in schedulers._DEEPSPEED_SCHEDULES.values()}[name]
    assert set(SCHEDULER_PARAMS[name].model_fields) == _kwargs_of(cls)


FUSED_ADAM_KEYS = {
    "torch_adam",
    "adam_w_mode",
    "bias_correction",
    "set_grad_none",
    "fp32_optimizer_states",
}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("adam", _kwargs_of(torch.optim.AdamW) | FUSED_ADAM_KEYS),
        ("adamw", _kwargs_of(torch.optim.AdamW) | FUSED_ADAM_KEYS),
        ("adagrad", _kwargs_of(torch.optim.Adagrad)),
        ("sgd", _kwargs_of(torch.optim.SGD)),
    ],
)
def test_optimizer_models_match_what_the_factory_accepts(name: str, expected: set[str]) -> None:
    assert set(OPTIMIZER_PARAMS[name].model_fields) == expected


def test_every_deepspeed_name_is_accepted() -> None:
    """DeepSpeed's own parameter names (the installed deepspeed) are all in the models, so a
    valid DeepSpeed section never fails on a name."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime import lr_schedules

    for name, model in SCHEDULER_PARAMS.items():
        cls = {c.lower(): getattr(lr_schedules, c) for c in lr_schedules.VALID_LR_SCHEDULES}[name]
        assert _kwargs_of(cls.__init__, skip=2) <= set(model.model_fields), name
    # DeepSpeed builds FusedAdam, or DeepSpeedCPUAdam under optimizer offload (adamw_mode is
    # set by DeepSpeed itself from adam_w_mode, so a config cannot hold it).
    adam = set(OPTIMIZER_PARAMS["adam"].model_fields)
    assert _kwargs_of(FusedAdam.__init__, skip=2) <= adam
    assert _kwargs_of(DeepSpeedCPUAdam.__init__, skip=2) - {"adamw_mode"} <= adam


_INITIALIZE_CODE = """
import json, torch, partita
from partita import comm
from partita.config import ConfigError
from partita.optim import OptimConfigError
configs = json.loads({configs!r})
for cfg in configs:
    try:
        partita.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    except (ConfigError, OptimConfigError) as error:
        print(type(error).__name__, str(error).replace(chr(10), " "), comm.is_initialized())
    else:
        print("accepted", comm.is_initialized())
"""


def test_initialize_rejects_bad_params_before_any_process_group() -> None:
    bad = [
        {**BASE, **_opt("AdamW", lr="fast")},
        {**BASE, **_opt("AdamW", lr=1e-3), **_sched("WarmupLR", warmup_num_step=5)},
        {**BASE, **_opt("RMSprop", lr=0.01, alpah=0.9)},
        {**BASE, **_opt("Lamb", lr=0.01)},
        {**BASE, **_opt("AdamW", lr=1e-3), **_sched("StepLR", step_sise=3)},
    ]
    code = _INITIALIZE_CODE.format(configs=json.dumps(bad))
    lines = run_python(code, PARTITA_ACCELERATOR="cpu").splitlines()
    expected = [
        "optimizer.params.lr: expected a number",
        "scheduler.params.warmup_num_step: unknown key; did you mean 'warmup_num_steps'?",
        "optimizer.params.alpah",
        "optimizer.type: 'Lamb' is not supported",
        "scheduler.params.step_sise",
    ]
    assert len(lines) == len(expected), lines
    for line, fragment in zip(lines, expected, strict=True):
        assert fragment in line, line
        assert line.endswith("False"), line  # no process group was created
