"""``deepspeed.runtime.pipe``: `PipelineModule`, `LayerSpec`, `TiedLayerSpec`
(`partita.parallel.pipe_module`) and `ProcessTopology` (`partita.parallel.topology`). Its
``module``, ``engine``, ``topology`` and ``schedule`` modules are real; the others (p2p,
dualpipev, ...) resolve to stubs whose names raise naming the feature."""

from partita.compat.deepspeed._missing import module_getattr
from partita.parallel.pipe_module import LayerSpec, PipelineModule, TiedLayerSpec
from partita.parallel.topology import ProcessTopology

__getattr__ = module_getattr("deepspeed.runtime.pipe")

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
