"""``deepspeed.runtime.pipe.module``: DeepSpeed's pipeline-module classes, partita's own
(`partita.parallel.pipe_module`)."""

from __future__ import annotations

from partita.compat.deepspeed._missing import module_getattr
from partita.parallel.pipe_module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

FEATURE = "pipeline parallelism"

__getattr__ = module_getattr("deepspeed.runtime.pipe.module")

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
