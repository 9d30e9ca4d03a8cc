"""``deepspeed.runtime.activation_checkpointing``: see `checkpointing`."""
