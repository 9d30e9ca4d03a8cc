"""``deepspeed.runtime.config``: ``DeepSpeedConfig(config, mpu=None)`` loads and validates a
config with partita's loader (`partita.config.load_config`) and returns partita's config model;
``DeepSpeedConfigError`` is partita's `ConfigError`. DeepSpeed's flattened attributes
(``config.zero_optimization_stage`` ...) are partita's sections instead
(``config.zero_optimization.stage``)."""

from __future__ import annotations

from typing import Any

from partita import comm
from partita.compat.deepspeed._missing import module_getattr
from partita.config import ConfigError as DeepSpeedConfigError
from partita.config import DeepSpeedConfig as _Config
from partita.config import load_config


class DeepSpeedConfig:
    """``DeepSpeedConfig(config, mpu=None)``: returns partita's validated config model (a dict,
    a JSON/hjson path, or an already built one), the batch sizes resolved for the data-parallel
    world size (the mpu's, else every rank's, else 1 before a process group exists)."""

    def __new__(cls, config: Any, mpu: Any = None, mesh_device: Any = None) -> _Config:  # type: ignore[misc]
        del mesh_device
        if isinstance(config, _Config):
            return config
        if mpu is not None:
            world = int(mpu.get_data_parallel_world_size())
        else:
            world = comm.get_world_size() if comm.is_initialized() else 1
        return load_config(config, world_size=world)


# DeepSpeed's optimizer names (the config's ``optimizer.type``, matched ignoring case). The list
# is DeepSpeed's; partita refuses lamb, muadam, muadamw, musgd and muon by name, saying why
# (`partita.optim.optimizers`).
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
]
# Extra ``optimizer.params`` keys of adam/adamw.
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__getattr__ = module_getattr("deepspeed.runtime.config")

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "ADAM_W_MODE",
    "ADAM_W_MODE_DEFAULT",
    "DEEPSPEED_OPTIMIZERS",
    "LAMB_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUADAMW_OPTIMIZER",
    "MUADAM_OPTIMIZER",
    "MUON_OPTIMIZER",
    "MUSGD_OPTIMIZER",
    "TORCH_ADAM_PARAM",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
]
