"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``):
DeepSpeed's activation-checkpointing API, Megatron-DeepSpeed's names included, as thin adapters
over `partita.activations` (the algorithms live there)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from partita import comm
from partita.activations import checkpointing as _ckpt
from partita.activations import rng as _rng
from partita.activations.checkpointing import checkpoint, checkpoint_wrapper, is_configured, reset
from partita.activations.rng import RNGStatesTracker as CudaRNGStatesTracker
from partita.activations.rng import get_rng_tracker as get_cuda_rng_tracker
from partita.compat.deepspeed._missing import missing_attribute
from partita.config import DeepSpeedConfig
from partita.config.reader import read_config_file
from partita.config.sections.runtime import ActivationCheckpointingConfig

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "checkpoint_wrapper",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = _rng.MODEL_PARALLEL_RNG
non_reentrant_checkpoint = checkpoint
"""DeepSpeed's non-reentrant variant: partita's checkpoint is always non-reentrant."""


def _section(config: Any) -> ActivationCheckpointingConfig | None:
    """The ``activation_checkpointing`` section of a config path, dict or validated config."""
    if config is None or isinstance(config, ActivationCheckpointingConfig):
        return config
    if isinstance(config, DeepSpeedConfig):
        return config.activation_checkpointing
    raw = read_config_file(config) if isinstance(config, str | os.PathLike) else config
    if not isinstance(raw, Mapping):
        raise TypeError(
            "deepspeed.checkpointing.configure: deepspeed_config must be a path, a dict or a "
            f"DeepSpeedConfig, got {type(config).__name__}"
        )
    return ActivationCheckpointingConfig.model_validate(raw.get("activation_checkpointing", {}))


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``configure``: the config's section, then each keyword given (DeepSpeed's
    names mapped onto the config's keys)."""
    _ckpt.configure(
        mpu_,
        _section(deepspeed_config),
        partition_activations=partition_activations,
        contiguous_memory_optimization=contiguous_checkpointing,
        number_checkpoints=num_checkpoints,
        cpu_checkpointing=checkpoint_in_cpu,
        synchronize_checkpoint_boundary=synchronize,
        profile=profile,
    )


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Switches ``partition_activations`` alone."""
    _ckpt.configure(_ckpt.settings().mpu, _ckpt.settings().config,
                    partition_activations=partition_activation)  # fmt: skip


def set_num_layers(nlayers: int) -> None:
    """Sets ``number_checkpoints`` alone."""
    _ckpt.configure(_ckpt.settings().mpu, _ckpt.settings().config, number_checkpoints=nlayers)


def _tp_rank() -> int:
    mpu = _ckpt.settings().mpu
    if mpu is None or not comm.is_initialized():
        return 0
    return int(_ckpt.mpu_query(mpu, "rank"))


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seeds the default stream and the tracker's model-parallel stream (seed + 2718 + the
    tensor-parallel rank of the configured mpu)."""
    _rng.model_parallel_manual_seed(seed, _tp_rank())


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seeds the model-parallel stream."""
    _rng.model_parallel_reconfigure_seed(seed, _tp_rank())


def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1) -> None:
    """Restores the compute device's generator state (Megatron imports this name)."""
    _rng.set_rng_state(new_state)


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.checkpointing", name)
