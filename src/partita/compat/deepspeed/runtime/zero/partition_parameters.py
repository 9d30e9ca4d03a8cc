"""``deepspeed.runtime.zero.partition_parameters``: the names Transformers patches around every
ZeRO-3 ``from_pretrained`` (``prevent_arange_dtype_change``).

DeepSpeed's ``zero.Init`` wraps tensor constructors to create tensors in the config's dtype and
on the device; Transformers swaps `zero_wrapper_for_fp_tensor_constructor` to keep
``torch.arange`` out of that. partita's `zero.Init` does not wrap constructors (it converts a
module's parameters when the module is built), so these exist for the patch to apply to.

Also ``MultipleAllGatherHandles`` (real), and ``CUDAQuantizer`` and
``partitioned_param_data_shape`` as placeholders that raise on use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import (
    FeatureNotInPartita,
    NotInPartitaPlaceholder,
    not_in_partita,
)
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


class MultipleAllGatherHandles:
    """Several all-gather handles waited on as one (DeepSpeed's coalesced-fetch handle)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        """Waits on each handle in order, passing `handle_dependency` by keyword."""
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


class CUDAQuantizer(NotInPartitaPlaceholder):
    """Placeholder for DeepSpeed's ZeRO++ weight quantizer (``zero_quantized_weights``);
    raises when constructed."""

    async_flag = True
    target_group_size = 8000
    quantizer_cuda_module: Any = None

    _deepspeed_name = "deepspeed.runtime.zero.partition_parameters.CUDAQuantizer"
    _feature = "ZeRO++ quantized weights (zero_quantized_weights)"


class _NoFixedPartitionedShape(Sequence[int]):
    """DeepSpeed's ``partitioned_param_data_shape`` ([0]: its partitioned parameters' ``data``
    is emptied). partita's keep their full shape outside a gather, so there is no such shape:
    reading it raises, naming the difference."""

    def _refuse(self) -> FeatureNotInPartita:
        return not_in_partita(
            "deepspeed.runtime.zero.partition_parameters.partitioned_param_data_shape",
            "an emptied .data on partitioned parameters (partita's ZeRO-3 parameters keep "
            "their full shape outside a gather; test ds_status or ds_tensor instead)",
        )

    def __len__(self) -> int:
        raise self._refuse()

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        raise self._refuse()

    def __iter__(self) -> Iterator[int]:
        raise self._refuse()

    def __repr__(self) -> str:
        return "<partitioned_param_data_shape: none in partita (full shapes are kept)>"


partitioned_param_data_shape: Sequence[int] = _NoFixedPartitionedShape()

__getattr__ = module_getattr("deepspeed.runtime.zero.partition_parameters")

__all__ = [
    "CUDAQuantizer",
    "GatheredParameters",
    "Init",
    "MultipleAllGatherHandles",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "get_accelerator",
    "partitioned_param_data_shape",
    "zero_wrapper_for_fp_tensor_constructor",
]
