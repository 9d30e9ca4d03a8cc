"""Mixed precision sections: ``fp16``, ``bf16`` and ``data_types``; defaults as in DeepSpeed."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from .base import Bool, NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Section

__all__ = ["BF16Config", "DTypeName", "DataTypesConfig", "FP16Config"]

# DeepSpeed's DtypeEnum accepts these spellings; partita keeps only the short canonical one.
_DTYPE_SPELLINGS = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def _canonical_dtype(value: Any) -> Any:
    if isinstance(value, str):
        return _DTYPE_SPELLINGS.get(value.lower(), value)
    return value


DTypeName = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_canonical_dtype)]
"""A floating point type by name; ``"float32"``, ``"half"``, ``"bfloat16"`` etc. are accepted."""


class FP16Config(Section):
    """``fp16``: float16 mixed precision with loss scaling."""

    enabled: Bool = Field(default=False, description="Train with float16 mixed precision.")
    auto_cast: Bool = Field(
        default=False, description="Cast floating point inputs of the model's forward to float16."
    )
    loss_scale: NonNegFloat = Field(
        default=0.0, description="Static loss scale; 0 selects dynamic loss scaling."
    )
    initial_scale_power: NonNegInt = Field(
        default=16, description="Dynamic loss scaling starts at 2**initial_scale_power."
    )
    loss_scale_window: PositiveInt = Field(
        default=1000, description="Steps without overflow before the dynamic loss scale is raised."
    )
    hysteresis: PositiveInt = Field(
        default=2, description="Overflows tolerated before the dynamic loss scale is lowered."
    )
    consecutive_hysteresis: Bool = Field(
        default=False, description="Refill the hysteresis count after every step without overflow."
    )
    min_loss_scale: PositiveFloat = Field(
        default=1.0, description="Lower bound of the dynamic loss scale."
    )
    fp16_master_weights_and_grads: Bool = Field(
        default=False,
        description="Keep the optimizer's master weights and gradients in float16 instead of "
        "float32 (ZeRO stages 1-3 only).",
    )


class BF16Config(Section):
    """``bf16`` (older spelling ``bfloat16``): bfloat16 mixed precision; no loss scaling."""

    enabled: Bool = Field(default=False, description="Train with bfloat16 mixed precision.")
    immediate_grad_update: Bool = Field(
        default=False,
        description="Accumulate each micro-batch's gradients into the master gradients right "
        "away instead of at the accumulation boundary.",
    )
    check_grad_overflow: Bool = Field(
        default=True,
        description="Check gradients for inf/NaN before the optimizer step and skip the step "
        "when found.",
    )
    bf16_master_weights_and_grads: Bool = Field(
        default=False,
        description="Keep master weights and gradients in bfloat16 (ZeRO stages 1-3 only).",
    )
    bf16_optimizer_states: Bool = Field(
        default=False,
        description="Keep optimizer states in bfloat16; needs bf16_master_weights_and_grads.",
    )


class DataTypesConfig(Section):
    """``data_types``: dtypes of buffers that otherwise follow the training precision."""

    grad_accum_dtype: DTypeName | None = Field(
        default=None,
        description="Dtype gradients are accumulated in across micro-batches; None follows "
        "the training precision.",
    )
    param_dtype: DTypeName | None = Field(
        default=None,
        description="Dtype model parameters are cast to; None keeps the training precision.",
    )
    buffer_dtype: DTypeName | None = Field(
        default=None, description="Dtype module buffers are cast to; None keeps their loaded dtype."
    )
