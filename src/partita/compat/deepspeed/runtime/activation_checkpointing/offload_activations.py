"""``deepspeed.runtime.activation_checkpointing.offload_activations``: ALST's offload of the
hidden states Hugging Face gradient checkpointing saves, over `partita.activations.offload`
(the algorithm lives there)."""

from __future__ import annotations

from partita.activations.offload import (
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)
from partita.compat.deepspeed._missing import module_getattr

__getattr__ = module_getattr("deepspeed.runtime.activation_checkpointing.offload_activations")

__all__ = [
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
]
