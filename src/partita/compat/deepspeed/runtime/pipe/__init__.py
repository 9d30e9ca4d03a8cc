"""``deepspeed.runtime.pipe``: the pipeline classes as placeholders (partita does not implement
pipeline parallelism; see `partita.compat.deepspeed.runtime.pipe.module`). Its other modules
(engine, schedule, topology, ...) resolve to stubs whose names raise naming the feature."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__getattr__ = module_getattr("deepspeed.runtime.pipe")

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
