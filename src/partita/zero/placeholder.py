"""What a sharded parameter holds while its full value is elsewhere, and the error a use of it
raises.

[Note: sharded parameters]
While a ZeRO-3 unit is sharded, each of its parameters holds a zero-memory NaN tensor of the
right shape (`nan_placeholder`) and its class is switched to `ShardedParameter`, whose
``__torch_function__`` lets metadata through (shape, dtype, device, ``requires_grad``, hashing,
hooks, ``.data``/``.grad`` assignment) and turns every other use — arithmetic, ``.sum()``,
``.cpu()``, ``state_dict()`` values — into a `ShardedParameterError` naming the unit and telling
how to read it. The class goes back to `nn.Parameter` when the unit is gathered, so compute on
gathered parameters pays nothing. Only plain `nn.Parameter`s are switched (a library's own
Parameter subclass keeps its class and reads NaN).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary


def nan_placeholder(
    param: torch.Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """A zero-memory tensor of `param`'s shape whose every element is NaN: reads outside a
    gather give NaN instead of plausible numbers, and in-place writes fail (every element
    aliases one memory location)."""
    value = torch.full((), float("nan"), dtype=dtype or param.dtype, device=device or param.device)
    return value.expand(param.shape)


class ShardedParameterError(RuntimeError):
    """A ZeRO-3 sharded parameter was used outside a gather."""


_METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "requires_grad_", "data", "grad", "is_leaf",
        "grad_fn", "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
        "names", "_base", "size", "numel", "dim", "element_size", "is_floating_point",
        "is_complex", "data_ptr", "untyped_storage", "register_hook",
        "register_post_accumulate_grad_hook", "__hash__", "__repr__", "__format__",
        "__reduce_ex__", "__deepcopy__", "__setstate__", "_version", "nbytes", "itemsize",
        "is_contiguous", "stride", "storage_offset", "get_device", "_is_view", "is_shared",
        "is_pinned", "__class__", "type",
    }
)  # fmt: skip

_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Sharded parameter -> the name of the unit that holds its shards."""


class ShardedParameter(torch.nn.Parameter):
    """The class of a parameter while ZeRO-3 holds it sharded (see [Note: sharded
    parameters])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__delete__"):  # a property: use its own name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA:
            param = next((a for a in args if isinstance(a, ShardedParameter)), None)
            shape = tuple(param.shape) if param is not None else "?"
            unit = _OWNER.get(param, "?") if param is not None else "?"
            raise ShardedParameterError(
                f"{name}() on a parameter of shape {shape} that ZeRO stage 3 holds sharded "
                f"(unit '{unit}'): its values are not on this rank outside a gather; read or "
                "modify it inside `with partita.zero.GatheredParameters([param]):` "
                "(modifier_rank=0 to write), or use partita.utils.safe_get_full_fp32_param"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def mark_sharded(param: torch.Tensor, unit: str) -> None:
    """Gives `param` its NaN placeholder and, for plain parameters, the sharded class."""
    # Only plain nn.Parameters switch class: [Note: sharded parameters].
    param.data = nan_placeholder(param)
    if type(param) is torch.nn.Parameter:
        _OWNER[param] = unit
        param.__class__ = ShardedParameter


def mark_gathered(param: torch.Tensor, value: torch.Tensor) -> None:
    """Points `param` at its gathered `value` and gives it back its plain class."""
    if type(param) is ShardedParameter:  # gathered compute pays nothing: see the Note
        param.__class__ = torch.nn.Parameter  # type: ignore[assignment]
    param.data = value
