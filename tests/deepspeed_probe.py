"""Says which ``deepspeed`` a process imported (partita's stand-in or the real one), for tests
that must prove partita's engine trained."""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any


def describe() -> dict[str, str | None]:
    """Module name and file behind ``deepspeed`` (None if never imported) and its version."""
    module = sys.modules.get("deepspeed")
    return {
        "module": None if module is None else module.__name__,
        "file": None if module is None else getattr(module, "__file__", None),
        "version": importlib.metadata.version("deepspeed"),
    }


def built_sharded(model: Any) -> bool:
    """Whether `model`'s parameters were built sharded by partita's ``zero.Init`` (Transformers
    builds under ``deepspeed.zero.Init`` when the Trainer's config is ZeRO-3)."""
    from partita.zero.init import PRE_SHARDED

    return any(p in PRE_SHARDED for p in model.parameters())
