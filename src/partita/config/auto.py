"""``"auto"`` values: finding leftovers, and filling them in for trainer integrations.

Hugging Face's Trainer lets a ds_config say ``"auto"`` wherever the trainer knows the value
(batch sizes, learning rate, ...). :func:`resolve_auto` is the step such an integration runs
before :func:`partita.config.load_config`: it fills each ``"auto"`` from the values supplied
and checks that concrete values in the config agree with them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import ConfigError, Problem, join_path
from .schema import unknown_key_reason

__all__ = ["AUTO", "AUTO_ALIASES", "find_auto", "resolve_auto"]

AUTO = "auto"

AUTO_ALIASES: dict[str, str] = {
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "warmup_min_lr": "scheduler.params.warmup_min_lr",
    "warmup_max_lr": "scheduler.params.warmup_max_lr",
    "warmup_num_steps": "scheduler.params.warmup_num_steps",
    "total_num_steps": "scheduler.params.total_num_steps",
    "fp16": "fp16.enabled",
    "bf16": "bf16.enabled",
    "reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "stage3_prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
}
"""Short names accepted by :func:`resolve_auto`, and the dotted key each one fills."""


def _walk(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _walk(value, join_path(path, str(key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, join_path(path, index))
    else:
        yield path, node


def find_auto(config: Mapping[str, Any]) -> list[str]:
    """Dotted paths of every ``"auto"`` value in ``config``, in document order."""
    return [path for path, value in _walk(config, "") if value == AUTO]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _normalise(value: Any) -> Any:
    """JSON-shaped copy of a supplied value (tuples become lists)."""
    if isinstance(value, tuple | list):
        return [_normalise(v) for v in value]
    return value


def _lookup(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *parents, key = dotted.split(".")
    node: Any = config
    for parent in parents:
        node = node.get(parent) if isinstance(node, Mapping) else None
    return (node if isinstance(node, dict) else None), key


def resolve_auto(config: Mapping[str, Any], /, **values: Any) -> dict[str, Any]:
    """Return a copy of ``config`` with each ``"auto"`` replaced by the value supplied for it.

    Values are keyed by dotted key (``**{"optimizer.params.lr": 3e-4}``), by a top-level key
    (``train_micro_batch_size_per_gpu=8``), or by a short alias from :data:`AUTO_ALIASES`
    (``lr=3e-4``). A supplied value for a key the config does not have is not added. The input
    is never modified.

    Raises:
        ConfigError: listing together every supplied name that is not a config key, every key
            whose concrete value differs from the supplied one (a mismatch between the
            config and the trainer), and every ``"auto"`` left without a value.
    """
    out = copy.deepcopy(dict(config))
    problems: list[Problem] = []
    supplied: dict[str, Any] = {}
    for name, value in values.items():
        dotted = AUTO_ALIASES.get(name, name)
        why = unknown_key_reason(dotted)
        if why is not None:
            problems.append(Problem(name, f"not a config key or alias: {why}"))
        else:
            supplied[dotted] = _normalise(value)
    for dotted, value in supplied.items():
        holder, key = _lookup(out, dotted)
        if holder is None or key not in holder:
            continue
        if holder[key] == AUTO:
            holder[key] = value
        elif not _same(holder[key], value):
            problems.append(
                Problem(
                    dotted,
                    f"config has {holder[key]!r} but {value!r} was supplied; make them agree "
                    'or set the config value to "auto"',
                )
            )
    problems.extend(
        Problem(path, 'is "auto" but no value was supplied for it') for path in find_auto(out)
    )
    if problems:
        raise ConfigError(problems, "resolve_auto")
    return out
