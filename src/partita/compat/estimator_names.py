"""DeepSpeed's estimator functions, by name and signature, answering with partita's figures.

``estimate_zero{2,3}_model_states_mem_needs_all_live(model, ...)`` and ``..._all_cold(total_params,
...)`` print DeepSpeed's table ("per CPU | per GPU | Options") and return None, as DeepSpeed's
do; ``estimate_zero{2,3}_model_states_mem_needs`` return the figures. The bytes are partita's
model states (parameters, gradients, fp32 masters, optimizer state; stage 3 adds the gathered
window of its largest unit), which differ from DeepSpeed's: partita keeps an fp32 gradient
shard beside the master, so stage 2 needs 2Ψ + 16Ψ/N on the device where DeepSpeed says
2Ψ + 18Ψ/N counting a 16-bit gradient copy partita does not keep. Host memory is per node,
times ``additional_buffer_factor`` as in DeepSpeed. Modules are assumed 16-bit (fp16/bf16),
as DeepSpeed's table does.
"""

from __future__ import annotations

import torch

from partita.estimate.memory import Candidate, Hardware, Offload, Settings, estimate
from partita.estimate.model import ModelShape

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]

# Model states only, as DeepSpeed counts: no buckets, activations or allocator slack.
_STATES = ("parameters", "gradients", "fp32 masters", "optimizer state", "gathered units")


def _states(
    total: int, largest: int, nodes: int, per_node: int, cand: Candidate, factor: float
) -> tuple[int, int]:
    """(host bytes per node, device bytes per rank) of the model states."""
    shape = ModelShape.from_count(total, max(1, min(largest, total)))
    hw = Hardware(per_node, nodes, accelerator="cuda")
    settings = Settings(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    est = estimate(shape, cand, hw, settings)
    device = sum(i.device for i in est.items if i.name in _STATES)
    host = sum(i.host for i in est.items if i.name in _STATES) * per_node
    return int(host * factor), int(device)


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(host bytes per node, device bytes per rank) for ZeRO-2 under partita."""
    cand = Candidate(2, "cpu" if cpu_offload else "none")
    return _states(
        total_params, total_params, num_nodes, num_gpus_per_node, cand, additional_buffer_factor
    )


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(host bytes per node, device bytes per rank, bytes of the largest layer gathered) for
    ZeRO-3 under partita. Without ``zero_init`` every rank of a node first builds the whole
    model in fp32 on the host, which sets a floor on host memory."""
    opt: Offload = "cpu" if cpu_offload else "none"
    param: Offload = "cpu" if cpu_offload and cpu_offload_params else "none"
    cand = Candidate(3, opt, param)
    host, device = _states(
        total_params, largest_layer_params, num_nodes, num_gpus_per_node, cand, 1.0
    )
    if not zero_init:
        host = max(host, 4 * total_params * num_gpus_per_node)
    return int(host * additional_buffer_factor), device, 2 * largest_layer_params


def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """(distinct parameters, largest parameter count of one module), as DeepSpeed counts."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def _header(total: int, nodes: int, per_node: int, largest: int | None = None) -> None:
    nodes_str = "nodes" if nodes > 1 else "node"
    gpus_str = "GPUs" if per_node > 1 else "GPU"
    layer = "" if largest is None else f", {int(largest / 1e6)}M largest layer params"
    print(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {nodes} {nodes_str}, {per_node} {gpus_str} per node.\n"
        f"SW: Model with {int(total / 1e6)}M total params{layer}.\n"
        "(partita's figures: see partita.estimate)"
    )
    print("  per CPU  |  per GPU |   Options")


def estimate_zero2_model_states_mem_needs_all_live(
    model: torch.nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Prints ZeRO-2's model-state memory for `model` with and without optimizer offload."""
    total, _ = model_to_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(
        total, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Prints ZeRO-2's model-state memory for a model of `total_params` parameters."""
    _header(total_params, num_nodes, num_gpus_per_node)
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
        )
        device = "cpu " if offload else "none"
        print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | offload_optimizer={device}")


def estimate_zero3_model_states_mem_needs_all_live(
    model: torch.nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Prints ZeRO-3's model-state memory for `model` under each offload choice."""
    total, largest = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Prints ZeRO-3's model-state memory for `total_params` with `largest_layer_params`."""
    _header(total_params, num_nodes, num_gpus_per_node, largest_layer_params)
    for opt, param in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                opt, param, zero_init, additional_buffer_factor,
            )  # fmt: skip
            options = (
                f"offload_param={'cpu ' if param else 'none'}, "
                f"offload_optimizer={'cpu ' if opt else 'none'}, zero_init={int(zero_init)}"
            )
            print(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")
