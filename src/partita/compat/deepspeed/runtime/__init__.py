"""``deepspeed.runtime``: the engine, the config, learning-rate schedules and ZeRO modules."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.runtime import bf16_optimizer, config, engine, lr_schedules, zero

__getattr__ = module_getattr("deepspeed.runtime")

__all__ = ["bf16_optimizer", "config", "engine", "lr_schedules", "zero"]
