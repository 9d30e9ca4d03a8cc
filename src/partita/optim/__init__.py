"""Optimizers and learning-rate schedules from the ``optimizer`` / ``scheduler`` config sections.

``build_optimizer`` maps a DeepSpeed optimizer name and params onto ``torch.optim`` with
DeepSpeed's semantics (``Adam`` is AdamW unless ``adam_w_mode`` is false; fused kernels where
the device has them). ``build_scheduler`` builds DeepSpeed's schedules (re-implemented here
with identical numbers) or any ``torch.optim.lr_scheduler`` class.
"""

from __future__ import annotations

from partita.optim.cpu_adam import CPUAdam, CPUAdamW, torch_class_name
from partita.optim.errors import OptimConfigError, OptimizerConfigError, SchedulerConfigError
from partita.optim.optimizers import build_optimizer, fused_supported
from partita.optim.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "CPUAdam",
    "CPUAdamW",
    "LRRangeTest",
    "OneCycle",
    "OptimConfigError",
    "OptimizerConfigError",
    "SchedulerConfigError",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
    "fused_supported",
    "torch_class_name",
]
