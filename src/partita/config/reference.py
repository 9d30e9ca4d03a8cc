"""The configuration reference (docs/config.md), generated from the schema and its ledger.

Every key of the ``ds_config.json`` schema (`partita.config.root.DeepSpeedConfig` and its
sections) is listed with its type, its default, its description and what partita does with it
(`partita.config.ledger.LEDGER`: honoured, refused or accepted-inert); then the typed
``optimizer.params`` / ``scheduler.params`` of the types partita builds, and the DeepSpeed keys
the schema does not have (`partita.config.unsupported`). The page is written from the code, not
by hand, so it cannot drift: ``tests/test_docs.py`` fails when the committed file differs from
:func:`render`. Regenerate with::

    .venv/bin/python -m partita.config.reference

No torch is imported (layer 0, like the rest of ``config/``).
"""

from __future__ import annotations

import enum
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .ledger import LEDGER, Entry, Status
from .root import DeepSpeedConfig
from .schema import _model_in
from .sections.optim_params import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from .unsupported import UNSUPPORTED_KEYS, Unsupported, _always, _never, _switched_off

__all__ = ["COMMAND", "DEFAULT_OUTPUT", "main", "render"]

COMMAND = ".venv/bin/python -m partita.config.reference"
"""The one command that regenerates docs/config.md (quoted in the page and in test failures)."""
DEFAULT_OUTPUT = Path(__file__).resolve().parents[3] / "docs" / "config.md"
"""docs/config.md of the source checkout this module lives in."""

# Bounds pydantic keeps in a field's metadata (annotated_types.Gt, Ge, ...) -> their symbol.
_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_SCALARS = {bool: "bool", int: "int", float: "number", str: "string", type(None): "null"}


def _bounds(metadata: list[Any]) -> str:
    """`` > 0``-style text for the bound constraints in ``metadata`` (nested FieldInfo too)."""
    parts = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            parts.append(_bounds(item.metadata).strip())
            continue
        for attr, symbol in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None and not callable(value):
                parts.append(f"{symbol} {value}")
    text = ", ".join(p for p in parts if p)
    return f" {text}" if text else ""


def type_name(annotation: Any, metadata: list[Any] | None = None) -> str:
    """A reader's name for a field's type: ``int > 0``, ``"log" | "linear"``, ``null``."""
    origin = get_origin(annotation)
    bounds = _bounds(metadata or [])
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        return type_name(inner, [*extra, *(metadata or [])])
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in get_args(annotation)) + bounds
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in get_args(annotation))
    if origin is tuple and Ellipsis not in get_args(annotation):
        return "[" + ", ".join(type_name(a) for a in get_args(annotation)) + "]"
    if origin in (list, tuple, dict):
        args = ", ".join(type_name(a) for a in get_args(annotation) if a is not Ellipsis)
        kind = {list: "list", tuple: "list", dict: "object"}[origin]
        return f"{kind} of {args}" if args and origin is not dict else kind
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    name = _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return name + bounds


def _value(value: Any) -> str:
    """A default as JSON (what one writes in ds_config.json), else its repr."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return f"`{json.dumps(value)}`"
    except TypeError:
        return f"`{value!r}`"


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    return _value(info.get_default(call_default_factory=True))


def _prose(text: str) -> str:
    """A docstring's reST literals (````x````) as Markdown code spans, on one line."""
    return " ".join(text.replace("``", "`").split())


def _cell(text: str) -> str:
    """``text`` as one table cell: one line, pipes escaped."""
    return _prose(text).replace("|", "\\|")


def _status(entry: Entry | None) -> str:
    if entry is None:
        return "**not in the ledger**"
    if entry.status is Status.HONOURED:
        files = ", ".join(f"`{f}`" for f in entry.note.split())
        return f"honoured (read in {files})"
    where = f" (enforced by `{entry.enforced_by}`)" if entry.enforced_by else ""
    return f"{entry.status.value}: {entry.note}{where}"


def _sections(
    model: type[BaseModel], prefix: str = ""
) -> Iterator[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]]:
    """(dotted name, model, its leaf fields) for ``model`` and every section under it."""
    leaves = []
    nested = []
    for name, info in model.model_fields.items():
        sub = _model_in(info.annotation)
        if sub is None:
            leaves.append((name, info))
        else:
            nested.append((f"{prefix}{name}", sub))
    yield prefix.rstrip("."), model, leaves
    for dotted, sub in nested:
        yield from _sections(sub, f"{dotted}.")


def _field_rows(prefix: str, fields: list[tuple[str, FieldInfo]], ledger: bool) -> list[str]:
    head = "| key | type | default | description |"
    rule = "|---|---|---|---|"
    if ledger:
        head, rule = head + " ledger |", rule + "---|"
    rows = [head, rule]
    for name, info in fields:
        path = f"{prefix}.{name}" if prefix else name
        cells = [
            f"`{name}`",
            _cell(type_name(info.annotation, info.metadata)),
            _cell(_default(info)),
            _cell(info.description or ""),
        ]
        if ledger:
            cells.append(_cell(_status(LEDGER.get(path))))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _renamed(model: type[BaseModel]) -> list[str]:
    renamed = getattr(model, "renamed_keys", {})
    if not renamed:
        return []
    pairs = ", ".join(f"`{old}` → `{new}`" for old, new in renamed.items())
    return [f"Older spellings accepted with a warning: {pairs}.", ""]


def _schema_part() -> list[str]:
    lines: list[str] = []
    for dotted, model, fields in _sections(DeepSpeedConfig):
        title = f"`{dotted}`" if dotted else "Top level"
        lines += [f"### {title}", ""]
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        if dotted and doc:
            lines += [_prose(doc), ""]
        lines += _renamed(model)
        if fields:
            lines += [*_field_rows(dotted, fields, ledger=True), ""]
    return lines


def _params_part() -> list[str]:
    lines: list[str] = []
    for section, models in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        seen: set[type[BaseModel]] = set()
        for model in models.values():
            if model in seen:
                continue
            seen.add(model)
            names = [k for k, m in models.items() if m is model]
            spelled = ", ".join(f"`{n}`" for n in names)
            lines += [f"### `{section}.params` for {spelled}", ""]
            doc = _prose(model.__doc__ or "")
            if doc:
                lines += [doc, ""]
            fields = list(model.model_fields.items())
            lines += [*_field_rows(f"{section}.params", fields, ledger=False), ""]
    return lines


def _accepted_values(entry: Unsupported) -> str:
    """Which values of an unsupported key are accepted (and dropped)."""
    if entry.inert is _never:
        return "none: any value is an error"
    if entry.inert is _always:
        return "any: accepted and ignored"
    if entry.inert is _switched_off:
        return "switched off: `null`, `false`, `{}` or `enabled: false`"
    cells = entry.inert.__closure__ or ()
    inert = next((c.cell_contents for c in cells if isinstance(c.cell_contents, tuple)), ())
    if not inert:
        return "`null` only"
    return "`null` or " + ", ".join(_value(v) for v in inert)


def _unsupported_part() -> list[str]:
    lines = ["| key | values accepted | why |", "|---|---|---|"]
    for key, entry in UNSUPPORTED_KEYS.items():
        lines.append(f"| `{key}` | {_cell(_accepted_values(entry))} | {_cell(entry.reason)} |")
    return [*lines, ""]


def _by_status(status: Status) -> list[str]:
    """One bullet per ledger key with ``status``: the key and why (a DeepSpeed user's checklist)."""
    return [
        f"- `{path}`: {_prose(entry.note)}"
        for path, entry in LEDGER.items()
        if entry.status is status
    ] + [""]


def _summary() -> list[str]:
    counts = {s: sum(e.status is s for e in LEDGER.values()) for s in Status}
    parts = ", ".join(f"{counts[s]} {s.value}" for s in Status)
    return [f"The ledger lists {len(LEDGER)} keys: {parts}.", ""]


_INTRO = """# Configuration reference

<!-- Generated by `{command}` from src/partita/config/ (the schema) and
src/partita/config/ledger.py; do not edit by hand: tests/test_docs.py checks this file. -->

partita reads DeepSpeed's `ds_config.json` (a dict, a JSON or an hjson file). Every key below is
checked on every rank before any collective: an unknown key is an error naming its dotted path
with a "did you mean", a value of the wrong type or range is an error naming the key, and ranks
started with different configs fail in `initialize()` naming the key and each rank's value.
Integers accept whole floats (`5e8`); booleans and strings are strict (`"false"` is not a
boolean). `"auto"` values are filled by `partita.config.resolve_auto`; the batch triple
(`train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`) is resolved
with DeepSpeed's rules. `optimizer.params` and `scheduler.params` are checked for names, types and
ranges at load (e.g. `optimizer.params.lr: expected a number, got str 'fast'`).

Every schema field has an entry in the ledger, `partita.config.ledger.LEDGER`
(`tests/test_config_ledger.py` fails for a field without one).

The **ledger** column says what partita does with each key:

- **honoured**: the engine reads it and does what DeepSpeed does (the files that read it are named);
- **refused**: partita does not implement it; the default is what partita does, and any other
  value is an error naming the key, raised before any process group exists;
- **accepted-inert**: a DeepSpeed tuning knob without meaning in partita (it changes how
  DeepSpeed schedules or packs work, never the numbers trained): any valid value is accepted and
  changes nothing.

"""


def render() -> str:
    """The whole docs/config.md page, from the schema, the ledger and the unsupported keys."""
    lines = [_INTRO.format(command=COMMAND).rstrip("\n"), "", *_summary()]
    lines += ["## Schema", "", *_schema_part()]
    lines += [
        "## Refused keys",
        "",
        "Set to anything but their default, these keys are an error naming the key and the reason:",
        "",
        *_by_status(Status.REFUSED),
        "## Accepted-inert keys",
        "",
        "Accepted with any valid value; they change nothing in partita:",
        "",
        *_by_status(Status.INERT),
    ]
    lines += [
        "## Optimizer and scheduler parameters",
        "",
        "`optimizer.params` and `scheduler.params` are kept as written and checked at load for "
        "the types partita builds itself (names matched ignoring case); other `torch.optim` "
        "optimizers are checked against their torch signature before the process group.",
        "",
        *_params_part(),
    ]
    lines += [
        "## DeepSpeed keys outside the schema",
        "",
        "These DeepSpeed keys are not part of partita's schema. A key whose value is switched off "
        "(or equal to its inert value) is accepted and dropped, so configs keep working; any "
        "other value is an error naming the key and the reason.",
        "",
        *_unsupported_part(),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to the path given (default: this checkout's docs/config.md)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m partita.config.reference",
        description="Writes the configuration reference generated from the schema and ledger.",
    )
    parser.add_argument("output", nargs="?", default=str(DEFAULT_OUTPUT), help="where to write")
    out = Path(parser.parse_args(sys.argv[1:] if argv is None else argv).output)
    out.write_text(render(), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
