"""``deepspeed.runtime.zero``: ZeRO-3 construction and gathering helpers (partita's)."""

from __future__ import annotations

from typing import Any

import torch

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.runtime.zero.param_attrs import ZeroParamStatus
from partita.zero import GatheredParameters
from partita.zero.init import Init as _PartitaInit


class Init(_PartitaInit):
    """``deepspeed.zero.Init``: partita's `partita.zero.Init`. A ``config_dict_or_path`` with
    bf16 or fp16 enabled builds the parameters in that dtype, as DeepSpeed does, unless ``dtype``
    is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dtype") is None:
            kwargs["dtype"] = _config_dtype(kwargs.get("config_dict_or_path", kwargs.get("config")))
        super().__init__(*args, **kwargs)


def _config_dtype(config: Any) -> torch.dtype | None:
    if not isinstance(config, dict):
        return None
    for key, dtype in (
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
    ):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return None


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed gathers `parameter` whenever `module` runs. partita's stage 3 gathers whole
    units (a transformer block, or the module owning the parameter, with its children), so a
    parameter read by a module of its own unit needs nothing; one read elsewhere raises
    `ShardedParameterError` naming it rather than computing with a placeholder. Accepted for
    the models that call it (Hugging Face's wav2vec2 family); registration itself is a no-op."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(
            f"register_external_parameter expects a torch.nn.Parameter, got {type(parameter).__name__}"
        )
    del module


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """The inverse of `register_external_parameter` (nothing to undo)."""
    del module, parameter


# Imported last: it re-exports the names above.
from partita.compat.deepspeed.runtime.zero import partition_parameters  # noqa: E402

__getattr__ = module_getattr("deepspeed.runtime.zero")

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "partition_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]
