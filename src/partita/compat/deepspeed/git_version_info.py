"""``deepspeed.git_version_info``: the version record DeepSpeed's tools print. partita builds
none of DeepSpeed's ops (``installed_ops`` is empty) and has no git hash; ``torch_info`` is the
torch this process runs."""

from __future__ import annotations

from typing import Any

import torch

from partita.compat.alias import _package_version
from partita.compat.deepspeed._missing import module_getattr

version = _package_version()
git_hash: str | None = None
git_branch: str | None = None
installed_ops: dict[str, bool] = {}
compatible_ops: dict[str, bool] = {}
torch_info: dict[str, Any] = {
    "version": ".".join(torch.__version__.split(".")[:2]),
    "cuda_version": torch.version.cuda or "0.0",
    "nccl_version": "0.0",
    "hip_version": torch.version.hip or "0.0",
}

__getattr__ = module_getattr("deepspeed.git_version_info")

__all__ = ["compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
