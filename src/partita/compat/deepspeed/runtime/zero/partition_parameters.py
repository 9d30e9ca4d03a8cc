"""``deepspeed.runtime.zero.partition_parameters``: the names Transformers patches around every
ZeRO-3 ``from_pretrained`` (``prevent_arange_dtype_change``).

DeepSpeed's ``zero.Init`` wraps tensor constructors to create tensors in the config's dtype and
on the device; Transformers swaps `zero_wrapper_for_fp_tensor_constructor` to keep
``torch.arange`` out of that. partita's `zero.Init` does not wrap constructors (it converts a
module's parameters when the module is built), so these exist for the patch to apply to.

Also ``MultipleAllGatherHandles`` (real), ``CUDAQuantizer`` (an adapter over partita's block
quantizer) and ``partitioned_param_data_shape`` as a placeholder that raises on use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, overload

import torch

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import (
    FeatureNotInPartita,
    not_in_partita,
)
from partita.compat.deepspeed.accelerator import get_accelerator
from partita.compat.deepspeed.runtime.zero import GatheredParameters, Init, ZeroParamStatus
from partita.precision.quantize import dequantize_blocks, quantize_blocks

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


class _BlockQuantizerOp:
    """partita's block quantizer (`partita.precision.quantize`) behind the interface of the
    compiled op DeepSpeed's `CUDAQuantizer` calls: ``quantize(param, groups, num_bits,
    quant_type)`` and ``dequantize(values, scales, groups, num_bits, quant_type)``."""

    Symmetric = 0
    Asymmetric = 1
    reads_any_dtype = True
    """Quantizes any float dtype itself (DeepSpeed's kernel reads fp16 only)."""

    def quantize(
        self, param: torch.Tensor, groups: int, num_bits: int, quant_type: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values as (groups, numel / groups), fp32 scales as (groups, 1))."""
        _check_symmetric_int8(num_bits, quant_type, self.Symmetric)
        if groups < 1 or param.numel() % groups:
            raise ValueError(
                f"CUDAQuantizer: {groups} groups do not divide the tensor's {param.numel()} "
                "elements into equal blocks"
            )
        values, scales = quantize_blocks(param, param.numel() // groups)
        return values.view(groups, -1), scales.view(groups, 1)

    def dequantize(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        groups: int,
        num_bits: int,
        quant_type: int,
    ) -> torch.Tensor:
        """The values in fp32, in the shape of `values`."""
        _check_symmetric_int8(num_bits, quant_type, self.Symmetric)
        return dequantize_blocks(values.reshape(-1), scales.reshape(-1)).view(values.shape)


def _check_symmetric_int8(num_bits: int, quant_type: int, symmetric: int) -> None:
    if num_bits != 8 or quant_type != symmetric:
        raise ValueError(
            f"CUDAQuantizer: partita quantizes symmetric int8 only (got {num_bits} bits, "
            f"quant_type {quant_type})"
        )


class CUDAQuantizer:
    """DeepSpeed's ZeRO++ weight quantizer as a thin adapter over partita's block quantizer:
    ``quantize(param, groups=None)`` gives (int8 values, one fp32 scale per group) and
    ``dequantize(values, scale, dtype=None)`` the values back (fp16 unless `dtype` is given,
    as DeepSpeed's kernel returns). Without `groups`, the fewest equal groups of at most
    `target_group_size` elements. Another op set on ``quantizer_cuda_module`` (DeepSpeed's
    compiled kernel, or a test's stand-in) is handed fp16 input, its contract."""

    async_flag = True
    target_group_size = 8000
    group_size_cache: ClassVar[dict[int, int]] = {}
    quantizer_cuda_module: Any = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = _BlockQuantizerOp()

    def quantize(
        self, param: torch.Tensor, groups: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`param` as int8 values and per-group scales."""
        if groups is None:
            groups = self._groups(param.numel())
        op = self.quantizer_cuda_module
        if not getattr(op, "reads_any_dtype", False):
            param = param.to(torch.half)
        return op.quantize(param, groups, 8, op.Symmetric)

    def dequantize(
        self, quantized_param: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The values `quantize` encoded, in `dtype` (fp16 when None)."""
        op = self.quantizer_cuda_module
        out = op.dequantize(quantized_param, scale, scale.numel(), 8, op.Symmetric)
        want = dtype or torch.half
        return out if out.dtype == want else out.to(want)

    def _groups(self, numel: int) -> int:
        """The fewest groups of equal size, each at most `target_group_size` elements."""
        cached = self.group_size_cache.get(numel)
        if cached is not None:
            return cached
        groups = max(1, -(-numel // self.target_group_size))
        while numel % groups:
            groups += 1
        self.group_size_cache[numel] = groups
        return groups


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
