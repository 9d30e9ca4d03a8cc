"""Which dtype each piece of training state uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def dtype_from_name(name: str, key: str) -> torch.dtype:
    """torch dtype for a config string; `key` names the config key in the error."""
    try:
        return _DTYPE_NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"{key}={name!r} is not a dtype; use one of fp32, fp16, bf16") from None


@dataclass(frozen=True)
class PrecisionPolicy:
    """Module (compute) dtype, master-weight dtype and gradient-reduction dtype."""

    param_dtype: torch.dtype
    """dtype of the module's weights and gradients (what forward and backward compute in)."""
    reduce_dtype: torch.dtype
    """dtype gradients are communicated in."""
    master_dtype: torch.dtype = torch.float32
    """dtype of the optimizer's copy of the weights."""

    @property
    def needs_master(self) -> bool:
        """True when the optimizer steps a separate higher-precision copy of the weights."""
        return self.param_dtype != self.master_dtype

    @property
    def uses_loss_scaling(self) -> bool:
        """fp16 needs loss scaling; bf16 and fp32 do not."""
        return self.param_dtype == torch.float16

    @classmethod
    def from_flags(
        cls, fp16: bool, bf16: bool, communication_data_type: str | None
    ) -> PrecisionPolicy:
        """The policy for the config's fp16/bf16 switches and ``communication_data_type``."""
        if fp16 and bf16:
            raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")
        param = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
        reduce = (
            dtype_from_name(communication_data_type, "communication_data_type")
            if communication_data_type
            else param
        )
        return cls(param_dtype=param, reduce_dtype=reduce)
