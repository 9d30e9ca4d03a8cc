"""Precision policy, loss scaling and gradient checks (pure tensor math)."""

from partita.precision.grads import GradStats, grad_stats, scale_grads_
from partita.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    StaticLossScaler,
)
from partita.precision.policy import PrecisionPolicy, dtype_from_name, full_dtype

__all__ = [
    "DynamicLossScaler",
    "GradStats",
    "LossScaleAtMinimumError",
    "LossScaler",
    "PrecisionPolicy",
    "StaticLossScaler",
    "dtype_from_name",
    "full_dtype",
    "grad_stats",
    "scale_grads_",
]
