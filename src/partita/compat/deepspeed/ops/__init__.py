"""``deepspeed.ops``: optimizer classes (``ops.adam``, ``ops.adagrad``, ``ops.lion``)."""

from partita.compat.deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
