"""``deepspeed.utils.groups``: the getters of the data-parallel, sequence-parallel and
sequence-data-parallel groups, read from the dimensions the last ``deepspeed.initialize``
built (`partita.comm.dims.job_dims`; [Note: sequence parallelism] there). DeepSpeed's other
registries (expert, tensor-parallel groups) are refused by name."""

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


__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]
