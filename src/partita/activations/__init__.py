"""Activation checkpointing (DeepSpeed's ``deepspeed.checkpointing``) on torch's non-reentrant
checkpoint: where checkpoint inputs are kept (`storage`), the model-parallel RNG tracker
(`rng`), and the entry points (`checkpointing`)."""

from partita.activations.checkpointing import (
    checkpoint,
    checkpoint_wrapper,
    configure,
    is_configured,
    reset,
)
from partita.activations.rng import get_rng_tracker, model_parallel_manual_seed
from partita.activations.storage import STATS

__all__ = [
    "STATS",
    "checkpoint",
    "checkpoint_wrapper",
    "configure",
    "get_rng_tracker",
    "is_configured",
    "model_parallel_manual_seed",
    "reset",
]
