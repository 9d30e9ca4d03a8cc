"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""

from __future__ import annotations

from typing import Any

import torch

from partita.compat.deepspeed._missing import module_getattr


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

__all__ = ["clone_tensors_for_torch_save"]
