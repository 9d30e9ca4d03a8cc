"""partita standing in for DeepSpeed: what ``import deepspeed`` gives when partita is asked to
stand in (see `partita.compat.alias`).

Thin adapters over partita's own API for the names Hugging Face Transformers, Accelerate and PEFT
use (and common DeepSpeed training scripts): `initialize` returns partita's engine, `zero.Init`
and `zero.GatheredParameters` are partita's, and so on. No algorithm lives here. A DeepSpeed
module partita does not implement resolves to a stub (`partita.compat.deepspeed._stubs`) whose
names raise naming the feature and what partita offers instead; a missing attribute of this
package raises `NotInPartita` (an AttributeError) naming it.

Importing this package is cheap (no CUDA, no compiled ops): Accelerate imports
``deepspeed.DeepSpeedEngine`` on every ``unwrap_model`` once DeepSpeed looks installed.
"""

from __future__ import annotations

from typing import Any

from partita import __version__ as _partita_version
from partita.compat.alias import API_LEVEL
from partita.compat.deepspeed import (
    _stubs,
    accelerator,
    checkpoint,
    comm,
    launcher,
    ops,
    runtime,
    utils,
    zero,
)
from partita.compat.deepspeed._missing import missing_attribute
from partita.compat.deepspeed.api import add_config_arguments, init_distributed, initialize
from partita.compat.deepspeed.runtime.engine import DeepSpeedEngine
from partita.config import ConfigError as DeepSpeedConfigError
from partita.config import DeepSpeedConfig

_stubs.install()

__version__ = f"{API_LEVEL}+partita.{_partita_version}"
version = __version__
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in API_LEVEL.split("."))
__git_hash__ = None
__git_branch__ = None

get_accelerator = accelerator.get_accelerator
logger = utils.logger

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "comm",
    "get_accelerator",
    "init_distributed",
    "init_inference",
    "initialize",
    "launcher",
    "logger",
    "ops",
    "runtime",
    "tp_model_init",
    "utils",
    "version",
    "zero",
]


def init_inference(model: Any, config: Any = None, **kwargs: Any) -> Any:
    """DeepSpeed's ``init_inference``: partita's tensor-parallel inference engine (see
    `partita.inference.init_inference`; imported on first call, keeping this package cheap)."""
    from partita.inference import init_inference as _init_inference

    return _init_inference(model, config, **kwargs)


def tp_model_init(model: Any, tp_size: int, dtype: Any, config: Any = None, **kwargs: Any) -> Any:
    """DeepSpeed's ``tp_model_init``: records the tensor-parallel size for the next
    ``initialize``, which splits the model (see `partita.engine.tensor_parallel.tp_model_init`)."""
    from partita.engine.tensor_parallel import tp_model_init as _tp_model_init

    return _tp_model_init(model, tp_size, dtype, config, **kwargs)


# DeepSpeed top-level names partita does not implement, with the feature each belongs to.
_UNSUPPORTED = {
    "InferenceEngine": "DeepSpeed inference",
    "DeepSpeedHybridEngine": "the RLHF hybrid engine",
}


# Submodules DeepSpeed binds on import, imported here on first use (keeps this package cheap).
_LAZY = {
    "checkpointing": "partita.compat.deepspeed.checkpointing",
    "moe": "partita.compat.deepspeed.moe",
    "pipe": "partita.compat.deepspeed.pipe",
    "profiling": "partita.compat.deepspeed.profiling",
}
# Top-level names DeepSpeed binds from its submodules: (module, attribute), imported on first
# use.
_LAZY_NAMES = {
    "PipelineModule": ("partita.compat.deepspeed.pipe", "PipelineModule"),
    "PipelineEngine": ("partita.compat.deepspeed.runtime.pipe.engine", "PipelineEngine"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return importlib.import_module(_LAZY[name])
    if name in _LAZY_NAMES:
        import importlib

        module, attribute = _LAZY_NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    raise missing_attribute("deepspeed", name, _UNSUPPORTED.get(name))
