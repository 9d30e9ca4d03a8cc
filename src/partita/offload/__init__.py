"""Where master weights and optimizer state live when they do not fit on the device.

Layer 4 (see docs/design): may import torch, ``partita.platform.accelerator`` and
``partita.config``; never ``zero/`` or the engine. The pieces:

- `aio`: asynchronous aligned file I/O (`ThreadPoolIO` behind the `AsyncIO` protocol);
- `swap`: per-rank preallocated swap files (`SwapSpace`) and a bounded host buffer pool
  (`SwapBufferPool`);
- `swapped`: a tensor kept in a swap file between uses (`SwappedTensor`);
- `checks`: start-up checks of the NVMe paths (`check_offload_config`);
- `adam_step`: the CPU Adam/AdamW step (`cpu_adam_step`, `make_cpu_adam`);
- `copy_back`: where a host step's updated weights go, and their copies to the device
  (`CopyBack`).
"""

from __future__ import annotations

from .adam_step import AdamHyper, cpu_adam_step, make_cpu_adam
from .aio import (
    ALIGNMENT,
    AsyncIO,
    AsyncIOError,
    FileHandle,
    Syscalls,
    ThreadPoolIO,
    aligned_empty,
    byte_view,
    is_aligned,
    open_file,
    padded_nbytes,
)
from .checks import DirectoryProbe, check_offload_config, probe_directory
from .copy_back import CopyBack
from .swap_space import SwapBufferPool, SwapSlot, SwapSpace, remove_stale_swap_dirs, unique_run_id
from .swapped_tensor import SwappedTensor, has_storage, release_storage, restore_storage

__all__ = [
    "ALIGNMENT",
    "AdamHyper",
    "AsyncIO",
    "AsyncIOError",
    "CopyBack",
    "DirectoryProbe",
    "FileHandle",
    "SwapBufferPool",
    "SwapSlot",
    "SwapSpace",
    "SwappedTensor",
    "Syscalls",
    "ThreadPoolIO",
    "aligned_empty",
    "byte_view",
    "check_offload_config",
    "cpu_adam_step",
    "has_storage",
    "is_aligned",
    "make_cpu_adam",
    "open_file",
    "padded_nbytes",
    "probe_directory",
    "release_storage",
    "remove_stale_swap_dirs",
    "restore_storage",
    "unique_run_id",
]
