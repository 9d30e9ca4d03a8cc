"""Communication layer: the only importer of ``torch.distributed`` in partita.

Process-group set-up (`init_distributed`, idempotent), rank queries, the job's parallel
dimensions (`ParallelDims`: the data-parallel group ZeRO runs over), collectives as plain
functions with async handles, and byte counters (`COUNTERS`) that tests and benchmarks read.
"""

from partita.comm.collectives import (
    ReduceOp,
    Work,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_v,
    barrier,
    broadcast,
    broadcast_object,
    reduce_scatter,
)
from partita.comm.counters import COUNTERS, CommCounters
from partita.comm.dims import ParallelDims, check_shard_size
from partita.comm.process_group import (
    DEFAULT_TIMEOUT,
    ProcessGroup,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
)

__all__ = [
    "COUNTERS",
    "DEFAULT_TIMEOUT",
    "CommCounters",
    "ParallelDims",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "broadcast",
    "broadcast_object",
    "check_shard_size",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "new_group",
    "reduce_scatter",
]
