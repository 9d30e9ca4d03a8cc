"""partita.config: DeepSpeed ``ds_config.json`` as validated pydantic models (no torch here).

Entry points: :func:`load_config` (dict, JSON or hjson file -> :class:`DeepSpeedConfig`) and
:func:`resolve_auto` (fill Hugging Face style ``"auto"`` values). Every error is a
:class:`ConfigError` that lists all problems with their dotted key paths.
"""

from __future__ import annotations

from .auto import AUTO_ALIASES, find_auto, resolve_auto
from .batch import BatchSizes, resolve_batch_sizes
from .errors import ConfigError, Problem, config_error
from .loader import load_config, validate_config
from .root import DeepSpeedConfig
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CSVMonitorConfig,
    DataTypesConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    ParallelWriteConfig,
    SchedulerConfig,
    TensorBoardConfig,
    WandbConfig,
    ZeroConfig,
)
from .unsupported import UNSUPPORTED_KEYS

__all__ = [
    "AUTO_ALIASES",
    "UNSUPPORTED_KEYS",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "Problem",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "config_error",
    "find_auto",
    "load_config",
    "resolve_auto",
    "resolve_batch_sizes",
    "validate_config",
]
