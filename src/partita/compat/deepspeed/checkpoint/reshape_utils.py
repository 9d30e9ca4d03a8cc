"""``deepspeed.checkpoint.reshape_utils``: finding a DeepSpeed checkpoint folder's files and
splitting rank lists evenly (the pieces `reshape_3d_utils` and `DeepSpeedCheckpoint` build on)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TypeVar

from partita.checkpoint.manifest import CheckpointError
from partita.compat.deepspeed._missing import module_getattr
from partita.compat.deepspeed.checkpoint.constants import (
    BF16_ZERO_FILE_PREFIX,
    FP16_ZERO_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    ZERO_FILE_PREFIX,
)

T = TypeVar("T")


def basic_folder_validation(folder: str) -> None:
    """Raises `CheckpointError` unless `folder` exists and is a directory."""
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise CheckpointError(f"{folder}: {what} (expected a DeepSpeed checkpoint tag folder)")


def get_files(folder: str) -> list[str]:
    """Every file under `folder`, recursively, as paths joined onto `folder`."""
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]


def get_files_with_prefix(files: Sequence[str], prefix: str) -> list[str]:
    """The paths in `files` whose file name starts with `prefix`, sorted."""
    return sorted(path for path in files if os.path.basename(path).startswith(prefix))


def _zero_rank_key(path: str, prefix: str) -> tuple[int, int]:
    found = re.search(rf"{re.escape(prefix)}(\d+)_{MODEL_FILE_PREFIX}(\d+)", path)
    if found is None:
        raise CheckpointError(
            f"{path}: cannot read the data-parallel and model-parallel ranks from the file "
            f"name (expected {prefix}<dp>_{MODEL_FILE_PREFIX}<mp>_...)"
        )
    return int(found.group(1)), int(found.group(2))


def get_zero_files(folder: str) -> list[str]:
    """The ZeRO optimizer-state files of `folder` (plain, fp16_ or bf16_ named, the first kind
    found), ordered by data-parallel rank, then model-parallel rank; numeric order, so rank 10
    follows rank 9."""
    files = get_files(folder)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return sorted(found, key=lambda path: _zero_rank_key(path, prefix))
    return []


def partition_data(items: Sequence[T], num_partitions: int) -> list[list[T]]:
    """`items` cut into `num_partitions` contiguous, equal runs; raises `ValueError` when the
    count does not divide (a reshape that would have to split one rank's files)."""
    if num_partitions < 1 or len(items) % num_partitions:
        raise ValueError(f"cannot split {len(items)} items into {num_partitions} equal partitions")
    size = len(items) // num_partitions
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


__getattr__ = module_getattr("deepspeed.checkpoint.reshape_utils")

__all__ = [
    "basic_folder_validation",
    "get_files",
    "get_files_with_prefix",
    "get_zero_files",
    "partition_data",
]
