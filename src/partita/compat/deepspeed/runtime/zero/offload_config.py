"""``deepspeed.runtime.zero.offload_config``: the offload enums RLHF frameworks pass to
``engine.offload_states`` (partita's own, with DeepSpeed's names and values) and the offload
sections' models (partita's, validated as partita validates them)."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.config.sections.zero import (
    OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig,
)
from partita.config.sections.zero import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig
from partita.engine.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

__getattr__ = module_getattr("deepspeed.runtime.zero.offload_config")

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
