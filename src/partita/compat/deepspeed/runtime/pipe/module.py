"""``deepspeed.runtime.pipe.module``: DeepSpeed's pipeline-module classes as placeholders.

partita does not implement pipeline parallelism. The classes exist so a module that imports
them (DeepSpeed's test helpers, a model file with a pipeline variant) loads; constructing one
raises `FeatureNotInPartita` naming it.
"""

from __future__ import annotations

from torch import nn

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed._placeholder import NotInPartitaPlaceholder

FEATURE = "pipeline parallelism"


class PipelineError(Exception):
    """DeepSpeed's error for a malformed pipeline (never raised by partita)."""


class LayerSpec(NotInPartitaPlaceholder):
    """Placeholder for DeepSpeed's lazily built pipeline layer; raises when constructed."""

    _deepspeed_name = "deepspeed.pipe.LayerSpec"
    _feature = FEATURE


class TiedLayerSpec(LayerSpec):
    """Placeholder for DeepSpeed's tied (shared-weight) pipeline layer; raises when
    constructed."""

    _deepspeed_name = "deepspeed.pipe.TiedLayerSpec"


class PipelineModule(NotInPartitaPlaceholder, nn.Module):
    """Placeholder for DeepSpeed's pipeline-parallel module (an ``nn.Module`` subclass, so
    ``isinstance`` checks work); raises when constructed."""

    _deepspeed_name = "deepspeed.pipe.PipelineModule"
    _feature = FEATURE


__getattr__ = module_getattr("deepspeed.runtime.pipe.module")

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
