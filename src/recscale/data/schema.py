"""One schema for a CTR dataset: a 0/1 label, dense float features, sparse categorical features.

Every reader yields ``pyarrow.RecordBatch`` es in one *raw* layout described by a ``Schema``:

- ``label`` (always this name, whatever the source calls it): float32, values 0.0 or 1.0, no nulls;
- ``weight`` (always this name; only when the schema names a ``weight`` column): the row's importance weight,
  float32, finite and >= 0, no nulls (a missing cell is a bad row: no default is safer than a silent 1);
- each dense feature: float32, null = missing (filled by preprocessing);
- each single-id sparse feature: string or int64, null = missing;
- each multi-id sparse feature: ``list<string>`` or ``list<int64>`` (empty list = missing); an empty id
  (``""`` or null) is dropped by every reader (``readers.base.drop_empty_ids``), a sequence's is a bad row;
- a weighted multi-id feature also has ``{name}__w``: ``list<float32>`` aligned with the ids;
- a sequence feature (``max_len`` set: an ordered id list such as a user history, oldest first) is a
  multi-id feature whose order matters: at most ``max_len`` ids, an empty list is an empty history.

Preprocessing (``recscale.data.preprocess``) maps this raw layout to integer ids and float arrays.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from recscale.settings import Settings

WEIGHT_SUFFIX = "__w"
LABEL = "label"
WEIGHT = "weight"  # the raw column of a row's importance weight (``Schema.weight``), as LABEL is the label's
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
# A sparse feature's name is the stem of its split files, the longest NAME.offsets.bin: a file name is at most
# 255 bytes on common file systems (ext4, XFS, APFS, NTFS).
MAX_NAME_BYTES = 255 - len(".offsets.bin")


class DenseFeature(Settings):
    """A float feature. ``transform`` is applied after ``fill`` replaces missing values: ``log1p`` is
    log(1 + max(x, 0)), a negative value counting as 0 (Criteo's counts; the DLRM reference clips so).

    ``scale`` is applied last, with statistics of the filled and transformed values fitted on the training
    split only (kept in the fitted ``Preprocessor``): ``standard`` is (x - mean) / std (population std),
    ``minmax`` is (x - min) / (max - min), training values then in [0, 1]. A column constant in training
    is only shifted (0 on the training rows), with a warning."""

    name: str
    transform: Literal["none", "log1p"] = "none"
    fill: float = 0.0
    scale: Literal["none", "standard", "minmax"] = "none"

    @model_serializer(mode="wrap")
    def _omit_no_scale(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Dumped without ``scale: none``: schemas (config.yaml, preprocess.json, the digests and fingerprints
        # made from them) read the same as before the key existed, so earlier runs and splits stay valid.
        out: dict[str, object] = handler(self)
        if self.scale == "none":
            out.pop("scale", None)
        return out

    @field_validator("fill")
    @classmethod
    def _fill_fits_float32(cls, v: float) -> float:
        # Dense values are float32: a larger fill is infinite there, and its rows' loss NaN.
        if abs(v) > FLOAT32_MAX:
            raise ValueError(
                f"fill {v:g} is beyond float32's range (+-3.4e38), where dense values are kept; give a smaller one"
            )
        return v


class SparseFeature(Settings):
    """A categorical feature: one id per row, or a list of ids (``multi``) with optional weights."""

    name: str
    multi: bool = False
    weighted: bool = False
    # Separator of ids inside one CSV cell for multi-id features, e.g. "a|b|c".
    sep: str = Field("|", min_length=1)
    # Vocabulary: ids seen fewer than min_count times in training map to the OOV id 0.
    min_count: int = Field(1, ge=1)
    # Optional cap on the vocabulary (most frequent ids kept).
    max_vocab: int | None = Field(None, ge=1)
    # Hash ids into this many buckets instead of building a vocabulary (huge vocabularies).
    hash_buckets: int | None = Field(None, ge=1)
    # A sequence: an ordered id list (oldest first) embedded position by position. A longer list keeps
    # its last (most recent) max_len ids; readers count the rows they truncate.
    max_len: int | None = Field(None, ge=1)
    # Map ids with another field's vocabulary instead of fitting one (e.g. a history of items with
    # item_id's): the same id is the same row in both; sequences sharing it also share a table.
    vocabulary: str | None = None

    @model_validator(mode="after")
    def _weights_need_multi(self) -> SparseFeature:
        # The name names the feature's embedding table (a module: no '.') and its column files (no '/').
        if not self.name or any(c in self.name for c in "./\0"):
            raise ValueError(
                f"sparse feature name {self.name!r} must be non-empty and hold no '.', '/' or NUL (it names the "
                "feature's embedding table and files); rename the column in the data"
            )
        # Longer, materialising failed with 'File name too long (the path is too long; choose a shorter one)'.
        if len(self.name.encode()) > MAX_NAME_BYTES:
            raise ValueError(
                f"sparse feature name '{self.name[:40]}...' is {len(self.name.encode())} bytes, and it names the "
                f"feature's files (NAME.offsets.bin), whose names a file system caps at 255 bytes: at most "
                f"{MAX_NAME_BYTES} bytes; rename the column in the data"
            )
        if self.weighted and not self.multi:
            raise ValueError(f"sparse feature '{self.name}': weighted=true needs multi=true")
        # Another separator than the default (a run's config.yaml spells every default out) on one id a cell.
        if self.sep != "|" and not self.multi:
            raise ValueError(
                f"sparse feature '{self.name}': sep splits a multi-id cell; set multi=true or drop sep"
            )
        if self.weighted and ":" in self.sep:  # a weighted entry is id:weight: 'a:0.5:b' would split wrongly
            raise ValueError(
                f"sparse feature '{self.name}': sep {self.sep!r} holds ':', which separates a weighted id from its "
                "weight (id:weight); choose another sep, e.g. '|'"
            )
        if self.hash_buckets is not None and (self.min_count != 1 or self.max_vocab is not None):
            # Hashing builds no vocabulary: a rare id keeps its bucket, and there is nothing to cap.
            raise ValueError(
                f"sparse feature '{self.name}': hash_buckets hashes every id (no vocabulary), so min_count and "
                "max_vocab would be ignored; drop them, or drop hash_buckets"
            )
        if self.max_len is not None and (not self.multi or self.weighted):
            raise ValueError(
                f"sparse feature '{self.name}': a sequence (max_len) needs multi=true and weighted=false"
            )
        return self

    @property
    def sequence(self) -> bool:
        return self.max_len is not None


class Schema(Settings):
    """The fields of a dataset, in model order."""

    # Name of the label column in the source file; readers always output it as ``label``.
    label: str = Field("label", min_length=1)
    # Name of a column of per-row importance weights (CSV and Parquet), output as ``weight``: the training
    # loss and the metrics weigh each row by it. None: every row weighs 1.
    weight: str | None = Field(None, min_length=1)
    dense: list[DenseFeature] = []
    sparse: list[SparseFeature] = []

    @model_serializer(mode="wrap")
    def _omit_no_weight(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Dumped without ``weight: null``: a schema without weights reads as before the key existed, so the
        # digests and fingerprints made from it (preprocess.json, materialised splits) stay valid.
        out: dict[str, object] = handler(self)
        if self.weight is None:
            out.pop("weight", None)
        return out

    @model_validator(mode="after")
    def _unique_names(self) -> Schema:
        names = [self.label, *([self.weight] if self.weight is not None else [])]
        names += self.dense_names + self.sparse_names
        dup = sorted({n for n in names if names.count(n) > 1})
        if self.weight is not None and self.weight in [self.label, *self.dense_names, *self.sparse_names]:
            # A column of weights read as an input too: the model would learn from its own importance weights.
            role = "the label" if self.weight == self.label else "a feature"
            raise ValueError(
                f"'{self.weight}' is the row-weight column (schema.weight) and {role} too; a column is one or the "
                "other: drop it from the features (or name another column as schema.weight)"
            )
        if dup:
            raise ValueError(f"feature names must be unique; repeated: {', '.join(dup)}")
        raw = self.column_names()  # the readers' output: the label as LABEL, weights as NAME__w
        clash = sorted({n for n in raw if raw.count(n) > 1})
        if clash:
            raise ValueError(
                f"feature name(s) {', '.join(clash)} clash with a column recscale makes: '{LABEL}' holds the label "
                f"(read from '{self.label}'), '{WEIGHT}' the row weights (read from schema.weight), "
                f"NAME{WEIGHT_SUFFIX} a weighted feature's weights; rename the column"
            )
        if not self.sparse and not self.dense:
            raise ValueError("the schema has no features: list at least one dense or sparse feature")
        fields = {f.name: f for f in self.sparse}
        for f in self.sparse:
            if f.vocabulary is None:
                continue
            src = fields.get(f.vocabulary)
            if src is None or src is f or src.vocabulary is not None or src.hash_buckets is not None:
                raise ValueError(
                    f"sparse feature '{f.name}': vocabulary must name another sparse feature that fits its own "
                    f"(no hash_buckets, no vocabulary), got {f.vocabulary!r}"
                )
            if f.hash_buckets is not None or f.min_count != 1 or f.max_vocab is not None:
                raise ValueError(
                    f"sparse feature '{f.name}': with vocabulary: {f.vocabulary} it takes that field's ids; "
                    "drop its hash_buckets, min_count and max_vocab"
                )
        return self

    @property
    def dense_names(self) -> list[str]:
        return [f.name for f in self.dense]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    def column_names(self) -> list[str]:
        """Raw column names in reader output order."""
        return [LABEL, *([WEIGHT] if self.weight is not None else []), *self.feature_columns()]

    def feature_columns(self) -> list[str]:
        """The raw columns a model reads (``column_names`` without the label and the row weight)."""
        cols = [*self.dense_names]
        for f in self.sparse:
            cols.append(f.name)
            if f.weighted:
                cols.append(f.name + WEIGHT_SUFFIX)
        return cols
