"""Walking the config models by key path: which keys exist where (for "did you mean")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

from pydantic import BaseModel

from .errors import did_you_mean
from .root import DeepSpeedConfig

__all__ = ["keys_of", "model_at", "unknown_key_reason"]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as ``ZeroConfig | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def keys_of(model: type[BaseModel]) -> list[str]:
    """Keys a section accepts: its fields and the older spellings it renames."""
    return [*model.model_fields, *getattr(model, "renamed_keys", {})]


def _field_model(model: type[BaseModel], key: str) -> tuple[bool, type[BaseModel] | None]:
    renamed = getattr(model, "renamed_keys", {})
    name = renamed.get(key, key)
    field = model.model_fields.get(name)
    if field is None:
        return False, None
    return True, _model_in(field.annotation)


def model_at(path: Sequence[str | int]) -> type[BaseModel] | None:
    """The section model at ``path`` from the root, or None (free-form dict, list, scalar)."""
    model: type[BaseModel] | None = DeepSpeedConfig
    for part in path:
        if model is None or not isinstance(part, str):
            return None
        _, model = _field_model(model, part)
    return model


def unknown_key_reason(dotted: str) -> str | None:
    """Why ``dotted`` names no key of the schema (with a suggestion), or None if it does.

    Paths into free-form dicts (``optimizer.params.lr``) are always accepted.
    """
    model: type[BaseModel] | None = DeepSpeedConfig
    for part in dotted.split("."):
        if model is None:
            return None
        exists, sub = _field_model(model, part)
        if not exists:
            suggestion = did_you_mean(part, keys_of(model))
            return f"no key '{part}' in {model.__name__}{suggestion}"
        model = sub
    return None
