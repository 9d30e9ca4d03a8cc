"""``deepspeed.comm``: partita's communication layer under DeepSpeed's names (``from deepspeed
import comm as dist``; ``dist.init_distributed``, ``dist.get_rank``, ``dist.barrier``...)."""

from __future__ import annotations

from typing import Any

from partita.comm import (  # noqa: F401  (re-exported names)
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    destroy_process_group,
    get_backend,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
    reduce_scatter,
)
from partita.compat.deepspeed._missing import missing_attribute


def is_available() -> bool:
    """True: torch.distributed is what partita communicates with."""
    return True


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.comm", name)
