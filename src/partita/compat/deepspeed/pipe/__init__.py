"""``deepspeed.pipe``: DeepSpeed's pipeline classes. `PipelineModule`, `LayerSpec` and
`TiedLayerSpec` are partita's own (`partita.parallel.pipe_module`); ``DualPipeVModule`` is a
placeholder that raises when constructed (the DualPipeV schedule is not implemented)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import NotInPartitaPlaceholder
from partita.parallel.pipe_module import LayerSpec, PipelineModule, TiedLayerSpec

FEATURE = "the DualPipeV pipeline schedule"


class DualPipeVModule(NotInPartitaPlaceholder, PipelineModule):
    """Placeholder for DeepSpeed's DualPipeV pipeline module; raises when constructed."""

    _deepspeed_name = "deepspeed.pipe.DualPipeVModule"
    _feature = FEATURE


__getattr__ = module_getattr("deepspeed.pipe")

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "TiedLayerSpec"]
