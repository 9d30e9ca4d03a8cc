"""``deepspeed.checkpoint.utils``: the file names of a DeepSpeed checkpoint tag folder and
``clone_tensors_for_torch_save``."""

from __future__ import annotations

import os
from typing import Any

import torch

from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.constants import (
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
    OPTIM_FILE_SUFFIX,
    ZERO_FILE_PREFIX,
)


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model-state file of model-parallel rank `mp_rank_str` (already zero-padded, ``"00"``)
    in `base_folder`: ``<base_folder>/mp_rank_00_model_states.pt``."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """The ZeRO optimizer-state file of (data-parallel, model-parallel) rank in `base_folder`:
    ``<base_folder>/zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt``."""
    name = f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}"
    return os.path.join(base_folder, name)


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """A pipeline layer's file for tensor rank `tp_rank`: ``<layer_id>-model_<tp:02d>...``."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Copies every tensor in `item` (nested lists, tuples and dicts) to `device`, detached and
    sharing no storage with the original, so saving writes only what each tensor shows (a view
    would otherwise save its whole base storage)."""
    device = torch.device(device)
    if torch.is_tensor(item):
        tensor = item.detach()
        return tensor.clone() if tensor.device == device else tensor.to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


__getattr__ = module_getattr("deepspeed.checkpoint.utils")

__all__ = [
    "clone_tensors_for_torch_save",
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
]
