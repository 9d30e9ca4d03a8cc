"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer`` as a placeholder.

DeepSpeed wraps the optimizer of an fp16 run without ZeRO in this class; partita's engine
applies loss scaling itself, so ``engine.optimizer`` is never one. The class exists for imports
and ``isinstance`` checks (always false); constructing it raises naming the feature.
"""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import NotInPartitaPlaceholder


class FP16_UnfusedOptimizer(NotInPartitaPlaceholder):
    """Placeholder for DeepSpeed's fp16 optimizer wrapper; raises when constructed."""

    _deepspeed_name = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"
    _feature = (
        "DeepSpeed's fp16 optimizer wrapper (partita's engine scales the loss itself: "
        'use the "fp16" config section)'
    )


__getattr__ = module_getattr("deepspeed.runtime.fp16.unfused_optimizer")

__all__ = ["FP16_UnfusedOptimizer"]
