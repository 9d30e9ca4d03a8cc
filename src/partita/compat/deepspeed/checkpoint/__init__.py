"""``deepspeed.checkpoint``: checkpoint helpers (``checkpoint.utils``)."""

from partita.compat.deepspeed.checkpoint import utils

__all__ = ["utils"]
