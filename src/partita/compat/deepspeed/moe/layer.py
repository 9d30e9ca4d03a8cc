"""``deepspeed.moe.layer``: DeepSpeed's ``MoE`` layer as a placeholder (an ``nn.Module``
subclass that raises when constructed; partita does not implement expert parallelism)."""

from __future__ import annotations

from torch import nn

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import NotInPartitaPlaceholder


class MoE(NotInPartitaPlaceholder, nn.Module):
    """Placeholder for DeepSpeed's mixture-of-experts layer; raises when constructed."""

    _deepspeed_name = "deepspeed.moe.layer.MoE"
    _feature = "DeepSpeed-MoE expert parallelism"


__getattr__ = module_getattr("deepspeed.moe.layer")

__all__ = ["MoE"]
