"""``deepspeed.runtime.precision_config``: the ``bf16`` / ``fp16`` sections read from a config
dict, as partita's section models (`partita.config.sections.precision`)."""

from __future__ import annotations

from typing import Any

from partita.compat.deepspeed._missing import module_getattr
from partita.config.sections.precision import BF16Config as DeepSpeedBF16Config
from partita.config.sections.precision import FP16Config as DeepSpeedFP16Config

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # the older spelling, still read
FP16 = "fp16"


def get_bfloat16_config(param_dict: dict[str, Any]) -> DeepSpeedBF16Config:
    """The ``bf16`` section of config dict `param_dict` (or its ``bfloat16`` spelling; defaults
    when neither is there)."""
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config.model_validate(section)


def get_float16_config(param_dict: dict[str, Any]) -> DeepSpeedFP16Config:
    """The ``fp16`` section of config dict `param_dict` (defaults when absent)."""
    return DeepSpeedFP16Config.model_validate(param_dict.get(FP16, {}))


__getattr__ = module_getattr("deepspeed.runtime.precision_config")

__all__ = [
    "BFLOAT16",
    "BFLOAT16_OLD",
    "FP16",
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "get_bfloat16_config",
    "get_float16_config",
]
