"""``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the pydantic base DeepSpeed's
config sections (and libraries extending them) derive from, written for partita.

Behaviour kept from DeepSpeed's base: unknown keys are refused, defaults and assignments are
validated, fields answer to their alias and their name, values ``"auto"`` are dropped (the field
keeps its default) unless ``strict=True``, and a field declared deprecated through
``json_schema_extra={"deprecated": True, "new_param": ..., "new_param_fn": ...}`` logs a warning
when given and, when it names a replacing field, sets that field from its value (giving both is
an error). partita's own config sections do not use this base (see `partita.config`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from functools import reduce
from typing import Any

from pydantic import BaseModel, ConfigDict

from partita.compat.deepspeed._missing import module_getattr

logger = logging.getLogger(__name__)


class DeprecatedFieldConflict(AssertionError, ValueError):
    """A deprecated field and the field replacing it were both given (DeepSpeed raises an
    AssertionError here; this is one, and a ValueError in meaning)."""


class DeepSpeedConfigModel(BaseModel):
    """Base of DeepSpeed-style config models: pydantic with extra keys forbidden, validated
    defaults and assignments, aliases or names accepted, ``"auto"`` values dropped unless
    ``strict``, and deprecated fields forwarded to their replacements (module docstring)."""

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._forward_deprecated(name, extra)

    def _forward_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        """Warns that deprecated field `name` was given and sets the field replacing it."""
        if name not in self.model_fields_set:
            return
        new_param = str(extra.get("new_param", "") or "")
        message = str(extra.get("deprecated_msg", "") or "")
        logger.warning(
            "Config parameter %s is deprecated%s%s",
            name,
            f", use {new_param} instead" if new_param else "",
            f". {message}" if message else "",
        )
        if not new_param or not extra.get("set_new_param", True):
            return
        convert: Callable[[Any], Any] = extra.get("new_param_fn") or (lambda x: x)
        *parents, leaf = new_param.split(".")
        owner: Any = reduce(getattr, parents, self)
        if leaf in owner.model_fields_set:
            raise DeprecatedFieldConflict(
                f"Cannot provide deprecated parameter {name!r} and replacing parameter "
                f"{new_param!r} together"
            )
        setattr(owner, leaf, convert(getattr(self, name)))


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default of `field_name` in config model `config` (raises if it has none)."""
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    if field_name not in fields:
        raise KeyError(f"{field_name!r} is not a field of {config}")
    info = fields[field_name]
    if info.is_required():
        raise ValueError(f"{field_name!r} is a required field and has no default value")
    return info.get_default(call_default_factory=True)


def get_scalar_param(param_dict: dict[str, Any], param_name: str, default: Any) -> Any:
    """``param_dict[param_name]``, or `default` when absent."""
    return param_dict.get(param_name, default)


get_list_param = get_scalar_param
get_dict_param = get_scalar_param


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.load`` ``object_pairs_hook`` that refuses duplicate keys (ValueError naming
    them)."""
    found = dict(ordered_pairs)
    if len(found) != len(ordered_pairs):
        counts = collections.Counter(key for key, _ in ordered_pairs)
        duplicated = [key for key, n in counts.items() if n > 1]
        raise ValueError(f"Duplicate keys in DeepSpeed config: {duplicated}")
    return found


__getattr__ = module_getattr("deepspeed.runtime.config_utils")

__all__ = [
    "DeepSpeedConfigModel",
    "DeprecatedFieldConflict",
    "dict_raise_error_on_duplicate_keys",
    "get_config_default",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
]
