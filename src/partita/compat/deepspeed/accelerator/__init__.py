"""``deepspeed.accelerator``: ``get_accelerator()`` with the DeepSpeed accelerator methods
Transformers and Accelerate call, over partita's `partita.platform.accelerator`."""

from __future__ import annotations

import os
from typing import Any

import torch

from partita.compat.deepspeed._missing import missing_attribute
from partita.platform.accelerator import get_accelerator as _partita_accelerator


class DeepSpeedAccelerator:
    """The device as DeepSpeed's accelerator object describes it (cuda or cpu)."""

    def __init__(self) -> None:
        self._impl = _partita_accelerator()

    def device_name(self, device_index: Any = None) -> str:
        """``"cuda"`` / ``"cuda:N"`` or ``"cpu"``."""
        if not self._impl.is_cuda or device_index is None:
            return self._impl.device_type
        return f"cuda:{int(device_index)}"

    def current_device_name(self) -> str:
        """The device this process computes on, as a string (``"cuda:0"``, ``"cpu"``)."""
        return str(self._impl.current_device())

    def current_device(self) -> Any:
        """The current device index on CUDA, the device on CPU."""
        device = self._impl.current_device()
        return device.index if device.type == "cuda" else device

    def device(self, device_index: Any = None) -> torch.device:
        """A torch device of this accelerator."""
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        """Number of devices: CUDA's count; on CPU, ``LOCAL_SIZE`` when the launcher set it
        (the ranks of this node, as DeepSpeed's CPU accelerator reads it), else 1."""
        if self._impl.is_cuda:
            return torch.cuda.device_count()
        try:
            local = int(os.environ.get("LOCAL_SIZE", "0"))
        except ValueError:
            local = 0
        return local if local > 0 else 1

    def is_available(self) -> bool:
        """True: CUDA when present, else the CPU."""
        return True

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on CPU."""
        return self._impl.communication_backend

    def set_device(self, device_index: int) -> None:
        """Binds this process to device `device_index` (no-op on CPU)."""
        self._impl.set_device(int(device_index))

    def synchronize(self, device_index: Any = None) -> None:
        """Waits for queued device work."""
        del device_index
        self._impl.synchronize()

    def empty_cache(self) -> None:
        """Returns cached device memory (CUDA only)."""
        if self._impl.is_cuda:
            torch.cuda.empty_cache()

    def is_bf16_supported(self) -> bool:
        """Whether bf16 runs on this device."""
        return torch.cuda.is_bf16_supported() if self._impl.is_cuda else True

    def is_fp16_supported(self) -> bool:
        """Whether fp16 runs on this device."""
        return True

    def manual_seed(self, seed: int) -> None:
        """Seeds this device's generator (the CPU's is torch's default one)."""
        if self._impl.is_cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seeds every device's generator."""
        if self._impl.is_cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        raise missing_attribute("deepspeed.accelerator.get_accelerator()", name)


_ACCELERATOR: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator (created on first use)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = DeepSpeedAccelerator()
    return _ACCELERATOR


# The device names partita's accelerator reports (DeepSpeed's list also has xpu, npu, mps, ...).
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator's device name is one partita supports (always true:
    partita runs on CUDA or the CPU)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


__all__ = [
    "SUPPORTED_ACCELERATOR_LIST",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
]
