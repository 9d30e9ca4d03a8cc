"""One pydantic model per section of a DeepSpeed config."""

from __future__ import annotations

from .base import Section
from .monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from .optim import OptimizerConfig, SchedulerConfig
from .precision import BF16Config, DataTypesConfig, FP16Config
from .profiling import CommsLoggerConfig, FlopsProfilerConfig
from .runtime import ActivationCheckpointingConfig, AioConfig, CheckpointConfig, ParallelWriteConfig
from .zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "SchedulerConfig",
    "Section",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
]
