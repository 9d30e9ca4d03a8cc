"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is partita's `Engine` (Accelerate checks
``isinstance(model, deepspeed.DeepSpeedEngine)`` to unwrap it)."""

from partita.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
