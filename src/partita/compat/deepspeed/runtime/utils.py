"""``deepspeed.runtime.utils``: the two helpers training scripts call, ``see_memory_usage``
(DeepSpeedExamples print it between phases) and ``move_to_device``; partita's memory tools
(``engine.memory_report()``, `partita.estimate`) give the itemised picture."""

from __future__ import annotations

import gc
import resource
from collections.abc import Callable
from typing import Any

import torch

from partita import comm
from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.utils import logger

_GB = 1024**3


def see_memory_usage(message: str, force: bool = False) -> None:
    """On rank 0 and only with `force` (as DeepSpeed): logs `message` with the accelerator's
    allocated / peak / reserved memory (CUDA) and this process's peak resident set size, then
    resets the accelerator's peak counter."""
    if not force or (comm.is_initialized() and comm.get_rank() != 0):
        return
    gc.collect()
    line = message
    if torch.cuda.is_available():
        line += (
            f" | MA {torch.cuda.memory_allocated() / _GB:.2f} GB"
            f" Max_MA {torch.cuda.max_memory_allocated() / _GB:.2f} GB"
            f" CA {torch.cuda.memory_reserved() / _GB:.2f} GB"
        )
        torch.cuda.reset_peak_memory_stats()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line += f" | CPU peak RSS {peak_kb * 1024 / _GB:.2f} GB"
    logger.info(line)


def move_to_device(
    item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """Moves tensors (nested in lists, tuples and dicts) to `device`; with `criterion_func`,
    the items it accepts move in place (their ``.data`` is replaced) and other tensors are
    copied, as DeepSpeed does. Non-tensor leaves are returned unchanged."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, torch.Tensor):
        return item.to(device)
    return item


__getattr__ = module_getattr("deepspeed.runtime.utils")

__all__ = ["move_to_device", "see_memory_usage"]
