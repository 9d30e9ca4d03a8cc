"""What a sharded parameter holds while its full value is elsewhere, and the error a use of it
raises.

[Note: sharded parameters]
While a ZeRO-3 unit is sharded, each of its parameters holds a zero-memory NaN tensor of the
right shape (`nan_placeholder`) and its class is switched to `ShardedParameter`, whose
``__torch_function__`` lets metadata through (shape, dtype, device, ``requires_grad``, hashing,
hooks, ``.data``/``.grad`` assignment) and turns every other use — arithmetic, ``.sum()``,
``.cpu()``, the values of ``state_dict()`` — into a `ShardedParameterError` naming the unit and
telling how to read it. ``detach()`` (what ``state_dict()`` calls) returns a tensor guarded the
same way, so listing a sharded module's state-dict keys works (PEFT's adapter save does, taking
the values from the engine's gathered state dict) while reading its values still raises. The
class goes back to `ZeroParameter` when the unit is gathered: a plain `nn.Parameter` subclass
without a ``__torch_function__`` of its own, so compute on gathered parameters pays nothing. Every parameter ZeRO-3 manages (built under ``zero.Init``, or held by a
stage-3 unit) is a `ZeroParameter` (or `ShardedParameter`), which is where the DeepSpeed
compatibility layer hangs its read-only ``ds_*`` views; the algorithm never reads them. Each is
given an identifier when it first becomes managed (`zero_param_id`), in build order, so the same
on every rank. Only plain `nn.Parameter`s are switched (a library's own Parameter subclass keeps
its class and reads NaN).

A deep copy of a managed parameter (PEFT's ``modules_to_save`` copies a module) copies what it
stands for, never its placeholder: see `ZeroParameter.__deepcopy__`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
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
        "is_pinned", "__class__", "type", "detach",
    }
)  # fmt: skip

_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Sharded parameter -> the name of the unit that holds its shards."""


_IDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Managed parameter -> its identifier (`zero_param_id`)."""
_next_id = itertools.count()

COPY_PRE_SHARDED: list[Callable[[torch.Tensor], torch.Tensor | None]] = []
"""Set by `partita.zero.init`: copies a parameter built under ``zero.Init`` (its chunk, no
collective), or returns None for one it does not hold."""


def zero_param_id(param: torch.Tensor) -> int | None:
    """The identifier ZeRO-3 gave `param` when it first managed it, or None."""
    return _IDS.get(param)


def _enrol(param: torch.Tensor) -> None:
    if type(param) is torch.nn.Parameter:
        param.__class__ = ZeroParameter
    if param not in _IDS:
        _IDS[param] = next(_next_id)


class ZeroParameter(torch.nn.Parameter):
    """A parameter ZeRO-3 manages, while its values are present (gathered, persistent,
    materialized under ``zero.Init``) or while ``zero.Init`` holds its chunk. Computes as
    `nn.Parameter` does (see [Note: sharded parameters])."""

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.nn.Parameter:
        """A copy that stands for the same values: a parameter ``zero.Init`` holds as a chunk
        copies its chunk (the copy is managed the same way, no collective); one a stage-3 unit
        holds sharded refuses (the values are not on this rank); present values are copied
        into a plain `nn.Parameter`."""
        if id(self) in memo:
            return memo[id(self)]
        result: torch.nn.Parameter | None = None
        for copier in COPY_PRE_SHARDED:
            copied = copier(self)
            if copied is not None:
                result = copied  # type: ignore[assignment]
        if result is None:
            if type(self) is ShardedParameter:
                raise ShardedParameterError(
                    f"deepcopy of a parameter of shape {tuple(self.shape)} that ZeRO stage 3 "
                    f"holds sharded (unit '{_OWNER.get(self, '?')}'): copy it inside "
                    "`with partita.zero.GatheredParameters([param]):`"
                )
            with torch._C.DisableTorchFunctionSubclass():
                value = self.data.clone(memory_format=torch.preserve_format)
            result = torch.nn.Parameter(value, self.requires_grad)
        memo[id(self)] = result
        return result


class ShardedParameter(ZeroParameter):
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
            out = func(*args, **(kwargs or {}))
            if name == "detach":  # still guarded: see [Note: sharded parameters]
                guarded = out.as_subclass(ShardedParameter)
                _OWNER[guarded] = _OWNER.get(args[0], "?")
                return guarded
            return out


def mark_managed(param: torch.Tensor) -> None:
    """Makes a plain parameter a `ZeroParameter` with an identifier (``zero.Init`` built it)."""
    _enrol(param)


def mark_sharded(param: torch.Tensor, unit: str) -> None:
    """Gives `param` its NaN placeholder and, for plain parameters, the sharded class."""
    # Only plain nn.Parameters switch class: [Note: sharded parameters].
    param.data = nan_placeholder(param)
    _enrol(param)
    if type(param) is ZeroParameter:
        _OWNER[param] = unit
        param.__class__ = ShardedParameter


def mark_gathered(param: torch.Tensor, value: torch.Tensor) -> None:
    """Points `param` at its gathered `value` and gives it the managed class that computes as
    `nn.Parameter` does."""
    _enrol(param)
    if type(param) is ShardedParameter:  # gathered compute pays nothing: see the Note
        param.__class__ = ZeroParameter  # type: ignore[assignment]
    param.data = value
