"""Errors raised by the optimizer and scheduler factories, and the checks that produce them.

Every message names the dotted config key (``optimizer.type``, ``scheduler.params.<key>``),
the value found and what was expected, with a "did you mean" for near-miss names, so a user
can fix their ``ds_config.json`` from the message alone.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "OptimConfigError",
    "OptimizerConfigError",
    "SchedulerConfigError",
    "check_call_params",
    "did_you_mean",
]


class OptimConfigError(ValueError):
    """Base class of the errors in an ``optimizer`` or ``scheduler`` config section.

    A ``ValueError`` so that callers that catch config errors generically keep working;
    ``key`` is the dotted config path at fault (``None`` when the fault spans keys).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class OptimizerConfigError(OptimConfigError):
    """A bad ``optimizer`` section: unknown or unsupported type, unknown or invalid param."""


class SchedulerConfigError(OptimConfigError):
    """A bad ``scheduler`` section, or a bad argument to one of the scheduler classes.

    Raised by the scheduler classes themselves with the bare argument name as ``key``;
    ``build_scheduler`` re-raises with the dotted ``scheduler.params.<name>`` path.
    """


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice to ``name``, else ``""``.

    Matching ignores case, since the most common slip in a JSON config is ``adamw``/``AdamW``.
    """
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def check_call_params(
    target: Any,
    params: Mapping[str, Any],
    *,
    prefix: str,
    skip: int,
    error: type[OptimConfigError],
    extra: Iterable[str] = (),
) -> None:
    """Check ``params`` against the keyword arguments of callable ``target``.

    ``skip`` leading positional parameters are filled by the caller (``params`` of an
    optimizer, ``optimizer`` of a scheduler) and are neither accepted from the config nor
    required. ``extra`` names keys the caller consumes itself (``torch_adam``). Raises
    ``error`` naming ``<prefix>.<key>`` for an unknown key (with the accepted ones and a
    "did you mean") or for a missing required one.
    """
    signature = inspect.signature(target)
    accepted = [
        p
        for p in list(signature.parameters.values())[skip:]
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    names = [p.name for p in accepted] + list(extra)
    for key in params:
        if key not in names:
            raise error(
                f"{prefix}.{key}: unknown parameter for {_display(target)}"
                f"{did_you_mean(key, names)}; accepted: {', '.join(sorted(names))}",
                key=f"{prefix}.{key}",
            )
    for p in accepted:
        if p.default is inspect.Parameter.empty and p.name not in params:
            raise error(
                f"{prefix}.{p.name}: required by {_display(target)} but missing",
                key=f"{prefix}.{p.name}",
            )


def _display(target: Any) -> str:
    module = getattr(target, "__module__", "")
    name = getattr(target, "__qualname__", repr(target))
    return f"{module}.{name}" if module else name
