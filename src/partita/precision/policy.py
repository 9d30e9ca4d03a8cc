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


def full_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a full-precision view of `tensor` takes: fp32 for 16-bit and fp32 values,
    float64 for float64 ones (so accessors and checkpoints never narrow a float64 run)."""
    return torch.promote_types(tensor.dtype, torch.float32)


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

    def for_module(self, module: torch.nn.Module) -> PrecisionPolicy:
        """This policy, kept in float64 when neither 16-bit mode is on and every floating
        parameter of `module` is float64.

        DeepSpeed casts a module only for fp16/bf16 and otherwise trains it in its own dtype;
        partita does the same for float64 (weights, gradients, reductions and optimizer state
        all in float64), which also gives the parity tests a run whose rounding is far below
        Adam's epsilon. Any other full-precision module trains in fp32.
        """
        if self.param_dtype != torch.float32 or self.reduce_dtype != torch.float32:
            return self
        floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
        if not floats or any(d != torch.float64 for d in floats):
            return self
        return PrecisionPolicy(torch.float64, torch.float64, torch.float64)
