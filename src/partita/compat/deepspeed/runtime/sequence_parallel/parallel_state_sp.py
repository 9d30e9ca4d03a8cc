"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the Ulysses groups as a module
(the mpu that ``register_with_transformers`` returns and ``deepspeed.initialize(mpu=...)``
reads, `partita.comm.ParallelDims.from_mpu`): sequence groups of consecutive ranks and one
sequence-data-parallel group of every rank; the model-parallel getters alias the sequence
ones, as in DeepSpeed."""

from __future__ import annotations

from typing import Any

from partita import comm
from partita.comm.dims import ParallelDims
from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.runtime.sequence_parallel.parallel_state_sp")

_STATE: dict[str, Any] = {}


def _release_sequence_parallel_groups() -> None:
    """Forgets the groups (DeepSpeed's test helper)."""
    _STATE.clear()


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Builds the groups (collective over the world: every rank calls it)."""
    if not comm.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: the process group is not initialized")
    world = comm.get_world_size()
    if world < sequence_parallel_size:
        raise RuntimeError(
            f"world_size ({world}) is less than sequence_parallel_size {sequence_parallel_size}"
        )
    if sequence_parallel_size <= 1:
        raise ValueError(
            f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}"
        )
    if world % sequence_parallel_size:
        raise RuntimeError(
            f"world_size ({world}) is not divisible by sequence_parallel_size "
            f"{sequence_parallel_size}"
        )
    if _STATE:
        raise RuntimeError("sequence parallel group is already initialized")
    _STATE["dims"] = ParallelDims.sequence_parallel(sequence_parallel_size)
    _STATE["seq_dp"] = comm.new_group(list(range(world)))


def _dims() -> ParallelDims:
    if not _STATE:
        raise RuntimeError("sequence parallel group is not initialized")
    dims: ParallelDims = _STATE["dims"]
    return dims


def get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group."""
    return _dims().sp_group


def get_sequence_data_parallel_group() -> Any:
    """Every rank (the ranks holding the same parameters)."""
    _dims()
    return _STATE["seq_dp"]


def get_sequence_parallel_world_size() -> int:
    """Ranks of the sequence-parallel group."""
    return _dims().sp_world_size


def get_sequence_data_parallel_world_size() -> int:
    """Ranks of the sequence-data-parallel group (the world)."""
    return _dims().world_size


def get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group."""
    return _dims().sp_rank


def get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence-data-parallel group (its global rank)."""
    return _dims().rank


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
