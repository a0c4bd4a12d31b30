"""The base of every section of a run's config (data, schema, model, training, ...): pydantic, with the
checks a config needs that pydantic's defaults leave out."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _admits(annotation: Any, kinds: tuple[type, ...], literals: bool = True) -> bool:
    """Whether a field of ``annotation`` takes a value of one of ``kinds`` (through unions, Annotated, ...;
    ``literals``: also as one of a Literal's values, e.g. Literal["auto"] takes a str)."""
    if annotation in kinds or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return literals and any(isinstance(a, kinds) for a in get_args(annotation))
    return any(_admits(a, kinds, literals) for a in get_args(annotation))


def _first(value: Any, kind: type, seen: frozenset[int] = frozenset()) -> Any:
    """The first ``kind`` in ``value``, itself or at any depth of its lists, tuples and mapping values (which
    YAML aliases can make hold themselves); None when it holds none."""
    if isinstance(value, list | tuple | dict) and id(value) not in seen:
        for v in value.values() if isinstance(value, dict) else value:
            if (found := _first(v, kind, seen | {id(value)})) is not None:
                return found
    return value if isinstance(value, kind) else None


def _quoted_number(text: str | None) -> bool:
    """Whether ``text`` reads as a number (where it does not, pydantic's own error names the type wanted)."""
    try:
        return text is not None and math.isfinite(float(text))
    except ValueError:
        return False


class Settings(BaseModel):
    """Unknown keys are errors; numbers are finite (inf is no learning rate, decay or tolerance: a run
    would train to NaN and exit 0) and are neither booleans (pydantic reads ``max_steps: true`` as 1) nor
    quoted (``dim: '16'``: YAML's string, which pydantic would read as 16), also inside lists and mappings
    (``top_mlp: [true, 64]`` was a layer of width 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def changed(self, key: str) -> bool:
        """Whether ``key`` holds other than its default: what "set" can mean for a key another key leaves
        unread, as a run's config.yaml holds every key, given or not."""
        return bool(getattr(self, key) != type(self).model_fields[key].default)

    @field_validator("*", mode="before")
    @classmethod
    def _a_number_is_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        # Where no number goes either (a name, a list), pydantic's own error names the type wanted.
        if not _admits(annotation, (int, float)):
            return value
        if not _admits(annotation, (bool,)) and (found := _first(value, bool)) is not None:
            text = str(found).lower()  # as YAML writes it
            raise ValueError(
                f"expected a number, not {text}" if value is found else f"expected numbers, got {text}"
            )
        # int | Literal["auto"] takes "auto", not "2": only a field that takes any text may take a quoted number.
        if not _admits(annotation, (str,), literals=False) and _quoted_number(found := _first(value, str)):
            text = f"the string {found!r}"
            raise ValueError(
                f"expected a number, not {text} (write it without quotes)"
                if value is found
                else f"expected numbers, got {text} (write them without quotes)"
            )
        return value
