"""Activation checkpointing (DeepSpeed's ``deepspeed.checkpointing``) on torch's non-reentrant
checkpoint: where checkpoint inputs are kept (`storage`), the model-parallel RNG tracker
(`rng`), the entry points (`checkpointing`), and the host offload of Hugging Face
gradient checkpointing's layer inputs (`offload`)."""

from partita.activations.checkpointing import (
    checkpoint,
    checkpoint_wrapper,
    configure,
    is_configured,
    reset,
)
from partita.activations.offload import (
    CheckpointHiddenStatesOffload,
    CheckpointOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
    offload_checkpoints,
)
from partita.activations.rng import get_rng_tracker, model_parallel_manual_seed
from partita.activations.storage import STATS

__all__ = [
    "STATS",
    "CheckpointHiddenStatesOffload",
    "CheckpointOffload",
    "checkpoint",
    "checkpoint_wrapper",
    "configure",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "get_rng_tracker",
    "is_configured",
    "model_parallel_manual_seed",
    "offload_checkpoints",
    "reset",
]
