"""``deepspeed.utils.torch``: ``required_torch_version``, the torch version check DeepSpeed's
scripts and tests gate features on."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from partita.compat.deepspeed._missing import module_getattr


def required_torch_version(
    min_version: float | str | None = None, max_version: float | str | None = None
) -> bool:
    """Whether the installed torch's version is at least `min_version` and at most
    `max_version` (each optional, not both absent; compared as versions, so ``2.10`` > ``2.9``
    when given as strings; a float like ``1.10`` reads as ``"1.1"``, as in DeepSpeed)."""
    if not min_version and not max_version:
        raise ValueError("required_torch_version: give min_version or max_version")
    installed = TorchVersion(torch.__version__)
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))


__getattr__ = module_getattr("deepspeed.utils.torch")

__all__ = ["required_torch_version"]
