"""``optimizer`` and ``scheduler``: a type name and its keyword arguments."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictStr

from .base import Section

__all__ = ["OptimizerConfig", "SchedulerConfig"]


class OptimizerConfig(Section):
    """``optimizer``: the optimizer the engine builds when the script passes none."""

    type: StrictStr = Field(
        description="Optimizer name as DeepSpeed spells it (e.g. 'Adam', 'AdamW', 'SGD'); "
        "matched case-insensitively by the engine."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the optimizer (lr, betas, eps, weight_decay, ...).",
    )


class SchedulerConfig(Section):
    """``scheduler``: the learning rate schedule the engine builds when the script passes none."""

    type: StrictStr = Field(
        description="Scheduler name as DeepSpeed spells it (e.g. 'WarmupLR', 'WarmupDecayLR', "
        "'WarmupCosineLR', 'OneCycle', 'LRRangeTest')."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the scheduler (warmup_num_steps, total_num_steps, ...).",
    )
