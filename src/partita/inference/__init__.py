"""Tensor-parallel inference: `init_inference` splits a model across ranks.

`init_inference` (DeepSpeed's signature) plans how each weight splits (`plan`), slices the
model's own weights or reads only this rank's slices from a Hugging Face safetensors folder
(`load`), and returns an `InferenceEngine` whose forward and ``generate`` run the model's
modules on their slices with one all-reduce per row-parallel layer. ``partita generate`` is
the command line (`cli`).
"""

from __future__ import annotations

from partita.inference.config import InferenceConfig, load_inference_config
from partita.inference.engine import InferenceEngine, from_pretrained, init_inference
from partita.inference.load import LoadError
from partita.inference.plan import PlanError, RankSlice, ShardPlan, build_plan

__all__ = [
    "InferenceConfig",
    "InferenceEngine",
    "LoadError",
    "PlanError",
    "RankSlice",
    "ShardPlan",
    "build_plan",
    "from_pretrained",
    "init_inference",
    "load_inference_config",
]
