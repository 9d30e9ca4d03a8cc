"""``deepspeed.runtime``: the engine, learning-rate schedules and ZeRO modules."""

from partita.compat.deepspeed.runtime import engine, lr_schedules, zero

__all__ = ["engine", "lr_schedules", "zero"]
