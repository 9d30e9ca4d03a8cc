"""``deepspeed.ops.lion``: partita has no Lion optimizer; constructing one says so."""

from __future__ import annotations

from typing import Any


class _Unsupported:
    feature = "the Lion optimizer"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"deepspeed.ops.lion.{cls.__name__}: {cls.feature} is not implemented by partita; "
            "use AdamW, Adam, Adagrad or SGD"
        )


class DeepSpeedCPULion(_Unsupported):
    """Not implemented by partita (raises when constructed)."""


class FusedLion(_Unsupported):
    """Not implemented by partita (raises when constructed)."""


__all__ = ["DeepSpeedCPULion", "FusedLion"]
