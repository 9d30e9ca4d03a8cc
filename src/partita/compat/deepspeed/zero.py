"""``deepspeed.zero``: partita's ZeRO-3 helpers under DeepSpeed's names."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.runtime.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__getattr__ = module_getattr("deepspeed.zero")

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
