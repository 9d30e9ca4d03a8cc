"""``deepspeed.ops``: optimizer classes (``ops.adam``, ``ops.adagrad``, ``ops.lion``) and
``__compatible_ops__``, which reads False for every op name (partita builds no DeepSpeed op)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.ops import adagrad, adam, lion, op_builder


class _NoCompatibleOps(dict[str, bool]):
    """DeepSpeed's op name -> "can be built here" table: False for every name asked (each
    ``op_builder`` builder answers ``is_compatible()`` False)."""

    def __missing__(self, key: str) -> bool:
        return False


__compatible_ops__: dict[str, bool] = _NoCompatibleOps()

__getattr__ = module_getattr("deepspeed.ops")

__all__ = ["adagrad", "adam", "lion", "op_builder"]
