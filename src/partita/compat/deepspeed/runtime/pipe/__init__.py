"""``deepspeed.runtime.pipe``: `ProcessTopology` (real, `partita.parallel.topology`) and the
pipeline-module classes as placeholders (partita does not implement pipeline parallelism; see
`partita.compat.deepspeed.runtime.pipe.module`). Its ``topology`` and ``schedule`` modules are
real; the others (engine, p2p, ...) resolve to stubs whose names raise naming the feature."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from partita.parallel.topology import ProcessTopology

__getattr__ = module_getattr("deepspeed.runtime.pipe")

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
