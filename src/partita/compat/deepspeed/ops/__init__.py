"""``deepspeed.ops``: optimizer classes (``ops.adam``, ``ops.adagrad``, ``ops.lion``)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.ops import adagrad, adam, lion, op_builder

__getattr__ = module_getattr("deepspeed.ops")

__all__ = ["adagrad", "adam", "lion", "op_builder"]
