"""partita.checkpoint: sharded, atomic, world-size-free checkpoints.

- `save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True,
  exclude_frozen_parameters=False) -> bool` and `load_checkpoint(engine, load_dir, tag=None,
  load_module_strict=True, load_optimizer_states=True, load_lr_scheduler_states=True,
  load_module_only=False, trust_pickle=False) -> (path, client_state)`: what
  ``engine.save_checkpoint`` / ``engine.load_checkpoint`` call.
- `get_fp32_state_dict_from_zero_checkpoint(dir, tag=None)` and
  `load_state_dict_from_zero_checkpoint(model, dir, tag=None)`: consolidated fp32 weights.
- ``partita export CHECKPOINT_DIR OUT_DIR``: Hugging Face safetensors (see `export`).

The format is described in `partita.checkpoint.manifest`; crash safety in
`partita.checkpoint.atomic`; resharding in `partita.checkpoint.reader`.
"""

from __future__ import annotations

from partita.checkpoint.export import (
    export_checkpoint,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from partita.checkpoint.load import load_checkpoint
from partita.checkpoint.manifest import CheckpointError
from partita.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "export_checkpoint",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "save_checkpoint",
]
