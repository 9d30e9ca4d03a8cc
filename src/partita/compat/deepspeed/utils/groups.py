"""``deepspeed.utils.groups``: the getters of the data-parallel, sequence-parallel and
sequence-data-parallel groups, read from the dimensions the last ``deepspeed.initialize``
built (`partita.comm.dims.job_dims`; [Note: sequence parallelism] there), and the expert
getters ([Note: expert parallelism] there): one expert-parallel size per job, whose groups are
named ``ep_size_<E>`` as DeepSpeed names them. DeepSpeed's other registries (tensor-parallel
groups) are refused by name."""

from __future__ import annotations

from typing import Any

from partita import comm
from partita.comm.dims import ParallelDims, job_dims
from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.utils.groups")


def _dims() -> ParallelDims:
    dims = job_dims()
    if dims is None:
        if not comm.is_initialized():
            raise RuntimeError("deepspeed.utils.groups: the process group is not initialized")
        return ParallelDims.world()
    return dims


def _get_data_parallel_group() -> Any:
    """The data-parallel group (None: every rank)."""
    return _dims().dp_group


def _get_data_parallel_world_size() -> int:
    """Ranks that read different batches."""
    return _dims().dp_world_size


def _get_data_parallel_rank() -> int:
    """This rank's index among them."""
    return _dims().dp_rank


def _get_sequence_parallel_group() -> Any:
    """The sequence-parallel group; KeyError without one, as DeepSpeed raises."""
    dims = _dims()
    if dims.sp_world_size == 1:
        raise KeyError("No sequence parallel group found")
    return dims.sp_group


def _get_sequence_parallel_world_size() -> int:
    """Ranks each sequence is split across (1 without sequence parallelism)."""
    return _dims().sp_world_size


def _get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence group (0 without one)."""
    return _dims().sp_rank


def _get_sequence_data_parallel_group() -> Any:
    """The ranks holding the same parameters (data-parallel x sequence; ZeRO's group)."""
    return _dims().grad_group


def _get_sequence_data_parallel_world_size() -> int:
    """Ranks of `_get_sequence_data_parallel_group`."""
    return len(_dims().grad_ranks)


def _get_sequence_data_parallel_rank() -> int:
    """This rank's index in it."""
    dims = _dims()
    return dims.grad_ranks.index(dims.rank)


mpu: Any = None
"""DeepSpeed's registered model-parallel unit (partita keeps its groups in the job's dims; this
stays None, so code that tests ``groups.mpu`` reads "no tensor parallelism")."""


def _expert_dims(group_name: str | None = None) -> ParallelDims:
    """The job's dims, which must have expert groups (named `group_name` when given)."""
    dims = _dims()
    if not dims.ep_ranks:
        raise KeyError(
            "no expert-parallel group: the job has no MoE layer (deepspeed.moe.layer.MoE "
            "groups are made by deepspeed.initialize)"
        )
    name = f"ep_size_{dims.ep_world_size}"
    if group_name is not None and group_name != name:
        raise KeyError(f"no expert-parallel group named {group_name!r}; this job has {name!r}")
    return dims


def _get_expert_parallel_group(group_name: str) -> Any:
    """The ranks holding the other experts of this rank's layers (tokens are exchanged there)."""
    return _expert_dims(group_name).ep_group


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """The ranks holding the same experts as this one (expert gradients are summed there)."""
    return _expert_dims(group_name).edp_group


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    """``{"ep_size_<E>": group}`` (empty when the job has no expert layers)."""
    dims = _dims()
    return {f"ep_size_{dims.ep_world_size}": dims.ep_group} if dims.ep_ranks else {}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    """``{"ep_size_<E>": expert-data-parallel group}`` (empty without expert layers)."""
    dims = _dims()
    return {f"ep_size_{dims.ep_world_size}": dims.edp_group} if dims.ep_ranks else {}


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    """Global ranks of the expert-parallel group."""
    return list(_expert_dims(group_name).ep_ranks)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    """Global ranks of the expert-data-parallel group."""
    return list(_expert_dims(group_name).edp_ranks)


def _get_expert_parallel_world_size(group_name: str) -> int:
    """Ranks a layer's experts are split across."""
    return _expert_dims(group_name).ep_world_size


def _get_expert_parallel_rank(group_name: str) -> int:
    """This rank's index in its expert-parallel group."""
    return _expert_dims(group_name).ep_rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """Global rank of the first rank of this rank's expert-parallel group."""
    return _expert_dims(group_name).ep_ranks[0]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    """Ranks holding the same experts."""
    return len(_expert_dims(group_name).edp_ranks)


def _get_expert_data_parallel_rank(group_name: str) -> int:
    """This rank's index in its expert-data-parallel group."""
    dims = _expert_dims(group_name)
    return dims.edp_ranks.index(dims.rank)


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """Global rank whose experts the others of the expert-data-parallel group start from."""
    return _expert_dims(group_name).edp_ranks[0]


def _get_max_expert_size() -> int | None:
    """The largest expert-parallel size of the job (None without expert layers)."""
    dims = _dims()
    return dims.ep_world_size if dims.ep_ranks else None


def _get_max_expert_size_name() -> str:
    """``ep_size_<largest expert-parallel size>``."""
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    """The expert-parallel group of the largest size."""
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    """Tensor-parallel ranks per expert: always 1 (partita has no tensor-parallel experts)."""
    return 1


__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_model_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_src_rank",
    "_get_expert_parallel_world_size",
    "_get_max_expert_parallel_group",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]
