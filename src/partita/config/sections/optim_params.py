"""Typed ``optimizer.params`` and ``scheduler.params`` for the types partita builds itself.

One model per optimizer type (DeepSpeed's ``Adam``/``AdamW`` with ``FusedAdam``'s keys,
``Adagrad``, ``SGD``) and per DeepSpeed schedule (``WarmupLR``, ``WarmupDecayLR``,
``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``), with the names, types and ranges the
factories in ``partita.optim`` accept. They only *check* the params at load time, before any
process group exists; the section keeps the dict as written, because the factories apply
DeepSpeed's semantics to it (``FusedAdam``'s weight decay default, ``adam_w_mode``). Other
``torch.optim`` names are checked against their torch signature before the process group
too (``partita.optim.check_optimizer_config``), since this layer imports no torch.

Names and defaults follow DeepSpeed (``deepspeed/ops/adam/fused_adam.py``,
``deepspeed/runtime/lr_schedules.py``) and torch 2.x; tests check them against the
factories' signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from .base import (
    Bool,
    Float,
    Int,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    real_number,
    whole_number,
)

__all__ = ["OPTIMIZER_PARAMS", "SCHEDULER_PARAMS", "ParamsModel"]


class ParamsModel(BaseModel):
    """Base of the params models: unknown keys are errors; JSON lists become tuples."""

    # Not strict: JSON has no tuples, so ``betas: [0.9, 0.999]`` must validate as a pair.
    # Numbers and booleans stay strict through the annotated types of ``base``.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


def _betas(value: Any) -> Any:
    """``[beta1, beta2]`` (a JSON list) as a pair of numbers, each in [0, 1)."""
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"expected a list of 2 items [beta1, beta2], got {value!r}")
    betas = tuple(real_number(v) for v in value)
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"each beta must be in [0, 1), got {list(value)!r}")
    return betas


def _per_group(value: Any) -> Any:
    """A number, or a list of numbers (one per param group), as floats."""
    if isinstance(value, list | tuple):
        try:
            return [real_number(v) for v in value]
        except ValueError as error:
            raise ValueError(f"{error} in the list {list(value)!r}") from None
    return real_number(value)


Betas = Annotated[tuple[float, float], BeforeValidator(_betas)]
"""``[beta1, beta2]`` with each in [0, 1)."""
PerGroup = Annotated[float | list[float], BeforeValidator(_per_group)]
"""One number for every param group, or a list with one per group."""
_LR = "Learning rate."


class _TorchFlags(ParamsModel):
    """Implementation switches every torch optimizer here takes."""

    foreach: Bool | None = Field(default=None, description="torch's multi-tensor implementation.")
    maximize: Bool = Field(default=False, description="Maximise the objective.")
    differentiable: Bool = Field(default=False, description="Autograd through the step.")
    fused: Bool | None = Field(default=None, description="torch's fused kernel.")


class AdamParams(_TorchFlags):
    """``Adam`` / ``AdamW``: DeepSpeed's ``FusedAdam`` keys plus torch's Adam keywords."""

    lr: NonNegFloat = Field(default=1e-3, description=_LR)
    betas: Betas = Field(
        default=(0.9, 0.999), description="Coefficients of the moment averages, each in [0, 1)."
    )
    eps: NonNegFloat = Field(default=1e-8, description="Denominator term.")
    weight_decay: NonNegFloat = Field(
        default=0.0, description="Weight decay (FusedAdam's default 0; torch_adam: torch's)."
    )
    amsgrad: Bool = Field(default=False, description="AMSGrad variant.")
    capturable: Bool = Field(default=False, description="CUDA-graph capturable step.")
    torch_adam: Bool = Field(default=False, description="Use torch's Adam/AdamW unchanged.")
    adam_w_mode: Bool = Field(default=True, description="Decoupled weight decay for 'Adam'.")
    bias_correction: Bool = Field(
        default=True, description="Correct the moment bias (false is refused)."
    )
    set_grad_none: Bool = Field(default=True, description="zero_grad sets grads to None.")
    fp32_optimizer_states: Bool = Field(
        default=True,
        description="DeepSpeedCPUAdam's (optimizer offload) fp32 states (false is refused).",
    )


class AdagradParams(_TorchFlags):
    """``Adagrad``: ``torch.optim.Adagrad``."""

    lr: NonNegFloat = Field(default=1e-2, description=_LR)
    lr_decay: NonNegFloat = Field(default=0.0, description="Learning rate decay.")
    weight_decay: NonNegFloat = Field(default=0.0, description="L2 penalty.")
    initial_accumulator_value: NonNegFloat = Field(
        default=0.0, description="Start of the squared-gradient sum."
    )
    eps: NonNegFloat = Field(default=1e-10, description="Denominator term.")


class SGDParams(_TorchFlags):
    """``SGD``: ``torch.optim.SGD``."""

    lr: NonNegFloat = Field(default=1e-3, description=_LR)
    momentum: NonNegFloat = Field(default=0.0, description="Momentum factor.")
    dampening: Float = Field(default=0.0, description="Dampening of the momentum.")
    weight_decay: NonNegFloat = Field(default=0.0, description="L2 penalty.")
    nesterov: Bool = Field(default=False, description="Nesterov momentum.")

    @field_validator("nesterov")
    @classmethod
    def _nesterov(cls, value: bool, info: ValidationInfo) -> bool:
        # torch's rule; momentum and dampening are declared first, so they are in info.data.
        momentum, dampening = info.data.get("momentum", 0.0), info.data.get("dampening", 0.0)
        if value and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"nesterov needs momentum > 0 and dampening 0 (got momentum={momentum}, "
                f"dampening={dampening})"
            )
        return value


OPTIMIZER_PARAMS: dict[str, type[ParamsModel]] = {
    "adam": AdamParams,
    "adamw": AdamParams,
    "adagrad": AdagradParams,
    "sgd": SGDParams,
}
"""Lower-case ``optimizer.type`` -> its params model (names match ignoring case)."""

# --- schedules -------------------------------------------------------------------------------

WarmupType = Literal["log", "linear"]
_WARMUP_STEPS = "Warmup steps (at least 2 are used)."
_LAST = "Step to resume from; -1 starts fresh."


class _Schedule(ParamsModel):
    last_batch_iteration: Annotated[int, BeforeValidator(whole_number), Field(ge=-1)] = Field(
        default=-1, description=_LAST
    )


class WarmupLRParams(_Schedule):
    """``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    warmup_min_lr: PerGroup = Field(default=0.0, description="Start of the warmup.")
    warmup_max_lr: PerGroup | None = Field(
        default=None, description="End of the warmup; None takes each group's lr."
    )
    warmup_num_steps: PositiveInt = Field(default=1000, description=_WARMUP_STEPS)
    warmup_type: WarmupType = Field(default="log", description="'log' or 'linear' warmup.")


class WarmupDecayLRParams(_Schedule):
    """``WarmupDecayLR``: ``WarmupLR``, then linear decay to 0 at ``total_num_steps``."""

    total_num_steps: NonNegInt = Field(description="Step at which the lr reaches 0.")
    warmup_min_lr: PerGroup = Field(default=0.0, description="Start of the warmup.")
    warmup_max_lr: PerGroup = Field(default=0.001, description="End of the warmup.")
    warmup_num_steps: PositiveInt = Field(default=1000, description=_WARMUP_STEPS)
    warmup_type: WarmupType = Field(default="log", description="'log' or 'linear' warmup.")


class WarmupCosineLRParams(_Schedule):
    """``WarmupCosineLR``: a ratio of each group's lr warms up, then follows a half cosine."""

    total_num_steps: NonNegInt = Field(description="Step at which the cosine ends.")
    warmup_min_ratio: Float = Field(default=0.0, description="Ratio at the start of warmup.")
    warmup_num_steps: PositiveInt = Field(default=1000, description=_WARMUP_STEPS)
    cos_min_ratio: Float = Field(default=0.0001, description="Ratio at the end of the cosine.")
    warmup_type: WarmupType = Field(default="log", description="'log' or 'linear' warmup.")


class OneCycleParams(_Schedule):
    """``OneCycle``: lr (and momentum) up and down once, then optional decay."""

    cycle_min_lr: PerGroup = Field(description="Lowest lr of the cycle.")
    cycle_max_lr: PerGroup = Field(description="Highest lr of the cycle.")
    decay_lr_rate: Float = Field(default=0.0, description="lr decay rate after the cycle.")
    cycle_first_step_size: PositiveFloat = Field(default=2000, description="Steps going up.")
    cycle_second_step_size: NonNegFloat | None = Field(
        default=None, description="Steps going down; None: as cycle_first_step_size."
    )
    cycle_first_stair_count: Int = Field(default=0, description="Stairs going up; <= 0: none.")
    cycle_second_stair_count: Int | None = Field(
        default=None, description="Stairs going down; None: as cycle_first_stair_count."
    )
    decay_step_size: NonNegFloat = Field(default=0, description="Decay interval; 0: no decay.")
    cycle_momentum: Bool = Field(default=True, description="Cycle beta1 inversely to the lr.")
    cycle_min_mom: PerGroup = Field(default=0.8, description="Lowest beta1.")
    cycle_max_mom: PerGroup = Field(default=0.9, description="Highest beta1.")
    decay_mom_rate: Float = Field(default=0.0, description="Momentum decay rate after the cycle.")


class LRRangeTestParams(_Schedule):
    """``LRRangeTest``: grow the lr from ``lr_range_test_min_lr`` to find the largest usable."""

    lr_range_test_min_lr: PerGroup = Field(default=1e-3, description="Starting lr.")
    lr_range_test_step_size: PositiveInt = Field(default=2000, description="Steps per interval.")
    lr_range_test_step_rate: Float = Field(default=1.0, description="Growth per interval.")
    lr_range_test_staircase: Bool = Field(default=False, description="Grow in whole intervals.")


SCHEDULER_PARAMS: dict[str, type[ParamsModel]] = {
    "warmuplr": WarmupLRParams,
    "warmupdecaylr": WarmupDecayLRParams,
    "warmupcosinelr": WarmupCosineLRParams,
    "onecycle": OneCycleParams,
    "lrrangetest": LRRangeTestParams,
}
"""Lower-case ``scheduler.type`` -> its params model (names match ignoring case)."""
