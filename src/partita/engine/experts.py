"""What the engine builds for mixture-of-experts layers: the expert-parallel size (checked
before any collective), the groups bound to the layers, the expert parameters' family for the
ZeRO strategy, and optimizer groups split by kind for stages 1-2. Composition only; the
layers live in `partita.moe`, the reductions in `partita.zero`
([Note: expert parallelism] in `partita.comm.dims`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from partita import comm
from partita.comm.dims import check_expert_parallel_size
from partita.config import DeepSpeedConfig, config_error
from partita.moe import load_stats
from partita.moe.layer import expert_parameters, moe_layers
from partita.zero.strategy import ExpertFamily


def expert_parallel_size(model: Any, config: DeepSpeedConfig, world: int, mpu: Any) -> int | None:
    """The job's expert-parallel size (None: `model` has no MoE layer), checked against the
    ranks holding the dense parameters, `world` (under sequence parallelism every rank: the
    experts split over them as over data-parallel ranks), and what partita composes experts
    with, naming the values; no collective runs, so every rank raises alike."""
    layers = moe_layers(model) if isinstance(model, torch.nn.Module) else []
    if not layers:
        return None
    sizes = sorted({layer.ep_size for layer in layers})
    if len(sizes) > 1:
        raise ValueError(
            f"MoE layers with different ep_size {sizes}: partita supports one expert-parallel "
            "size per job"
        )
    ep = sizes[0]
    check_expert_parallel_size(ep, world)
    for what, on in (
        ("an mpu (model parallelism)", mpu is not None),
        ("zero_optimization.mics_shard_size", config.zero_optimization.mics_shard_size != -1),
    ):
        if on:
            raise ValueError(
                f"MoE layers (ep_size {ep}) together with {what} are not supported by partita yet"
            )
    return ep


def apply_autoep(model: Any, config: DeepSpeedConfig, rank: int) -> None:
    """DeepSpeed's AutoEP section (``expert_parallel.enabled``, ``autoep_size``): splits the
    experts of a Hugging Face MoE model in place over blocks of ``autoep_size`` consecutive
    ranks (`partita.moe.expert_parallel`), before anything reads the model's MoE layers. No
    collective; a model it cannot split fails every rank alike, naming the section."""
    section = config.expert_parallel
    if not section.enabled or not isinstance(model, torch.nn.Module) or moe_layers(model):
        return
    from partita.moe.hf_experts import expert_parallel

    size = int(section.autoep_size)
    try:
        expert_parallel(model, size, ep_rank=rank % size)
    except ValueError as error:
        raise config_error("expert_parallel", str(error)) from None


def with_expert_groups(model: Any, dims: comm.ParallelDims, ep: int | None) -> comm.ParallelDims:
    """`dims` with the expert groups of size `ep` (collective over the world), bound to every
    MoE layer of `model`; `dims` unchanged without experts."""
    if ep is None:
        return dims
    dims = dims.with_experts(ep)
    for layer in moe_layers(model):
        layer.set_ep_group(dims.ep_group)
    return dims


def expert_family(module: torch.nn.Module, dims: comm.ParallelDims) -> ExpertFamily | None:
    """The trainable expert parameters of `module` with their groups (None without experts)."""
    if not dims.ep_ranks:
        return None
    every = expert_parameters(module)
    params = frozenset(p for p in every if p.requires_grad)
    frozen = frozenset(p for p in every if not p.requires_grad)
    return ExpertFamily(params, dims.edp_group, dims.ep_group, frozen) if params else None


def split_expert_groups(
    groups: list[dict[str, Any]], module: torch.nn.Module, config: DeepSpeedConfig
) -> list[dict[str, Any]]:
    """`groups` with each group that mixes expert and dense parameters cut in two with the
    same hyperparameters (the dense part in place, the expert part appended, as DeepSpeed's
    ``split_params_into_different_moe_groups_for_optimizer`` does for an optimizer it builds):
    stages 1-2 shard the two kinds over different groups. Stage 0 splits alike (its elementwise
    steps are the same either way), so that the optimizer has the same groups at every stage
    and a checkpoint's group hyperparameters load at another stage."""
    if config.zero_optimization.stage not in (0, 1, 2):
        return groups
    experts = set(expert_parameters(module))
    if not experts:
        return groups
    added = []
    for i, group in enumerate(groups):
        mine = [p for p in group["params"] if p in experts]
        dense = [p for p in group["params"] if p not in experts]
        if mine and dense:
            group["params"] = dense
            # moe_of: a checkpoint of a layout without the split gives it its origin's values.
            added.append({**group, "params": mine, "moe": True, "moe_of": i})
    return groups + added


def load_figures(
    module: torch.nn.Module, dims: comm.ParallelDims, monitor: Any
) -> dict[str, dict[str, float]]:
    """The step's expert load figures of `module`'s MoE layers while `monitor` is enabled
    (summed over the ranks holding the same layers: a collective), else none; either way the
    layers' tallies start again ([Note: expert load statistics] in `partita.moe.load_stats`)."""
    if not monitor.enabled:
        load_stats.clear(module)
        return {}
    return load_stats.step_figures(module, dims.grad_group)


def broadcast_group(
    param: torch.Tensor, experts: Collection[torch.Tensor], dims: comm.ParallelDims
) -> tuple[tuple[int, ...], comm.ProcessGroup | None]:
    """The ranks that start from one copy of `param` (its first rank's): the expert-data-parallel
    group for an expert parameter, else the ranks holding the same parameters."""
    if param in experts and dims.ep_ranks:
        return dims.edp_ranks, dims.edp_group
    return dims.grad_ranks, dims.grad_group
