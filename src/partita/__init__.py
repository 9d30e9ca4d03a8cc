"""partita: a distributed training engine for PyTorch (ZeRO, mixed precision, offload).

``import partita as deepspeed`` is a supported way in: the names a typical DeepSpeed training
script uses (``initialize``, ``init_distributed``, ``add_config_arguments``, ``comm``, ``zero``)
live here. Heavy submodules (anything importing torch) load lazily, so the ``partita`` CLI's
``--help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "initialize": ("partita.api", "initialize"),
    "init_inference": ("partita.inference", "init_inference"),
    "tp_model_init": ("partita.engine.tensor_parallel", "tp_model_init"),
    "pipeline_from_hf": ("partita.parallel.hf_pipe", "pipeline_from_hf"),
    "init_distributed": ("partita.comm", "init_distributed"),
    "add_config_arguments": ("partita.api", "add_config_arguments"),
    "DeepSpeedEngine": ("partita.engine", "Engine"),
    "Engine": ("partita.engine", "Engine"),
    "DeepSpeedConfig": ("partita.config", "DeepSpeedConfig"),
    "ConfigError": ("partita.config", "ConfigError"),
    "comm": ("partita.comm", None),
    "zero": ("partita.zero", None),
    "accelerator": ("partita.platform.accelerator", None),
    "utils": ("partita.utils", None),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'partita' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
