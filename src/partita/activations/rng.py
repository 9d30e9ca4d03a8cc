"""Named device RNG states for model-parallel dropout (Megatron's RNG tracker).

Tensor-parallel layers need two random streams: dropout inside a tensor-parallel region must
differ across the tensor-parallel ranks (each holds a different slice), dropout outside it must
agree. The tracker keeps named generator states and swaps one in for a block (`fork`); the
default stream stays the process's own. Activation checkpointing saves and restores these states
around recomputation so recomputed dropout masks equal the forward's.

The states are the compute device's generator (CUDA), or torch's CPU generator on a CPU run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from partita.platform.accelerator import get_accelerator

__all__ = [
    "MODEL_PARALLEL_RNG",
    "MODEL_PARALLEL_SEED_OFFSET",
    "RNGStatesTracker",
    "get_rng_state",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "model_parallel_reconfigure_seed",
    "set_rng_state",
]

logger = logging.getLogger("partita")

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker's name for the tensor-parallel stream (Megatron's and DeepSpeed's)."""
MODEL_PARALLEL_SEED_OFFSET = 2718
"""Added to the seed for the tensor-parallel stream, as Megatron and DeepSpeed do, so that a
script's seeds give the same streams under either."""


def _device_rng() -> Any:
    """The module whose get/set_rng_state/manual_seed drive the compute device's generator."""
    accelerator = get_accelerator()
    return torch.get_device_module(accelerator.device_type) if accelerator.is_cuda else torch


def get_rng_state() -> torch.Tensor:
    """The compute device's generator state."""
    return _device_rng().get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    """Restores a `get_rng_state` state on the compute device."""
    _device_rng().set_rng_state(state)


class RNGStatesTracker:
    """Named generator states; `fork` runs a block on one of them (Megatron's
    ``CudaRNGStatesTracker``)."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        """Forgets every state and seed."""
        self.states = {}
        self.seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states themselves are not mutated in place)."""
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replaces the name -> state map (e.g. with a `get_states` copy)."""
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Creates state `name` seeded with `seed`; the current stream is left as it was."""
        if seed in self.seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state")
        if name in self.states:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds.add(seed)
        previous = get_rng_state()
        _device_rng().manual_seed(seed)
        self.states[name] = get_rng_state()
        set_rng_state(previous)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Runs the block on state `name`, keeps where it left that state, and restores the
        stream that was current."""
        if name not in self.states:
            raise KeyError(
                f"RNG tracker: state {name!r} was never added (known: {sorted(self.states)}); "
                "call model_parallel_cuda_manual_seed first"
            )
        previous = get_rng_state()
        set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = get_rng_state()
            set_rng_state(previous)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int = 0) -> None:
    """Seeds the default stream with `seed` (equal across tensor-parallel ranks) and the
    tracker's model-parallel stream with ``seed + 2718 + tp_rank`` (distinct per rank)."""
    mp_seed = seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank
    logger.info(
        "model-parallel seeds: default stream %d, model-parallel stream %d (tensor-parallel "
        "rank %d)", seed, mp_seed, tp_rank
    )  # fmt: skip
    _TRACKER.reset()
    _device_rng().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, mp_seed)


def model_parallel_reconfigure_seed(seed: int, tp_rank: int = 0) -> None:
    """Re-seeds the existing model-parallel stream with ``seed + 2718 + tp_rank``."""
    with _TRACKER.fork():
        _device_rng().manual_seed(seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
