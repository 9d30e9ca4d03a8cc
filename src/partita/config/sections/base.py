"""The base of every config section and the scalar types the sections share.

JSON has one number type, and DeepSpeed users write integers as ``5e8``; so integer fields
accept whole floats (``5e8`` -> ``500000000``) and reject fractional ones. Booleans and strings
are strict: ``"false"`` is not a boolean and ``1`` is not a string, because DeepSpeed's lax
coercion turned such slips into silently different runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator

__all__ = [
    "Bool",
    "Float",
    "Int",
    "NonNegFloat",
    "NonNegInt",
    "PositiveFloat",
    "PositiveInt",
    "Section",
    "real_number",
    "whole_number",
]

logger = logging.getLogger("partita.config")


def whole_number(value: Any) -> Any:
    """Accept ints and whole floats (``5e8``) as ints; reject bools, fractions and strings."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got the boolean {value}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"expected a whole number, got {value!r}")
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")


def real_number(value: Any) -> Any:
    """Accept finite ints and floats as floats; reject bools, NaN, infinities and strings."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {value}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        return float(value)
    raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")


Int = Annotated[int, BeforeValidator(whole_number)]
"""An integer; whole floats such as ``5e8`` are accepted."""
PositiveInt = Annotated[int, BeforeValidator(whole_number), Field(gt=0)]
"""An integer > 0."""
NonNegInt = Annotated[int, BeforeValidator(whole_number), Field(ge=0)]
"""An integer >= 0."""
Float = Annotated[float, BeforeValidator(real_number)]
"""A finite number."""
PositiveFloat = Annotated[float, BeforeValidator(real_number), Field(gt=0)]
"""A finite number > 0."""
NonNegFloat = Annotated[float, BeforeValidator(real_number), Field(ge=0)]
"""A finite number >= 0."""
Bool = StrictBool
"""``true`` or ``false`` only."""


class Section(BaseModel):
    """Base of all config models: unknown keys are errors, values are immutable.

    Subclasses may list ``renamed_keys`` (old spelling -> current field name): the old spelling
    is accepted with a warning, and giving both spellings is an error.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        validate_default=True,
        protected_namespaces=(),
    )

    renamed_keys: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _apply_renamed_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not cls.renamed_keys:
            return data
        out = dict(data)
        for old, new in cls.renamed_keys.items():
            if old not in out:
                continue
            if new in out:
                raise ValueError(
                    f"both '{old}' and '{new}' are set; '{old}' is an older spelling of "
                    f"'{new}', keep only '{new}'"
                )
            logger.warning(
                "DeepSpeed config key '%s' is an older spelling of '%s'; prefer '%s'", old, new, new
            )
            out[new] = out.pop(old)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The section as a plain JSON-ready dict, with current key names."""
        return self.model_dump(mode="json")
