"""``deepspeed.checkpointing``: the same module as
``deepspeed.runtime.activation_checkpointing.checkpointing`` (DeepSpeed binds one to the other)."""

import sys

from partita.compat.deepspeed.runtime.activation_checkpointing import checkpointing as _module

# One module object under both names, so settings made through either are the same settings.
sys.modules[__name__] = _module
