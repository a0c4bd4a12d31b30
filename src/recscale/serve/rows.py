"""Scoring requests: JSON rows of raw feature values, validated, as one Arrow record batch.

A request is ``{"rows": [{"<feature>": value, ...}, ...]}``. Each row names every feature of the
model's schema and nothing else: a single-id sparse feature is a string or an integer (its decimal
text, as the readers turn integer ids into text), a multi-id one a list of them, a weighted one's
``<feature>__w`` a list of numbers of the same length, a dense feature a finite float32 number. ``null`` is a
missing value, mapped as in training (the OOV id, an empty bag, the dense fill value); an id the
vocabulary never saw is OOV. Anything else is a ``RequestError`` of one line naming the row and field.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, StrictStr, ValidationError, create_model

from recscale.data.readers.base import normal_ids
from recscale.data.schema import WEIGHT_SUFFIX, Schema
from recscale.train.dcp_safety import one_line

# The model computes in float32: a larger magnitude is infinite there, as the readers refuse it in training.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
Number = Annotated[float, Strict(), Field(allow_inf_nan=False, ge=-_FLOAT32_MAX, le=_FLOAT32_MAX)]
Id = StrictStr | StrictInt


class RequestError(ValueError):
    """A request the service refuses: ``status`` (4xx) and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class RowParser:
    """Validates request bodies against a schema and returns them as raw-layout record batches."""

    def __init__(self, schema: Schema, max_rows: int) -> None:
        fields: dict[str, Any] = {}
        self._kinds: list[tuple[str, pa.DataType, str]] = []  # (column, arrow type, what a value must be)
        for d in schema.dense:
            self._kinds.append((d.name, pa.float32(), "a finite float32 number (|x| <= 3.4028e38) or null"))
        for f in schema.sparse:
            if f.multi:
                self._kinds.append((f.name, pa.list_(pa.string()), "a list of strings or integers, or null"))
                if f.weighted:
                    self._kinds.append(
                        (f.name + WEIGHT_SUFFIX, pa.list_(pa.float32()), "a list of numbers or null")
                    )
            else:
                self._kinds.append((f.name, pa.string(), "a string, an integer or null"))
        types = {pa.float32(): Number | None, pa.string(): Id | None, pa.list_(pa.string()): list[Id] | None}
        for i, (name, arrow, _) in enumerate(self._kinds):
            typ = types.get(arrow, list[Number] | None)
            # Positional field names with the feature as alias: a feature may be called anything.
            fields[f"f{i}"] = (typ, Field(alias=name))
        row = create_model("Row", __config__=ConfigDict(extra="forbid"), **fields)
        self._request: type[BaseModel] = create_model(
            "ScoreRequest",
            __config__=ConfigDict(extra="forbid"),
            rows=(list[row], Field(min_length=1, max_length=max_rows)),
        )
        self._schema = pa.schema([(name, arrow) for name, arrow, _ in self._kinds])
        self._weighted = [(f.name, f.name + WEIGHT_SUFFIX) for f in schema.sparse if f.weighted]
        self._sequences = {f.name for f in schema.sparse if f.sequence}
        self.max_rows = max_rows

    @property
    def arrow_schema(self) -> pa.Schema:
        return self._schema

    def parse(self, body: bytes) -> pa.RecordBatch:
        """A request body -> its rows as one record batch (columns in ``arrow_schema``)."""
        try:
            request = self._request.model_validate_json(body)
        except ValidationError as e:
            raise self._reason(e) from None
        rows = request.rows  # type: ignore[attr-defined]
        columns = []
        for i, (_, arrow, _) in enumerate(self._kinds):
            values = [getattr(r, f"f{i}") for r in rows]
            if arrow == pa.string():
                values = [v if v is None or type(v) is str else str(v) for v in values]
            elif arrow == pa.list_(pa.string()):
                values = [v if v is None else [x if type(x) is str else str(x) for x in v] for v in values]
                name = self._kinds[i][0]
                # The readers refuse an empty element of a history (3||7) as malformed; so does the server.
                if name in self._sequences:
                    empty = next((r for r, v in enumerate(values) if v and "" in v), None)
                    if empty is not None:
                        raise RequestError(
                            422,
                            f"rows[{empty}].{name}: a history's ids must not be empty strings; an empty "
                            "list or null is an empty history",
                        )
            try:
                column = pa.array(values, type=arrow)
            except (pa.ArrowException, UnicodeError, OverflowError) as e:  # e.g. lone surrogates in a string
                raise RequestError(422, f"{self._kinds[i][0]}: unusable value ({one_line(e)})") from None
            # Ids as the readers read them: "3.0" is id 3, and a single "" is a missing id. A list keeps
            # its "" for the empty-id handling above and below (dropped, or refused in a history).
            if arrow == pa.string():
                column = normal_ids(column)
            elif arrow == pa.list_(pa.string()):
                flat = pc.fill_null(normal_ids(pc.list_flatten(column)), "")
                column = pa.ListArray.from_arrays(column.offsets, flat, mask=column.is_null())
            columns.append(column)
        batch = pa.RecordBatch.from_arrays(columns, schema=self._schema)
        for ids, w in self._weighted:
            a, b = batch.column(ids).value_lengths(), batch.column(w).value_lengths()
            if not a.fill_null(0).equals(b.fill_null(0)):
                raise RequestError(422, f"{w}: give one weight per id of {ids} in every row")
        return batch

    def _reason(self, e: ValidationError) -> RequestError:
        err = e.errors()[0]
        # A value that fits no member of a union (string | integer) fails once per member: count fields.
        others = len({x["loc"][:3] for x in e.errors()}) - 1
        more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
        if err["type"] in ("json_invalid", "json_type"):
            return RequestError(400, f"the body is not valid JSON: {one_line(err['msg'])}")
        loc = err["loc"]
        if not loc:
            return RequestError(422, 'the body must be a JSON object {"rows": [{feature: value, ...}, ...]}')
        if loc[0] != "rows":
            return RequestError(422, f'unknown key {one_line(repr(loc[0]), 60)}: the body holds only "rows"')
        if len(loc) == 1:
            if err["type"] == "too_long":
                return RequestError(413, f"rows: at most {self.max_rows} rows per request; split it")
            return RequestError(422, f"rows: {one_line(err['msg'])}; give a non-empty list of row objects")
        where = f"rows[{loc[1]}]"
        if len(loc) == 2:
            return RequestError(422, f"{where}: each row must be an object of feature values")
        name = str(loc[2])
        if err["type"] == "missing":
            return RequestError(422, f"{where}: missing feature {name!r}{more}")
        if err["type"] == "extra_forbidden":
            return RequestError(422, f"{where}: unknown feature {one_line(repr(name), 60)}; the model's "
                                     f"features are {', '.join(self._schema.names)}")  # fmt: skip
        want = next((w for n, _, w in self._kinds if n == name), "a valid value")
        got = one_line(repr(err.get("input")), 40)
        return RequestError(422, f"{where}.{name}: must be {want}, got {got}{more}")
