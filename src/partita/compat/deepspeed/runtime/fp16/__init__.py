"""``deepspeed.runtime.fp16``: partita scales the fp16 loss inside its engine (the ``fp16``
config section); DeepSpeed's optimizer wrappers are placeholders that raise when constructed
(`unfused_optimizer`), and the package's other modules resolve to stubs."""

from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.runtime.fp16")
