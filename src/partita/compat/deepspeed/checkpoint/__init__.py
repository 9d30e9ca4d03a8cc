"""``deepspeed.checkpoint``: checkpoint helpers (``checkpoint.utils``)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint import utils

__getattr__ = module_getattr("deepspeed.checkpoint")

__all__ = ["utils"]
