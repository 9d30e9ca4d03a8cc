"""Precision policy and loss scaling (pure tensor math)."""

from partita.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    StaticLossScaler,
)
from partita.precision.policy import PrecisionPolicy, dtype_from_name, full_dtype

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimumError",
    "LossScaler",
    "PrecisionPolicy",
    "StaticLossScaler",
    "dtype_from_name",
    "full_dtype",
]
