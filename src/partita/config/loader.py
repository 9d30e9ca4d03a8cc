"""``load_config``: from a dict or file to a validated, batch-resolved ``DeepSpeedConfig``.

Every check runs before anything is raised, so one ``ConfigError`` lists all problems: leftover
``"auto"`` values, unsupported keys, the batch triple, types, ranges and unknown keys (from
pydantic, translated to dotted paths with a suggestion), and the cross-field rules.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from .auto import find_auto
from .batch import BATCH_KEYS, resolve_batch_sizes
from .errors import ConfigError, Problem, did_you_mean, join_path
from .reader import read_config_file
from .root import DeepSpeedConfig
from .rules import check_raw_rules
from .schema import keys_of, model_at
from .sections.base import whole_number
from .unsupported import strip_unsupported

__all__ = ["load_config", "validate_config"]

_AUTO_HINT = (
    'is "auto"; fill it with partita.config.resolve_auto(config, ...) before loading (as '
    "trainer integrations do) or set a concrete value"
)


def _dotted(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path = join_path(path, part)
    return path


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _translate(error: ErrorDetails) -> list[Problem]:
    """One pydantic error as problems with dotted paths and readable messages."""
    loc = tuple(error["loc"])
    path = _dotted(loc)
    kind = error["type"]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # the root's cross-field rules
        return list(cause.problems)
    if kind == "extra_forbidden":
        parent = model_at(loc[:-1])
        hint = did_you_mean(str(loc[-1]), keys_of(parent)) if parent is not None else ""
        return [Problem(path, f"unknown key{hint}")]
    if kind == "missing":
        return [Problem(path, "required key is missing")]
    message = error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "expected an object ({...})"
    value = error.get("input")
    if not isinstance(value, Mapping) and "got" not in message:
        message = f"{message} (got {_short(value)})"
    return [Problem(path, message)]


def _resolve_batch(data: dict[str, Any], world_size: int) -> list[Problem]:
    """Replace the batch keys in ``data`` by their resolved values; problems if impossible.

    On failure the keys get placeholder values so the rest of the config is still validated.
    """
    problems: list[Problem] = []
    given: list[int | None] = []
    usable = True
    for key in BATCH_KEYS:
        value = data.get(key)
        if value is None:
            given.append(None)
            continue
        try:
            given.append(whole_number(value))
        except ValueError as error:
            usable = False
            if value != "auto":  # already reported as an "auto" leftover
                problems.append(Problem(key, f"{error} (got {_short(value)})"))
    if usable:
        try:
            sizes = resolve_batch_sizes(*given, world_size=world_size)
        except ConfigError as error:
            problems.extend(error.problems)
        else:
            data.update(vars(sizes))
            return problems
    data.update(dict.fromkeys(BATCH_KEYS, 1))
    return problems


def validate_config(config: Mapping[str, Any], *, world_size: int) -> DeepSpeedConfig:
    """Validate a config dict (already read) for a data-parallel ``world_size``.

    Raises:
        ConfigError: every problem found, each with its dotted key path.
    """
    data = copy.deepcopy(dict(config))
    problems = check_raw_rules(data) + strip_unsupported(data)
    auto_paths = find_auto(data)
    problems += [Problem(path, _AUTO_HINT) for path in auto_paths]
    batch_problems = _resolve_batch(data, world_size)
    problems += batch_problems
    try:
        cfg = DeepSpeedConfig.model_validate(data)
    except ValidationError as error:
        skip = set(auto_paths) | (set(BATCH_KEYS) if batch_problems else set())
        for detail in error.errors(include_url=False):
            problems += [p for p in _translate(detail) if p.path not in skip]
    if problems:
        raise ConfigError(problems)
    return cfg


def load_config(
    source: Mapping[str, Any] | str | os.PathLike[str], *, world_size: int
) -> DeepSpeedConfig:
    """Load and validate a DeepSpeed config for a data-parallel ``world_size``.

    Args:
        source: the config as a dict, or the path of a JSON or hjson file.
        world_size: data-parallel world size, used to resolve the batch-size triple.

    Returns:
        The validated config with ``train_batch_size``, ``train_micro_batch_size_per_gpu``
        and ``gradient_accumulation_steps`` all resolved.

    Raises:
        ConfigError: every problem found (file, duplicate keys, unknown or unsupported keys,
            ``"auto"`` leftovers, types, ranges, batch sizes, cross-field rules).
        ValueError: ``world_size`` is not an int >= 1.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(source, Mapping):
        origin, data = "<dict>", dict(source)
    elif isinstance(source, str) and source.lstrip().startswith("{"):
        raise TypeError("source looks like JSON text; pass json.loads(text) or a file path")
    elif isinstance(source, str | os.PathLike):
        origin, data = os.fspath(source), read_config_file(source)
    else:
        raise TypeError(f"source must be a dict or a file path, got {type(source).__name__}")
    try:
        return validate_config(data, world_size=world_size)
    except ConfigError as error:
        raise error.with_source(origin) from None
