"""``deepspeed.pipe``: DeepSpeed's pipeline classes, as placeholders that raise when
constructed (partita does not implement pipeline parallelism)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.runtime.pipe.module import (
    FEATURE,
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
)


class DualPipeVModule(PipelineModule):
    """Placeholder for DeepSpeed's DualPipeV pipeline module; raises when constructed."""

    _deepspeed_name = "deepspeed.pipe.DualPipeVModule"
    _feature = FEATURE


__getattr__ = module_getattr("deepspeed.pipe")

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "TiedLayerSpec"]
