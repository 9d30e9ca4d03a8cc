"""``deepspeed.moe``: partita does not implement DeepSpeed-MoE expert parallelism. ``layer``
holds ``MoE`` as a placeholder that raises when constructed; the other modules resolve to
stubs whose names raise naming the feature."""

from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.moe")
