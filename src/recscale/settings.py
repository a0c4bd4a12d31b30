"""The base of every section of a run's config (data, schema, model, training, ...): pydantic, with the
checks a config needs that pydantic's defaults leave out."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _admits(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field of ``annotation`` takes a value of one of ``kinds`` (through unions, Annotated, ...)."""
    if annotation in kinds or annotation is Any:
        return True
    return any(_admits(a, kinds) for a in get_args(annotation))


def _first_bool(value: Any, seen: frozenset[int] = frozenset()) -> bool | None:
    """The first boolean in ``value``, itself or at any depth of its lists, tuples and mappings (which YAML
    aliases can make hold themselves); None when it holds none."""
    if isinstance(value, list | tuple | dict) and id(value) not in seen:
        for v in value.values() if isinstance(value, dict) else value:
            if (found := _first_bool(v, seen | {id(value)})) is not None:
                return found
    return value if isinstance(value, bool) else None


class Settings(BaseModel):
    """Unknown keys are errors; numbers are finite (inf is no learning rate, decay or tolerance: a run
    would train to NaN and exit 0) and are not booleans (pydantic reads ``max_steps: true`` as 1), also
    inside lists and mappings (``top_mlp: [true, 64]`` was a layer of width 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is not None and (found := _first_bool(value)) is not None:
            annotation = cls.model_fields[info.field_name].annotation
            # Where no number goes either (a name, a list), pydantic's own error names the type wanted.
            if _admits(annotation, (int, float)) and not _admits(annotation, (bool,)):
                text = str(found).lower()  # as YAML writes it
                raise ValueError(
                    f"expected a number, not {text}" if value is found else f"expected numbers, got {text}"
                )
        return value
