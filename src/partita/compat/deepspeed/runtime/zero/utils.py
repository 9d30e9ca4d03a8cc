"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException``, the error DeepSpeed's ZeRO
optimizers raise on misuse. partita raises its own errors (ConfigError, ValueError,
RuntimeError naming the cause); the class exists for imports and ``except`` clauses."""

from partita.compat.deepspeed._missing import module_getattr


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO runtime error (partita does not raise it)."""


__getattr__ = module_getattr("deepspeed.runtime.zero.utils")

__all__ = ["ZeRORuntimeException"]
