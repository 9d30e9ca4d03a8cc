"""``deepspeed.checkpoint``: inspecting DeepSpeed checkpoint folders (their parallel layout,
model-state metadata and ZeRO files, `DeepSpeedCheckpoint`), planning a merge onto smaller
degrees (`model_3d_desc`), the universal-checkpoint tensor-parallel merge (`ds_to_universal`)
and the key names inside DeepSpeed's files (`constants`)."""

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint import constants, utils
from partita.compat.deepspeed.checkpoint.constants import *  # noqa: F403 (DeepSpeed re-exports them)
from partita.compat.deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from partita.compat.deepspeed.checkpoint.reshape_3d_utils import (
    get_model_3d_descriptor,
    model_3d_desc,
)
from partita.compat.deepspeed.checkpoint.reshape_meg_2d import reshape_meg_2d_parallel
from partita.compat.deepspeed.checkpoint.utils import (
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)
from partita.compat.deepspeed.checkpoint.zero_checkpoint import ZeROCheckpoint

__getattr__ = module_getattr("deepspeed.checkpoint")

__all__ = [
    "DeepSpeedCheckpoint",
    "ZeROCheckpoint",
    "constants",
    "get_layer_ckpt_name_for_rank",
    "get_model_3d_descriptor",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
    "model_3d_desc",
    "reshape_meg_2d_parallel",
    "utils",
]
