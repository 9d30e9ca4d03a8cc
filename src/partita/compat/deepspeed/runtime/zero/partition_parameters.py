"""``deepspeed.runtime.zero.partition_parameters``: the names Transformers patches around every
ZeRO-3 ``from_pretrained`` (``prevent_arange_dtype_change``).

DeepSpeed's ``zero.Init`` wraps tensor constructors to create tensors in the config's dtype and
on the device; Transformers swaps `zero_wrapper_for_fp_tensor_constructor` to keep
``torch.arange`` out of that. partita's `zero.Init` does not wrap constructors (it converts a
module's parameters when the module is built), so these exist for the patch to apply to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.accelerator import get_accelerator
from partita.compat.deepspeed.runtime.zero import GatheredParameters, Init, ZeroParamStatus

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., torch.Tensor]:
    """Returns `fn` creating floating tensors in `target_fp_dtype` on `target_device`."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


__getattr__ = module_getattr("deepspeed.runtime.zero.partition_parameters")

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "get_accelerator",
    "zero_wrapper_for_fp_tensor_constructor",
]
