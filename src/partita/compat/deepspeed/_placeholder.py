"""Classes DeepSpeed has and partita does not implement, importable so a module that names them
at import time (a test helper, a model file with a pipeline variant) still loads: the class
exists for ``import``, ``hasattr`` and ``isinstance``, and constructing it raises
`FeatureNotInPartita` naming the class and the feature behind it."""

from __future__ import annotations

from typing import Any, ClassVar

from partita.platform.env import AS_DEEPSPEED


class FeatureNotInPartita(NotImplementedError):
    """Raised on constructing (or calling) a DeepSpeed name partita does not implement."""


class NotInPartitaPlaceholder:
    """Base of the placeholder classes: subclasses set `_deepspeed_name` (dotted, as DeepSpeed
    spells it) and `_feature`; constructing one raises `FeatureNotInPartita`."""

    _deepspeed_name: ClassVar[str] = ""
    _feature: ClassVar[str] = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        raise FeatureNotInPartita(placeholder_message(self._deepspeed_name, self._feature))


def placeholder_message(deepspeed_name: str, feature: str) -> str:
    """The message for using DeepSpeed's `deepspeed_name` (part of `feature`) under partita."""
    return (
        f"{deepspeed_name} is not in partita: {feature} is not implemented by partita "
        f"(partita stands in for deepspeed in this process via {AS_DEEPSPEED.name} / "
        "partita.as_deepspeed; the name exists only so imports succeed; see docs/huggingface.md)"
    )


def not_in_partita(deepspeed_name: str, feature: str) -> FeatureNotInPartita:
    """The error a placeholder function raises when called."""
    return FeatureNotInPartita(placeholder_message(deepspeed_name, feature))


__all__ = [
    "FeatureNotInPartita",
    "NotInPartitaPlaceholder",
    "not_in_partita",
    "placeholder_message",
]
