"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is partita's `Engine` (Accelerate checks
``isinstance(model, deepspeed.DeepSpeedEngine)`` to unwrap it)."""

from collections.abc import Callable, Iterable
from typing import Any

import torch

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.reshape_3d_utils import (
    checkpoint_parallel_metadata as _checkpoint_parallel_metadata,
)
from partita.engine import Engine as DeepSpeedEngine

# The types of DeepSpeed's ``initialize(optimizer=..., lr_scheduler=...)`` callables.
DeepSpeedOptimizerCallable = Callable[
    [Iterable[torch.nn.Parameter] | dict[str, Iterable[Any]]], torch.optim.Optimizer
]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

__getattr__ = module_getattr("deepspeed.runtime.engine")

__all__ = [
    "DeepSpeedEngine",
    "DeepSpeedOptimizerCallable",
    "DeepSpeedSchedulerCallable",
    "_checkpoint_parallel_metadata",
]
