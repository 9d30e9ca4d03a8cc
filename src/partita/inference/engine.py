"""`init_inference` and the engine it returns: a tensor-parallel model that runs and generates.

The engine adds no algorithm of its own: the model's modules run unchanged on their slices,
with the all-reduces of [Note: tensor-parallel plan] as forward hooks; ``generate`` is
Hugging Face's, with its KV cache (each rank caches its own heads). Every rank of a
tensor-parallel group must make the same calls with the same inputs, as with DeepSpeed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from partita.comm import ParallelDims, init_distributed
from partita.comm.process_group import get_rank, get_world_size, is_initialized
from partita.inference.config import InferenceConfig, TensorParallelConfig, load_inference_config
from partita.inference.load import build_skeleton, load_slices
from partita.inference.plan import ShardPlan, build_plan
from partita.inference.shard import install_plan, shard_module
from partita.platform.host_cache import install_host_cache

__all__ = ["InferenceEngine", "from_pretrained", "init_inference"]


class InferenceEngine(nn.Module):
    """A model split tensor-parallel over `dims.tp_group` (DeepSpeed's ``InferenceEngine``)."""

    def __init__(
        self, module: nn.Module, config: InferenceConfig, dims: ParallelDims, plan: ShardPlan
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.dims = dims
        self.plan = plan

    @property
    def all_reduces_per_forward(self) -> int:
        """Tensor-parallel all-reduces one forward pass issues (one per row-parallel module,
        one more for a vocabulary-parallel embedding)."""
        return len(self.plan.reduce) + ("embedding" in self.plan.vocab.values())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, without autograd."""
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate`` (Hugging Face models), run identically on every rank."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"{type(self.module).__name__} has no generate()")
        with torch.no_grad():
            return generate(*args, **kwargs)


def _check_world(tp: TensorParallelConfig) -> None:
    if tp.tp_size > 1 and not is_initialized():
        init_distributed()  # DeepSpeed's init_inference also creates the process group
    world = get_world_size()
    if tp.tp_group is None and world % tp.tp_size:
        raise ValueError(
            f"init_inference: tensor_parallel.tp_size={tp.tp_size} does not divide the "
            f"world size {world}"
        )


def _dims(tp: TensorParallelConfig) -> ParallelDims:
    if tp.tp_group is None:
        return ParallelDims.tensor_parallel(tp.tp_size)
    import torch.distributed as dist  # only to read the ranks of a group the user made

    ranks = tuple(dist.get_process_group_ranks(tp.tp_group))
    if len(ranks) != tp.tp_size or get_rank() not in ranks:
        raise ValueError(
            f"init_inference: rank {get_rank()}: tensor_parallel.tp_group has ranks "
            f"{list(ranks)}; expected {tp.tp_size} ranks including this one"
        )
    # Replicas of a user's group are the user's business: data-parallel fields say the world.
    return dataclasses.replace(ParallelDims.world(), tp_group=tp.tp_group, tp_ranks=ranks)


def _has_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def init_inference(
    model: nn.Module, config: str | Mapping[str, Any] | None = None, **kwargs: Any
) -> InferenceEngine:
    """Splits `model` tensor-parallel and returns the engine (DeepSpeed's signature).

    `config` (a dict or JSON path) and the keyword arguments take DeepSpeed's inference keys:
    ``tensor_parallel={"tp_size": N}``, ``dtype``, ``checkpoint`` (a Hugging Face safetensors
    folder each rank reads only its slices from; the model may then be on the meta device),
    ``injection_policy`` (an explicit plan). Unknown keys and unsupported features raise
    `partita.config.ConfigError`; a layer that cannot be split raises `PlanError` naming it;
    both before any collective.
    """
    cfg = load_inference_config(config, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference: model must be a torch.nn.Module, got {type(model)}")
    if _has_meta(model) and cfg.checkpoint is None:
        raise ValueError(
            "init_inference: the model has parameters on the meta device; pass "
            "checkpoint=<Hugging Face safetensors folder> to load them"
        )
    # Every forward allocates the same activations (a prefill also its logits and, with a
    # split head, their gathered copy). glibc maps the large ones afresh each time, to be
    # page-faulted and zeroed again (Llama 134M, TP 2, 128-token prefill: 10-12k faults and
    # 300-400 ms of CPU per rank); partita's host cache serves them again from kept blocks
    # (under 2k faults after the first prefill, 250-280 ms), as for training.
    # PARTITA_HOST_CACHE=0 keeps glibc's allocator.
    install_host_cache()
    tp = cfg.tensor_parallel
    _check_world(tp)
    # The plan depends on the rank only through its ranges: a model it refuses is refused on
    # every rank alike, before any group is made.
    rank = get_rank() % tp.tp_size if tp.tp_group is None else 0
    build_plan(model, tp.tp_size, rank, cfg.injection_policy, tp.vocab_parallel)
    dims = _dims(tp)
    plan = build_plan(model, tp.tp_size, dims.tp_rank, cfg.injection_policy, tp.vocab_parallel)
    if cfg.checkpoint is not None:
        load_slices(model, cfg.checkpoint, plan.slices, cfg.dtype)
        model.requires_grad_(False)
        install_plan(model, plan, dims.tp_group)
    else:
        shard_module(model, plan, dims.tp_group, cfg.dtype)
    model.eval()
    return InferenceEngine(model, cfg, dims, plan)


def from_pretrained(folder: str, **kwargs: Any) -> InferenceEngine:
    """Builds the causal-LM model of a Hugging Face folder on the meta device and loads this
    rank's slices into it: ``init_inference`` with ``checkpoint=folder``."""
    dtype = load_inference_config(None, **kwargs).dtype
    return init_inference(build_skeleton(folder, dtype), checkpoint=folder, **kwargs)
