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
from partita.config import DeepSpeedConfig
from partita.profiling.comms import COMMS_LOGGER as comms_logger
from partita.profiling.comms import log_summary  # noqa: F401  (re-exported)

# DeepSpeed's comm is a package (deepspeed.comm.comm, .reduce_op...): a search path makes this
# module one for the import system, so those paths reach the stub finder (see _stubs).
__path__: list[str] = []


def is_available() -> bool:
    """True: torch.distributed is what partita communicates with."""
    return True


def configure(
    deepspeed_config: DeepSpeedConfig | None = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """DeepSpeed's ``deepspeed.comm.configure``: the config's ``comms_logger`` section, then
    each keyword given, applied to partita's comms logger."""
    section = deepspeed_config.comms_logger if deepspeed_config is not None else comms_logger.config
    given = {"enabled": enabled, "prof_all": prof_all, "prof_ops": prof_ops,
             "verbose": verbose, "debug": debug}  # fmt: skip
    changes = {k: v for k, v in given.items() if v is not None}
    comms_logger.configure(type(section).model_validate({**section.model_dump(), **changes}))


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.comm", name)
