"""``deepspeed.initialize`` and friends, as Hugging Face Accelerate calls them.

Accelerate passes ``model=`` and ``config_params=`` (a dict whose ``"auto"`` values it filled),
plus either ``model_parameters=`` (the config has an ``optimizer`` block), ``optimizer=`` (a torch
optimizer), or neither: an engine for evaluation or generation only, with no optimizer.
"""

from __future__ import annotations

import logging
from typing import Any

from partita import api as _api
from partita.compat.deepspeed._cpu_world import with_cpu_world_hint
from partita.config.errors import ConfigError
from partita.engine import Engine

add_config_arguments = _api.add_config_arguments
init_distributed = _api.init_distributed


_announced = False


def initialize(*args: Any, **kwargs: Any) -> tuple[Engine, Any, Any, Any]:
    """`partita.initialize` with DeepSpeed's signature: returns ``(engine, optimizer,
    dataloader, lr_scheduler)``. The first call says in the log (rank 0) that partita stands in,
    so a run launched for DeepSpeed shows which engine trained it."""
    global _announced
    try:
        result = _api.initialize(*args, **kwargs)
    except ConfigError as error:
        # A Trainer on a CPU-only torch without use_cpu=True: say so instead of the bare
        # batch arithmetic (_cpu_world.py).
        hinted = with_cpu_world_hint(error)
        if hinted is None:
            raise
        raise hinted from error
    if not _announced:
        _announced = True
        from partita.compat.alias import _package_version

        logging.getLogger("partita").info(
            "partita stands in for deepspeed (%s): `import deepspeed` is partita.compat.deepspeed "
            "and this engine is partita's",
            _package_version(),
        )
    return result
