"""Activation checkpointing: DeepSpeed's ``deepspeed.checkpointing`` on torch's non-reentrant
`torch.utils.checkpoint`.

`checkpoint(function, *args)` runs `function` without keeping its inner activations and reruns
it in backward; what is kept are its inputs, stored as the ``activation_checkpointing`` section
says (`partition_activations`, `cpu_checkpointing`, `contiguous_memory_optimization` with
`number_checkpoints`: see `partita.activations.storage`). `synchronize_checkpoint_boundary`
synchronises the device when each checkpointed call (and its recomputation) starts and ends;
`profile` logs each call's forward and recomputation time.

Recomputation sees the forward's random state: torch restores the CPU and device generators,
and this module also restores the model-parallel RNG tracker's states (`partita.activations.rng`),
so dropout masks are the same and the gradients equal those of an uncheckpointed run.

The settings are process-wide, as DeepSpeed's are: `configure` sets them (``is_configured()``
becomes true); `partita.initialize` applies the config's section as the defaults.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from partita import comm
from partita.activations import storage
from partita.activations.rng import get_rng_tracker
from partita.config.sections.runtime import ActivationCheckpointingConfig
from partita.platform.accelerator import get_accelerator

__all__ = [
    "CheckpointTimings",
    "Settings",
    "apply_config",
    "checkpoint",
    "checkpoint_wrapper",
    "configure",
    "is_configured",
    "reset",
    "settings",
]

logger = logging.getLogger("partita")


@dataclass
class CheckpointTimings:
    """Seconds spent in checkpointed forwards and recomputations (with ``profile``)."""

    forward_seconds: float = 0.0
    recompute_seconds: float = 0.0
    forwards: int = 0
    recomputes: int = 0


@dataclass
class Settings:
    """The process's activation-checkpointing settings.

    Attributes:
        config: the ``activation_checkpointing`` section in force.
        mpu: the model-parallel unit (Megatron's ``mpu``) whose group inputs are partitioned
            over; None: no model parallelism.
        configured: `configure` was called (DeepSpeed's ``is_configured``).
        timings: totals gathered with ``profile``.
    """

    config: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    mpu: Any = None
    configured: bool = False
    timings: CheckpointTimings = field(default_factory=CheckpointTimings)
    arena: storage.ContiguousArena | None = None


_SETTINGS = Settings()


def settings() -> Settings:
    """The settings in force (read-only use)."""
    return _SETTINGS


def _check(config: ActivationCheckpointingConfig) -> None:
    if config.contiguous_memory_optimization and config.number_checkpoints is None:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization needs "
            "activation_checkpointing.number_checkpoints (the buffer's slot count)"
        )


def apply_config(config: ActivationCheckpointingConfig, mpu: Any = None) -> None:
    """Makes `config` the settings in force, without marking them configured (what
    `partita.initialize` does with the config's section)."""
    _check(config)
    _SETTINGS.config, _SETTINGS.mpu = config, mpu
    _SETTINGS.arena = None
    if config.partition_activations and _group_size(mpu) == 1:
        logger.info(
            "activation_checkpointing.partition_activations: no model parallelism (mp size 1), "
            "so checkpoint inputs are kept whole"
        )


def configure(
    mpu_: Any = None,
    deepspeed_config: ActivationCheckpointingConfig | None = None,
    **overrides: Any,
) -> None:
    """Sets the settings from `deepspeed_config`'s section, then `overrides` (any field of
    `ActivationCheckpointingConfig`); marks them configured."""
    base = deepspeed_config or ActivationCheckpointingConfig()
    given = {k: v for k, v in overrides.items() if v is not None}
    config = ActivationCheckpointingConfig.model_validate({**base.model_dump(), **given})
    apply_config(config, mpu_)
    _SETTINGS.configured = True


def is_configured() -> bool:
    """True once `configure` was called (DeepSpeed's meaning)."""
    return _SETTINGS.configured


def reset() -> None:
    """Drops the contiguous buffers (DeepSpeed calls this between evaluation forwards that
    never run backward); the next checkpoint allocates them again."""
    _SETTINGS.arena = None


def mpu_query(mpu: Any, what: str) -> Any:
    """``mpu.get_tensor_model_parallel_<what>()`` (Megatron-Core's name) or, on an older mpu,
    ``mpu.get_model_parallel_<what>()``."""
    getter = getattr(mpu, f"get_tensor_model_parallel_{what}", None)
    if getter is None:
        getter = getattr(mpu, f"get_model_parallel_{what}", None)
    if getter is None:
        raise AttributeError(
            f"activation checkpointing: the mpu {type(mpu).__name__} has neither "
            f"get_tensor_model_parallel_{what} nor get_model_parallel_{what}"
        )
    return getter()


def _group_size(mpu: Any) -> int:
    if mpu is None or not comm.is_initialized():
        return 1
    return int(mpu_query(mpu, "world_size"))


def _placement() -> storage.Placement:
    config, mpu = _SETTINGS.config, _SETTINGS.mpu
    if config.contiguous_memory_optimization and _SETTINGS.arena is None:
        assert config.number_checkpoints is not None  # checked by _check
        _SETTINGS.arena = storage.ContiguousArena(config.number_checkpoints)
    size = _group_size(mpu) if config.partition_activations else 1
    group, rank = None, 0
    if size > 1:
        group, rank = mpu_query(mpu, "group"), int(mpu_query(mpu, "rank"))
    arena = _SETTINGS.arena if config.contiguous_memory_optimization else None
    return storage.Placement(config.cpu_checkpointing, group, rank, size, arena)


def _timed_body(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` with the boundary synchronisation, profiling and model-parallel RNG replay."""
    config = _SETTINGS.config
    tracker = get_rng_tracker()
    forward_states = tracker.get_states()
    calls = [0]

    def body(*args: Any, **kwargs: Any) -> Any:
        recompute = calls[0] > 0
        calls[0] += 1
        outer_states = tracker.get_states()
        if recompute:
            tracker.set_states(forward_states)
        if config.synchronize_checkpoint_boundary:
            get_accelerator().synchronize()
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if config.synchronize_checkpoint_boundary:
                get_accelerator().synchronize()
            if recompute:
                tracker.set_states(outer_states)
            if config.profile:
                _record_time(recompute, time.perf_counter() - start)

    return body


def _record_time(recompute: bool, seconds: float) -> None:
    timings = _SETTINGS.timings
    if recompute:
        timings.recompute_seconds += seconds
        timings.recomputes += 1
    else:
        timings.forward_seconds += seconds
        timings.forwards += 1
    what = "recompute" if recompute else "forward"
    logger.info("activation checkpoint %s: %.3f ms", what, seconds * 1e3)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``function(*args, **kwargs)`` keeping only its inputs for backward (stored per the
    settings) and recomputing the rest; returns what `function` returns."""
    where = _placement()
    with torch.autograd.graph.saved_tensors_hooks(
        functools.partial(storage.pack, where=where), storage.unpack
    ):
        # torch saves the inputs through the hooks in force here; inside the call its own
        # hooks take over, so only the inputs pass through `storage`.
        return torch_checkpoint.checkpoint(
            _timed_body(function), *args, use_reentrant=False, **kwargs
        )


class _Checkpointed(torch.nn.Module):
    """A module whose forward runs under `checkpoint`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, checkpointed."""
        return checkpoint(self.module, *args, **kwargs)


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """`module` wrapped so that every forward is checkpointed with the current settings."""
    return _Checkpointed(module)
