"""DeepSpeed's ZeRO-3 parameter attributes (``ds_id``, ``ds_status``, ``ds_numel``,
``ds_shape``, ``ds_tensor``, ``ds_persist``) as read-only views of partita's own state.

Downstream code reads them to find and handle partitioned parameters: TRL gathers the LM head
when ``p.ds_status != ZeroParamStatus.AVAILABLE``, Transformers counts ``p.ds_numel``, PEFT
reads ``ds_shape``. partita's stage 3 keeps no such attributes (its units own the state,
`partita.zero.registry.zero3_view` reports it); this module puts properties on the class every
ZeRO-3 parameter has (`partita.zero.placeholder.ZeroParameter`), each answering from that view.
A parameter ZeRO-3 does not manage (any more) has none of them: the property raises
AttributeError, so ``hasattr(p, "ds_numel")`` is False, as for a parameter DeepSpeed never
partitioned.

Unlike DeepSpeed's, a parameter outside a gather keeps its shape and holds a zero-memory NaN
placeholder instead of an empty tensor (see [Note: sharded parameters]), so ``p.numel()`` equals
``p.ds_numel``; code that only takes the partitioned path on ``p.numel() == 0`` (PEFT's
``modules_to_save``) takes the ordinary one, which is correct here: copying such a parameter
copies what it stands for.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from partita.zero.placeholder import ZeroParameter
from partita.zero.registry import Presence, ZeroParamView, zero3_view


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's parameter states: ``ds_status`` of a ZeRO-3 parameter is one of these."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_STATUS = {
    Presence.PRESENT: ZeroParamStatus.AVAILABLE,
    Presence.ARRIVING: ZeroParamStatus.INFLIGHT,
    Presence.ABSENT: ZeroParamStatus.NOT_AVAILABLE,
}


def _view(param: torch.Tensor, name: str) -> ZeroParamView:
    view = zero3_view(param)
    if view is None:
        raise AttributeError(
            f"'{type(param).__name__}' object has no attribute '{name}': this parameter of shape "
            f"{tuple(param.shape)} is not partitioned by a live ZeRO-3 engine or zero.Init"
        )
    return view


def _attribute(name: str, read: Callable[[ZeroParamView], Any], doc: str) -> property:
    def getter(param: torch.Tensor) -> Any:
        return read(_view(param, name))

    getter.__name__ = name
    return property(getter, doc=doc)


ATTRIBUTES: dict[str, property] = {
    "ds_id": _attribute("ds_id", lambda v: v.ident, "Identifier, the same on every rank."),
    "ds_status": _attribute(
        "ds_status", lambda v: _STATUS[v.presence], "A `ZeroParamStatus`: gathered or not."
    ),
    "ds_numel": _attribute("ds_numel", lambda v: v.numel, "Elements of the full parameter."),
    "ds_shape": _attribute("ds_shape", lambda v: v.shape, "Shape of the full parameter."),
    "ds_tensor": _attribute(
        "ds_tensor",
        lambda v: v.local,
        "This rank's elements, flattened, in the module's dtype. Read it: writing it does not "
        "reach the fp32 master (use partita.utils.safe_set_local_fp32_param).",
    ),
    "ds_persist": _attribute(
        "ds_persist", lambda v: v.persistent, "Kept gathered between uses (small parameters)."
    ),
}


def install() -> None:
    """Puts the ``ds_*`` properties on `ZeroParameter` (idempotent; no setter: read-only)."""
    for name, prop in ATTRIBUTES.items():
        if name not in ZeroParameter.__dict__:
            setattr(ZeroParameter, name, prop)


install()

__all__ = ["ATTRIBUTES", "ZeroParamStatus", "install"]
