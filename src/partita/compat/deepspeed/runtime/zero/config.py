"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` section's model
(``DeepSpeedZeroConfig``: partita's `ZeroConfig`, validated as partita validates it, unknown
keys named), ``ZeroStageEnum`` and the offload sections' models."""

from __future__ import annotations

import enum

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from partita.config.sections.zero import ZeroConfig as DeepSpeedZeroConfig


class ZeroStageEnum(enum.IntEnum):
    """ZeRO stages by DeepSpeed's names."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__getattr__ = module_getattr("deepspeed.runtime.zero.config")

__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "ZeroStageEnum",
]
