"""Reading a config file (JSON or hjson) into a dict, refusing duplicate keys.

JSON parsers keep the last of two equal keys without a word, so a config edited by hand can
silently lose a setting; both parsers here record duplicates and we report every one with its
dotted path and the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hjson

from .errors import ConfigError, Problem, join_path

__all__ = ["read_config_file"]


class _PairsDict(dict[str, Any]):
    """A parsed JSON object that remembers keys given more than once."""

    duplicates: list[str]


def _pairs_hook(pairs: list[tuple[str, Any]]) -> _PairsDict:
    out = _PairsDict()
    out.duplicates = []
    for key, value in pairs:
        if key in out and key not in out.duplicates:
            out.duplicates.append(key)
        out[key] = value
    return out


def _duplicate_paths(node: Any, path: str) -> Iterator[str]:
    if isinstance(node, dict):
        for key in getattr(node, "duplicates", ()):
            yield join_path(path, key)
        for key, value in node.items():
            yield from _duplicate_paths(value, join_path(path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _duplicate_paths(value, join_path(path, index))


def _parse(text: str, path: Path) -> Any:
    """Parse as hjson for ``.hjson`` files, else as JSON with hjson as the fallback.

    DeepSpeed reads every config file with hjson (a superset of JSON, allowing comments), so
    a ``.json`` file with comments must still load; strict JSON goes first for its clearer
    error positions.
    """
    if path.suffix.lower() == ".hjson":
        return hjson.loads(text, object_pairs_hook=_pairs_hook)
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as json_error:
        try:
            return hjson.loads(text, object_pairs_hook=_pairs_hook)
        except hjson.HjsonDecodeError:
            raise json_error from None


def _plain(node: Any) -> Any:
    """Plain dicts and lists, so the parse bookkeeping does not leak out."""
    if isinstance(node, dict):
        return {key: _plain(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_plain(value) for value in node]
    return node


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a JSON or hjson config file into a plain dict.

    Raises:
        ConfigError: the file is missing or unreadable, does not parse (with line and column),
            is not a JSON object, or repeats a key (every repeat is listed by dotted path).
    """
    file = Path(path)
    source = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError([Problem("", f"cannot read the config file: {error}")], source) from None
    try:
        data = _parse(text, file)
    except ValueError as error:  # json.JSONDecodeError and hjson.HjsonDecodeError
        raise ConfigError([Problem("", f"not valid JSON/hjson: {error}")], source) from None
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem("", f"the top level must be an object, got {type(data).__name__}")], source
        )
    duplicates = list(_duplicate_paths(data, ""))
    if duplicates:
        raise ConfigError(
            [Problem(p, "key appears more than once; keep one") for p in duplicates], source
        )
    return _plain(data)
