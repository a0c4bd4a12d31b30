"""Readers: every format's happy path, streaming, the real Frappe/MovieLens files, and bad input."""

import datetime
import decimal
import gzip
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recscale.data.readers import FORMATS, NoRows, ReadStats, options_model, raw_arrow_schema, read_batches
from recscale.data.schema import DenseFeature, Schema, SparseFeature
from recscale.errors import ConfigError, DataError

FRAPPE_COLUMNS = "user,item,daytime,weekday,isweekend,homework,cost,weather,country,city".split(",")


def make_schema(dense=(), sparse=(), multi=(), weighted=(), label="label") -> Schema:
    return Schema(
        label=label,
        dense=[DenseFeature(name=n) for n in dense],
        sparse=[SparseFeature(name=n) for n in sparse]
        + [SparseFeature(name=n, multi=True) for n in multi]
        + [SparseFeature(name=n, multi=True, weighted=True) for n in weighted],
    )


def read_all(path, fmt, schema, options=None, chunk_rows=65536, **kw) -> pa.Table:
    """All batches as one table; checks every batch has the raw layout and the size bound."""
    batches = list(read_batches(path, fmt, schema, options, chunk_rows=chunk_rows, **kw))
    for b in batches:
        assert b.schema == raw_arrow_schema(schema)
        assert b.num_rows <= chunk_rows
    return pa.Table.from_batches(batches, schema=raw_arrow_schema(schema))


def write(path: Path, lines: list[str], newline: str = "\n") -> Path:
    path.write_bytes(newline.join(lines).encode() + newline.encode())
    return path


# ---------------------------------------------------------------- csv

CSV_SCHEMA = make_schema(
    dense=["price"], sparse=["user", "city"], multi=["tags"], weighted=["hist"], label="click"
)


def test_csv_happy_path_crlf_multi_and_weighted(tmp_path):
    path = write(
        tmp_path / "t.csv",
        [
            "city,click,user,price,tags,hist,unused",
            "7,1,007,1.5,a|b,x:0.5|y:2,z",
            "8,0,12,,,x,z",
            "9,1,3,-2e3,c||d|,,z",
        ],
        newline="\r\n",
    )
    t = read_all(path, "csv", CSV_SCHEMA).to_pydict()
    assert list(t) == ["label", "price", "user", "city", "tags", "hist", "hist__w"]
    assert t["label"] == [1.0, 0.0, 1.0]
    assert t["price"] == [1.5, None, -2000.0]
    assert t["user"] == ["007", "12", "3"]  # ids stay strings, leading zeros kept
    assert t["city"] == ["7", "8", "9"]
    assert t["tags"] == [["a", "b"], [], ["c", "d"]]
    assert t["hist"] == [["x", "y"], ["x"], []]
    assert t["hist__w"] == [[0.5, 2.0], [1.0], []]


def test_csv_streams_in_chunks(tmp_path):
    path = write(tmp_path / "t.csv", ["label,a"] + [f"{i % 2},{i}" for i in range(10)])
    batches = list(read_batches(path, "csv", make_schema(sparse=["a"]), chunk_rows=3))
    assert [b.num_rows for b in batches] == [3, 3, 3, 1]
    assert [x for b in batches for x in b.column("a").to_pylist()] == [str(i) for i in range(10)]


def test_csv_delimiter_option_and_gzip(tmp_path):
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(b"label;a;x\n1;p;0.25\n0;q;3\n"))
    t = read_all(path, "csv", make_schema(dense=["x"], sparse=["a"]), {"delimiter": ";"}).to_pydict()
    assert t == {"label": [1.0, 0.0], "x": [0.25, 3.0], "a": ["p", "q"]}


def test_a_damaged_compressed_or_parquet_file_is_one_line_naming_it(tmp_path):
    """pyarrow's decompression errors name no file: 'error: Truncated compressed stream (check the path and
    the disk)' left the user to guess which of the run's files it was."""
    whole = gzip.compress(b"label,a\n" + b"".join(b"%d,u%d\n" % (i % 2, i) for i in range(50_000)))
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"cut\.csv\.gz: Truncated compressed stream \(a file cut short"):
        read_all(cut, "csv", make_schema(sparse=["a"]))
    # A damaged Parquet page: its error named no file either.
    pq.write_table(pa.table({"label": [i % 2 for i in range(1000)], "a": [f"u{i}" for i in range(1000)]}),
                   tmp_path / "t.parquet", row_group_size=500)  # fmt: skip
    damaged = bytearray((tmp_path / "t.parquet").read_bytes())
    page = pq.ParquetFile(tmp_path / "t.parquet").metadata.row_group(1).column(1).data_page_offset
    damaged[page : page + 8] = b"\xff" * 8
    (tmp_path / "t.parquet").write_bytes(damaged)
    with pytest.raises(
        DataError, match=r"t\.parquet: Couldn't deserialize thrift: .* \(a file cut short or damaged"
    ):
        read_all(tmp_path / "t.parquet", "parquet", make_schema(sparse=["a"]))
    plain = tmp_path / "plain.csv.gz"
    plain.write_bytes(b"label,a\n1,u\n")
    with pytest.raises(DataError, match=r"plain\.csv\.gz: .*inflate failed"):
        read_all(plain, "csv", make_schema(sparse=["a"]))


def test_csv_many_blocks_keep_exact_lines(tmp_path, monkeypatch):
    # Small text chunks so rows cross chunk boundaries; the bad row's line must still be exact.
    monkeypatch.setattr("recscale.data.readers.text.BLOCK_BYTES", 64)
    lines = ["label,a"] + [f"{i % 2},{i}" for i in range(200)]
    lines[150] = "maybe,x"
    path = write(tmp_path / "t.csv", lines)
    with pytest.raises(DataError, match=r"t\.csv line 151: label 'maybe' is not 0 or 1"):
        read_all(path, "csv", make_schema(sparse=["a"]))
    stats = ReadStats()
    t = read_all(path, "csv", make_schema(sparse=["a"]), on_bad_row="skip", stats=stats, chunk_rows=7)
    assert (t.num_rows, stats.rows, stats.skipped) == (199, 199, 1)


# ---------------------------------------------------------------- libsvm


def test_libsvm_fields_mode(tmp_path):
    path = write(tmp_path / "t.libfm", ["1 3:1 10:1 20:1", "-1 4:1 11:1 21:1", "", "0 5:1 12:1 22:1"])
    t = read_all(path, "libsvm", make_schema(sparse=["u", "i", "c"])).to_pydict()
    assert t == {
        "label": [1.0, 0.0, 0.0],
        "u": ["3", "4", "5"],
        "i": ["10", "11", "12"],
        "c": ["20", "21", "22"],
    }


def test_libsvm_bag_mode(tmp_path):
    path = write(tmp_path / "t.svm", ["-1 1:0.5 7:2", "+1 3:1", "1"], newline="\r\n")
    t = read_all(path, "libsvm", make_schema(weighted=["f"]), {"mode": "bag"}).to_pydict()
    assert t == {"label": [0.0, 1.0, 1.0], "f": [["1", "7"], ["3"], []], "f__w": [[0.5, 2.0], [1.0], []]}


def test_a_byte_order_mark_is_no_part_of_the_first_line(tmp_path):
    """A UTF-8 BOM (Notepad's "UTF-8") made libsvm's line 1 bad, "label '\\ufeff1' is not -1, 0 or 1", where
    CSV and Criteo, whose parser skips it, read the same file's first line."""
    bom = "\ufeff"
    path = write(tmp_path / "t.svm", [f"{bom}1 3:1 10:1", "0 4:1 11:1"])
    t = read_all(path, "libsvm", make_schema(sparse=["u", "i"])).to_pydict()
    assert t == {"label": [1.0, 0.0], "u": ["3", "4"], "i": ["10", "11"]}
    path = write(tmp_path / "bag.svm.gz", [])
    path.write_bytes(gzip.compress(f"{bom}1 3:2\n".encode()))
    assert read_all(path, "libsvm", make_schema(weighted=["f"]), {"mode": "bag"}).to_pydict()["f"] == [["3"]]
    criteo = "\t".join(["1", *["2"] * 13, *["a"] * 26])
    path = write(tmp_path / "c.txt", [bom + criteo])
    assert read_all(path, "criteo", make_schema(dense=["I1"], sparse=["C1"])).to_pydict()["label"] == [1.0]


def test_libsvm_ids_read_as_every_format_reads_them(tmp_path):
    """An idx written 3.0 was id "3.0" in libsvm, where CSV and Parquet read it as id 3."""
    path = write(tmp_path / "t.libfm", ["1 3.0:1 007:1", "0 3:1 -2.00:1"])
    t = read_all(path, "libsvm", make_schema(sparse=["u", "i"])).to_pydict()
    assert t == {"label": [1.0, 0.0], "u": ["3", "3"], "i": ["007", "-2"]}
    t = read_all(path, "libsvm", make_schema(weighted=["f"]), {"mode": "bag"}).to_pydict()
    assert t["f"] == [["3", "007"], ["3", "-2"]]


def test_libsvm_streams_in_chunks(tmp_path):
    path = write(tmp_path / "t.svm", [f"{2 * (i % 2) - 1} {i}:1" for i in range(25)])
    batches = list(read_batches(path, "libsvm", make_schema(sparse=["a"]), chunk_rows=10))
    assert [b.num_rows for b in batches] == [10, 10, 5]
    assert sum(pa.compute.sum(b.column("label")).as_py() for b in batches) == 12


@pytest.mark.parametrize(
    ("options", "schema"),
    [
        ({"mode": "bag"}, make_schema(multi=["f"])),  # bag needs weighted
        ({"mode": "bag"}, make_schema(weighted=["f", "g"])),  # bag needs exactly one feature
        ({}, make_schema(multi=["f"])),  # fields reads single ids
        ({}, make_schema(dense=["x"], sparse=["f"])),  # no dense features in libsvm
    ],
)
def test_libsvm_schema_must_fit_mode(tmp_path, options, schema):
    path = write(tmp_path / "t.svm", ["1 1:1"])
    with pytest.raises(DataError, match="libsvm"):
        read_batches(path, "libsvm", schema, options)


# ---------------------------------------------------------------- criteo

CRITEO_SCHEMA = make_schema(dense=[f"I{i}" for i in range(1, 14)], sparse=[f"C{i}" for i in range(1, 27)])


def criteo_line(label="1", ints=None, cats=None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *ints, *cats])


def test_criteo_tsv(tmp_path):
    ints = ["-1", ""] + [str(i) for i in range(11)]
    cats = ["68fd1e64", ""] + [f"{i:08x}" for i in range(24)]
    path = write(tmp_path / "day_0.txt", [criteo_line("0", ints, cats), criteo_line()])
    t = read_all(path, "criteo", CRITEO_SCHEMA).to_pydict()
    assert t["label"] == [0.0, 1.0]
    assert t["I1"] == [-1.0, 0.0] and t["I2"] == [None, 1.0]
    assert t["C1"] == ["68fd1e64", "00000000"] and t["C2"] == [None, "00000001"]
    assert len(t) == 40


def test_criteo_without_labels_reads_the_test_files_layout(tmp_path):
    """`recscale predict` reads without labels (every row's label 0): a Criteo test file's 39 fields a line
    (no label field), and a labelled file's 40 alike, the label not read."""
    from recscale.data.readers.base import unlabelled

    ints = ["-1", ""] + [str(i) for i in range(11)]
    cats = ["68fd1e64", ""] + [f"{i:08x}" for i in range(24)]
    lines = [criteo_line("1", ints, cats), criteo_line()]
    test = write(tmp_path / "test.txt", [line.split("\t", 1)[1] for line in lines])
    labelled = write(tmp_path / "train.txt", lines)
    got = [read_all(p, "criteo", unlabelled(CRITEO_SCHEMA)).to_pydict() for p in (test, labelled)]
    assert got[0] == got[1] and got[0]["label"] == [0.0, 0.0]
    assert got[0]["I1"] == [-1.0, 0.0] and got[0]["C1"] == ["68fd1e64", "00000000"]


def test_criteo_subset_of_columns(tmp_path):
    path = write(tmp_path / "t.txt", [criteo_line()] * 5)
    t = read_all(path, "criteo", make_schema(dense=["I3"], sparse=["C26"]), chunk_rows=2)
    assert t.column_names == ["label", "I3", "C26"] and t.num_rows == 5


def test_criteo_unknown_feature_is_an_error(tmp_path):
    path = write(tmp_path / "t.txt", [criteo_line()])
    with pytest.raises(DataError, match=r"'I14'.*label, I1, I2"):
        read_batches(path, "criteo", make_schema(dense=["I14"]))


# Dense cells a float parse accepts only oddly (spaces, signs, no digits before or after the point,
# exponents, long mantissas, underflow) and cells that are bad (not numbers, NaN, infinite, overflow).
ODD_NUMBERS = [" 1.5", "2.5 ", "+.5", "1e-3", "5.", "-0", "1E+05", "00012", "3.14159265358979323846264338",
               "1e-400", "4.9e-324", "-7", '"8"', '" 9"']  # fmt: skip
BAD_NUMBERS = ["abc", "nan", "-inf", "Infinity", "1e400", "0x10", "--1", "1.2.3", "1e", "\u00a01", "nan(1)"]


@pytest.mark.parametrize("fmt", ["criteo", "csv"])
@pytest.mark.parametrize("on_bad_row", ["skip", "error"])
def test_numbers_parsed_by_the_csv_reader_read_as_text_casts_do(tmp_path, monkeypatch, fmt, on_bad_row):
    """Label and dense columns are parsed as float64 while reading, a chunk with a bad row is parsed
    again as text: rows, values, dropped rows and messages are those of the text-only parse."""
    import recscale.data.readers.text as text

    rng = np.random.default_rng(3)
    cells = (
        ODD_NUMBERS + BAD_NUMBERS if fmt == "csv" else [c for c in ODD_NUMBERS + BAD_NUMBERS if '"' not in c]
    )
    sep = "," if fmt == "csv" else "\t"
    lines = ["label," + ",".join(f"I{i}" for i in range(1, 14)) + ",C1"] if fmt == "csv" else []
    for i in range(3000):
        ints = [str(int(v)) for v in rng.integers(-5, 100, 13)]
        if rng.random() < 0.3:
            ints[int(rng.integers(13))] = (
                ODD_NUMBERS[int(rng.integers(len(ODD_NUMBERS)))] if fmt == "csv" else ""
            )
        label = "1" if rng.random() < 0.5 else "0"
        if rng.random() < 0.004:  # a bad row: in about one chunk in three
            if rng.random() < 0.2:
                label = ("2", "", "x")[int(rng.integers(3))]
            else:
                ints[int(rng.integers(13))] = cells[int(rng.integers(len(cells)))]
        cats = [f"{i % 7:x}"] + ([f"{j}" for j in range(25)] if fmt == "criteo" else [])
        lines.append(sep.join([label, *ints, *cats]))
    path = write(tmp_path / f"t.{fmt}", lines)
    schema = make_schema(dense=[f"I{i}" for i in range(1, 14)], sparse=["C1"])
    monkeypatch.setattr(text, "BLOCK_BYTES", 4000)

    def read() -> tuple[pa.Table | str, ReadStats]:
        stats = ReadStats()
        try:
            return read_all(path, fmt, schema, chunk_rows=500, on_bad_row=on_bad_row, stats=stats), stats
        except DataError as e:
            return str(e), stats

    got = read()
    as_text = text._convert_options
    monkeypatch.setattr(text, "_convert_options", lambda include, numbers=(): as_text(include))
    want = read()
    assert got[1] == want[1]
    assert got[0] == want[0] if isinstance(want[0], str) else got[0].equals(want[0])
    if on_bad_row == "skip":
        assert 0 < want[1].skipped < 100


# ---------------------------------------------------------------- parquet


def test_parquet(tmp_path):
    table = pa.table(
        {
            "label": pa.array([1, 0, 1, 0, 1], pa.int64()),
            "price": [1.0, None, 2.5, 3.0, 4.0],
            "user": pa.array([10, 11, None, 13, 14], pa.int64()),
            "city": pa.array(["a", "b", "c", "d", "e"], pa.large_string()),
            "tags": [[1, 2], [], None, [3], [4, 5]],
            "hist": [["x"], ["y", "z"], [], None, ["w"]],
            "hist__w": [[0.5], [1.0, 2.0], [], None, [3.0]],
            "extra": [0] * 5,
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=2)
    schema = make_schema(dense=["price"], sparse=["user", "city"], multi=["tags"], weighted=["hist"])
    batches = list(read_batches(path, "parquet", schema, chunk_rows=2))
    assert [b.num_rows for b in batches] == [2, 2, 1]
    t = read_all(path, "parquet", schema, chunk_rows=2).to_pydict()
    assert t["label"] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert t["price"] == [1.0, None, 2.5, 3.0, 4.0]
    assert t["user"] == ["10", "11", None, "13", "14"]
    assert t["city"] == ["a", "b", "c", "d", "e"]
    assert t["tags"] == [["1", "2"], [], [], ["3"], ["4", "5"]]
    assert t["hist__w"] == [[0.5], [1.0, 2.0], [], [], [3.0]]


def test_empty_ids_of_a_multi_id_feature_are_dropped_by_every_reader_with_their_weights(tmp_path):
    """CSV read `x|` as ['x'], a Parquet list ['x', ''] as ['x', ''] ("" an id of its own): they agree now,
    a null id is dropped too, and a weighted feature loses the empty ids' weights with them."""
    schema = make_schema(multi=["t"], weighted=["h"])
    write(tmp_path / "t.csv", ["label,t,h", "1,x|,a:1|:2|b:3", "0,|,:4", "1,y,"])
    t = pa.array([["x", ""], ["", None], ["y"]])
    h, w = pa.array([["a", "", "b"], [None], []]), pa.array([[1.0, 2.0, 3.0], [4.0], []])
    pq.write_table(pa.table({"label": [1, 0, 1], "t": t, "h": h, "h__w": w}), tmp_path / "t.parquet")
    expected = {"t": [["x"], [], ["y"]], "h": [["a", "b"], [], []], "h__w": [[1.0, 3.0], [], []]}
    for fmt in ("csv", "parquet"):
        got = read_all(tmp_path / f"t.{fmt}", fmt, schema, chunk_rows=2).to_pydict()
        assert {k: got[k] for k in expected} == expected, fmt


def test_parquet_misaligned_weights_are_bad_rows(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"label": [1, 0], "h": [["a", "b"], ["c"]], "h__w": [[1.0], [2.0]]}), path)
    with pytest.raises(DataError, match=r"row 1: sparse feature 'h' has 2 ids but 1 weights"):
        read_all(path, "parquet", make_schema(weighted=["h"]))
    stats = ReadStats()
    assert (
        read_all(path, "parquet", make_schema(weighted=["h"]), on_bad_row="skip", stats=stats).num_rows == 1
    )


@pytest.mark.parametrize(
    "column, schema, message",
    [
        (
            [[[1], [2]]] * 2,
            make_schema(multi=["h"]),
            r"column 'h' is list<element: list<.*must hold a list of ids",
        ),
        (
            [{"a": 1}] * 2,
            make_schema(multi=["h"]),
            r"column 'h' is struct<a: int64>; it must hold a list of ids",
        ),
        ([True, False], make_schema(multi=["h"]), r"column 'h' is bool; it must hold a list of ids"),
        ([[1], [2]], make_schema(sparse=["h"]), r"column 'h' is list<.*one id per row .*set multi: true"),
        (
            [[1.0], [2.0]],
            make_schema(dense=["h"]),
            r"column 'h' is list<.*one number per row \(a dense feature\)",
        ),
        (
            [datetime.date(2024, 1, 1)] * 2,
            make_schema(dense=["h"]),
            r"column 'h' is date32\[day\]; it must hold one number per row \(a dense feature\)",
        ),
    ],
)
def test_parquet_column_of_the_wrong_type_is_one_line(tmp_path, column, schema, message):
    # A column no conversion can read was an internal error (ArrowNotImplementedError) mid-read.
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"label": [1, 0], "h": column}), path)
    with pytest.raises(DataError, match=r"t\.parquet: " + message):
        read_batches(path, "parquet", schema)


def test_a_parquet_column_of_type_null_is_missing_values_for_every_feature(tmp_path):
    """pyarrow types a column of nothing but nulls (new rows without any tags, say) as null: a multi-id
    feature refused it ("column 'h' is null; it must hold a list of ids"), where a single-id, dense or
    list column of nulls read as missing."""
    path = tmp_path / "t.parquet"
    schema = Schema(
        dense=[DenseFeature(name="s")],
        sparse=[
            SparseFeature(name="h", multi=True),
            SparseFeature(name="w", multi=True, weighted=True),
            SparseFeature(name="q", multi=True, max_len=3),
        ],
    )
    pq.write_table(pa.table({n: pa.nulls(2) for n in ("h", "w", "q", "s")} | {"label": [1, 0]}), path)
    t = read_all(path, "parquet", schema).to_pydict()
    assert (t["h"], t["w"], t["w__w"], t["q"], t["s"]) == (
        [[], []],
        [[], []],
        [[], []],
        [[], []],
        [None, None],
    )


def test_parquet_numbers_of_any_type_are_read_or_bad_rows(tmp_path):
    # An integer beyond 2**53 (no float holds it exactly) and bytes that are no number were internal errors
    # (ArrowNotImplementedError: utf8_trim_whitespace has no kernel for int64 / binary).
    path = tmp_path / "t.parquet"
    table = {
        "label": pa.array([1, 2**60, 0, 1], pa.int64()),
        "x": pa.array([2**53 + 1, 1, 2, 3], pa.int64()),
        "b": pa.array([b"1.5", b"2", b"\xff", b"x"], pa.binary()),
    }
    pq.write_table(pa.table(table), path)
    stats = ReadStats()
    t = read_all(path, "parquet", make_schema(dense=["x", "b"]), on_bad_row="skip", stats=stats).to_pydict()
    assert t == {"label": [1.0], "x": [float(np.float32(2**53))], "b": [1.5]}
    assert [e.removeprefix(f"{path} ") for e in stats.examples] == [
        "row 2: label 1152921504606846976 is not 0 or 1",
        "row 3: dense feature 'b' value b'\\xff' is not a number",
        "row 4: dense feature 'b' value b'x' is not a number",
    ]


def test_parquet_fixed_size_and_dictionary_columns(tmp_path):
    path = tmp_path / "t.parquet"
    table = pa.table(
        {
            "label": [1, 0],
            "u": pa.array(["a", "b"]).dictionary_encode(),
            "h": pa.array([[1, 2], [3, 4]], pa.list_(pa.int32(), 2)),
            "g": pa.array(["1|2", "3"]).dictionary_encode(),
        }
    )
    pq.write_table(table, path)
    t = read_all(path, "parquet", make_schema(sparse=["u"], multi=["h", "g"])).to_pydict()
    assert (t["u"], t["h"], t["g"]) == (["a", "b"], [["1", "2"], ["3", "4"]], [["1", "2"], ["3"]])


def test_parquet_bytes_that_are_not_utf8_are_bad_rows(tmp_path):
    path = tmp_path / "t.parquet"
    ids = pa.array([b"a", b"\xff\xfe", b"b", None], pa.binary())
    history = pa.array([[b"x"], None, [b"y", b"\xc3"], [b"z"]], pa.list_(pa.binary()))
    pq.write_table(pa.table({"label": [1, 0, 1, 0], "u": ids, "h": history}), path)
    schema = make_schema(sparse=["u"], multi=["h"])
    with pytest.raises(
        DataError, match=r"t\.parquet row 2: sparse feature 'u' id b'\\xff\\xfe' is not UTF-8"
    ):
        read_all(path, "parquet", schema)
    with pytest.raises(DataError, match=r"t\.parquet row 3: sparse feature 'h' id b'\\xc3' is not UTF-8"):
        read_all(path, "parquet", make_schema(multi=["h"]))
    stats = ReadStats()
    t = read_all(path, "parquet", schema, on_bad_row="skip", stats=stats).to_pydict()
    assert stats.skipped == 2 and t["u"] == ["a", None] and t["h"] == [["x"], ["z"]]


def test_parquet_float_ids_are_the_integers_they_hold(tmp_path):
    # A list<double> history was read as ids like "1.5"; a float id column's 1e15 was "1e+15" where the
    # integer 10**15 is "1000000000000000" (and a scoring request's ids are integers or strings).
    path = tmp_path / "t.parquet"
    ids = pa.array([1.0, -0.0, 1e15, None, 7.0])
    history = pa.array([[1.0, 2.0], None, [3.0, None], [], [4.0]], pa.list_(pa.float32()))
    pq.write_table(pa.table({"label": [1, 0, 1, 0, 1], "u": ids, "h": history}), path)
    t = read_all(path, "parquet", make_schema(sparse=["u"], multi=["h"])).to_pydict()
    assert t["u"] == ["1", "0", "1000000000000000", None, "7"]
    assert t["h"] == [["1", "2"], [], ["3"], [], ["4"]]  # a null id is no id: dropped, as CSV's 3| is ['3']

    ids = pa.array([1.0, 2.5, 3.0, float("nan"), 2.0**60, 4.0])
    history = pa.array([[1.0], [2.0], [3.0, 1.5], [4.0], [5.0], [6.0]], pa.list_(pa.float64()))
    pq.write_table(pa.table({"label": [1, 0, 1, 0, 1, 0], "u": ids, "h": history}), path)
    tail = (
        r" \(its column is {}; ids are integers or strings, a float column's read as the integers it holds\)"
    )
    with pytest.raises(
        DataError,
        match=r"t\.parquet row 3: sparse feature 'h' id 1\.5 is not a whole number"
        + tail.format("list<element: double>"),
    ):
        read_all(path, "parquet", make_schema(multi=["h"]))
    with pytest.raises(
        DataError,
        match=r"t\.parquet row 2: sparse feature 'u' id 2\.5 is not a whole number" + tail.format("double"),
    ):
        read_all(path, "parquet", make_schema(sparse=["u"]))
    stats = ReadStats()
    t = read_all(
        path, "parquet", make_schema(sparse=["u"], multi=["h"]), on_bad_row="skip", stats=stats
    ).to_pydict()
    assert stats.skipped == 4 and t["u"] == ["1", "4"] and t["h"] == [["1"], ["6"]]
    assert stats.examples[2].startswith(f"{path} row 4: sparse feature 'u' id nan is not a whole number")
    assert "id 1.152921504606847e+18 is beyond 2**53" in stats.examples[3]


def test_csv_and_parquet_of_one_table_read_the_same_ids(tmp_path):
    """A float id 3.0 was "3" in Parquet but "3.0" in CSV (as pandas writes a float column), a decimal 12 was
    "12.0", and "" an id in Parquet but missing in CSV: a model trained on one file met OOV ids in the other.
    The rule now: "" is missing, and a whole number with a zero fraction is the integer's id, in both."""
    table = pa.table(
        {
            "label": [1, 0, 1, 0],
            "f": pa.array([3.0, None, 12.0, -0.0]),
            "d": pa.array(
                [decimal.Decimal("12.0"), decimal.Decimal("3.5"), None, decimal.Decimal("-4.0")],
                pa.decimal128(5, 1),
            ),  # fmt: skip
            "s": ["", "x", None, "007"],
            "m": pa.array([[3.0, 4.0], [], None, [5.0]]),
            "t": [["a", ""], ["3.0"], [], ["b"]],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    # The same table as CSV, floats and decimals written with their fraction as pandas does.
    csv_path = write(
        tmp_path / "t.csv",
        [
            "label,f,d,s,m,t",
            '1,3.0,12.0,"",3.0|4.0,a|',
            "0,,3.5,x,,3.0",
            "1,12.0,,,,",
            "0,-0.0,-4.0,007,5.0,b",
        ],
    )
    schema = make_schema(sparse=["f", "d", "s"], multi=["m", "t"])
    from_csv = read_all(csv_path, "csv", schema).to_pydict()
    from_parquet = read_all(tmp_path / "t.parquet", "parquet", schema).to_pydict()
    assert from_csv == from_parquet
    assert from_csv["f"] == ["3", None, "12", "0"] and from_csv["d"] == ["12", "3.5", None, "-4"]
    assert from_csv["s"] == [None, "x", None, "007"]
    assert from_csv["m"] == [["3", "4"], [], [], ["5"]] and from_csv["t"] == [["a"], ["3"], [], ["b"]]


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PK\x03\x04\0\0 not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        read_batches(path, "parquet", make_schema(sparse=["a"]))
    # A CSV file (a Parquet run's CSV export scored by eval without --format csv) was "not a readable parquet
    # file: Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file."
    text = write(tmp_path / "t.csv", ["label,a", "1,2"])
    with pytest.raises(DataError) as err:
        read_batches(text, "parquet", make_schema(sparse=["a"]))
    assert str(err.value) == (
        f"{text} is not a parquet file but text; if it is a CSV file, read it with data.format=csv"
    )


# ---------------------------------------------------------------- movielens (small, written here)


def write_movielens(root: Path, inter_rows: list[str]) -> Path:
    root.mkdir()
    write(root / "ml.inter", ["user_id:token\titem_id:token\trating:float\ttimestamp:float", *inter_rows])
    write(root / "ml.user", ["user_id:token\tage:token\tgender:token", "1\t24\tM", "2\t53\tF"])
    write(root / "ml.item", ["item_id:token\tclass:token_seq", "10\tAction Comedy", "11\t"])
    return root


ML_SCHEMA = make_schema(sparse=["user_id", "item_id", "gender"], multi=["class"])


def test_movielens_tokens_follow_the_shared_id_rule(tmp_path):
    """A token written 3.0 trained the id '3.0', which a CSV export of the same rows (3.0 is id 3) scored as
    out of vocabulary; tokens now read as every reader reads a text id, keys of the joins too."""
    root = write_movielens(tmp_path / "ml", ["1.0\t10\t5\t1", "2\t11.00\t3\t2"])
    write(root / "ml.item", ["item_id:token\tclass:token_seq", "10.0\tAction Comedy", "11\t"])
    got = read_all(root, "movielens", ML_SCHEMA, {"split": "all"}).to_pydict()
    assert got["user_id"] == ["1", "2"] and got["item_id"] == ["10", "11"]
    assert got["gender"] == ["M", "F"] and got["class"] == [["Action", "Comedy"], []]  # joined by key


def test_movielens_key_on_two_rows_is_an_error(tmp_path):
    """User 2 twice, with two genders: the join took the first row without a word."""
    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t1", "2\t11\t3\t2"])
    write(root / "ml.user", ["user_id:token\tage:token\tgender:token", "1\t24\tM", "2\t53\tF", "2\t31\tM"])
    with pytest.raises(
        DataError, match=r"ml\.user: 1 key\(s\) on more than one row \('2'\); keep one row per key"
    ):
        read_all(root, "movielens", ML_SCHEMA, {"split": "all"})


def test_movielens_float_feature_beyond_float32_is_a_bad_row_and_an_empty_split_says_so(tmp_path):
    """An age of 1e300 (finite in float64) became inf in float32 and stopped preparation with 'dense features
    hold NaN or infinite values ...; check the fill values', naming no file; a split of fraction 0 was
    'has no data rows', as if the file were empty."""
    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t1", "2\t11\t3\t2"])
    write(root / "ml.user", ["user_id:token\tage:float", "1\t1e300", "2\t53"])
    schema = make_schema(dense=["age"], sparse=["user_id"])
    with pytest.raises(
        DataError, match=r"ml\.user line 2: dense feature 'age' value '1e300' is beyond float32's range"
    ):
        read_all(root, "movielens", schema, {"split": "all"})
    t = read_all(root, "movielens", schema, {"split": "all"}, on_bad_row="skip").to_pydict()
    assert t["age"] == [None, 53.0]  # user 1's row dropped: their rating has a missing age
    with pytest.raises(DataError, match=r"ml\.inter: its test split holds none of its 2 ratings"):
        read_all(root, "movielens", schema, {"split": "test", "fractions": [0.5, 0.5, 0.0]})


def test_movielens_small_join_label_and_split(tmp_path):
    rows = [f"{1 + i % 3}\t{10 + i % 2}\t{1 + i % 5}\t{1000 - i}" for i in range(10)]
    root = write_movielens(tmp_path / "ml", rows)
    t = read_all(root, "movielens", ML_SCHEMA, {"split": "all", "rating_threshold": 3}).to_pydict()
    # Sorted by timestamp: the last written row (timestamp 991) comes first.
    assert t["user_id"][0] == str(1 + 9 % 3) and t["item_id"][0] == str(10 + 9 % 2)
    assert t["label"] == [float(1 + i % 5 >= 3) for i in reversed(range(10))]
    by_user = dict(zip(t["user_id"], t["gender"], strict=True))
    assert by_user == {"1": "M", "2": "F", "3": None}  # user 3 has no row in ml.user
    assert {tuple(c) for c in t["class"]} == {("Action", "Comedy"), ()}
    parts = {
        s: read_all(root, "movielens", ML_SCHEMA, {"split": s, "fractions": [0.6, 0.2, 0.2]})
        for s in ("train", "valid", "test")
    }
    assert [parts[s].num_rows for s in ("train", "valid", "test")] == [6, 2, 2]


def test_movielens_schema_must_match_column_types(tmp_path):
    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t1"])
    with pytest.raises(DataError, match=r"column 'class' is token_seq"):
        read_batches(root, "movielens", make_schema(sparse=["class"]))
    with pytest.raises(DataError, match=r"column 'age' is token"):
        read_batches(root, "movielens", make_schema(dense=["age"]))
    with pytest.raises(DataError, match=r"'nope'.*user_id, item_id, rating, timestamp, age, gender, class"):
        read_batches(root, "movielens", make_schema(sparse=["nope"]))


def test_movielens_rating_and_timestamp_must_be_float_columns(tmp_path):
    """A token timestamp sorted as text ("10" < "100" < "9"): the rating at time 9 got the later ratings
    as its history and the split put it last; a token rating stopped the read with an Arrow error."""
    for name in ("timestamp", "rating"):
        root = write_movielens(tmp_path / name, ["1\t10\t5\t9", "1\t11\t5\t10"])
        header = "user_id:token\titem_id:token\trating:float\ttimestamp:float".replace(
            f"{name}:float", f"{name}:token"
        )
        write(root / "ml.inter", [header, "1\t10\t5\t9", "1\t11\t5\t10"])
        with pytest.raises(DataError, match=rf"ml\.inter line 1: column '{name}' is token.*{name}:float"):
            read_batches(root, "movielens", ML_SCHEMA)


def test_movielens_options_are_validated(tmp_path):
    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t1"])
    with pytest.raises(ConfigError, match="fractions"):
        read_batches(root, "movielens", ML_SCHEMA, {"fractions": [0.5, 0.1, 0.1]})
    with pytest.raises(ConfigError, match="split"):
        read_batches(root, "movielens", ML_SCHEMA, {"split": "dev"})


def test_movielens_fingerprint_sees_a_user_file_rewritten_in_place(tmp_path):
    """A split's fingerprint stat'ed only the directory (or the .inter file): its .user file rewritten in
    place left it unchanged, and a run or data.prepared reused vocabularies of the old features."""
    from recscale.data.sources import source_fingerprint

    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t1"])
    before = {p: source_fingerprint("movielens", str(p), "train", {}) for p in (root, root / "ml.inter")}
    dir_mtime = root.stat().st_mtime_ns
    with open(root / "ml.user", "r+") as f:  # in place: the directory's entries stay as they were
        f.write("user_id:token\tage:token\tgender:token\n1\t99\tM")
    assert root.stat().st_mtime_ns == dir_mtime
    for p, fingerprint in before.items():
        assert source_fingerprint("movielens", str(p), "train", {}) != fingerprint, p


# ---------------------------------------------------------------- real data


def test_frappe_real_files(shared_data):
    schema = make_schema(sparse=FRAPPE_COLUMNS)
    for split, rows, positives in (("train", 202_027, 67_604), ("valid", 57_722, 19_063)):
        stats = ReadStats()
        t = read_all(shared_data / "frappe" / f"{split}.csv", "csv", schema, stats=stats)
        assert (t.num_rows, stats.rows, stats.skipped) == (rows, rows, 0)
        assert pa.compute.sum(t.column("label")).as_py() == positives
        assert t.column("user").null_count == 0


def test_movielens_real_time_split(shared_data):
    schema = make_schema(
        dense=["timestamp"],
        sparse=["user_id", "item_id", "age", "gender", "occupation", "zip_code", "release_year"],
        multi=["class"],
    )
    root = shared_data / "movielens-100k"
    parts = {s: read_all(root, "movielens", schema, {"split": s}) for s in ("train", "valid", "test")}
    assert [parts[s].num_rows for s in ("train", "valid", "test")] == [80_000, 10_000, 10_000]
    pairs = {
        s: set(zip(t["user_id"].to_pylist(), t["item_id"].to_pylist(), strict=True)) for s, t in parts.items()
    }
    assert len(pairs["train"] | pairs["valid"] | pairs["test"]) == 100_000  # disjoint, nothing lost
    ts = {s: t.column("timestamp").to_numpy() for s, t in parts.items()}
    assert all((np.diff(x) >= 0).all() for x in ts.values())
    assert ts["train"].max() <= ts["valid"].min() and ts["valid"].max() <= ts["test"].min()
    everything = read_all(root / "ml-100k.inter", "movielens", schema, {"split": "all"})
    assert everything.num_rows == 100_000
    assert pa.compute.sum(everything.column("label")).as_py() == 55_375  # ratings >= 4
    assert everything.column("age").null_count == 0 and everything.column("class").null_count == 0
    assert ["Animation", "Children's", "Comedy"] in everything.column("class").to_pylist()


# ---------------------------------------------------------------- bad input: always errors


def test_unknown_format_lists_known_ones(tmp_path):
    with pytest.raises(DataError, match="known formats: csv, libsvm, criteo, movielens, parquet"):
        read_batches(tmp_path / "x.csv", "tsv", make_schema(sparse=["a"]))
    assert FORMATS == ("csv", "libsvm", "criteo", "movielens", "parquet")


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_and_empty_files(tmp_path, fmt):
    with pytest.raises(DataError, match="no such file"):
        read_batches(tmp_path / "nope.x", fmt, make_schema(sparse=["a"]))
    empty = tmp_path / ("empty.inter" if fmt == "movielens" else "empty.x")
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\..* is empty") as e:
        read_batches(empty, fmt, make_schema(sparse=["a"]))
    # Headerless formats' empty file has no rows (predict scores it to no scores); the others lack a header.
    assert isinstance(e.value, NoRows) == (fmt in ("criteo", "libsvm"))


def test_header_only_files_have_no_rows(tmp_path):
    path = write(tmp_path / "t.csv", ["label,a"])
    with pytest.raises(DataError, match=r"t\.csv has no data rows"):
        read_all(path, "csv", make_schema(sparse=["a"]))
    root = tmp_path / "ml"
    root.mkdir()
    write(root / "ml.inter", ["user_id:token\titem_id:token\trating:float\ttimestamp:float"])
    with pytest.raises(DataError, match=r"ml\.inter has no data rows"):
        read_all(root, "movielens", make_schema(sparse=["user_id"]))


def test_missing_column_is_named_with_the_file_columns(tmp_path):
    path = write(tmp_path / "t.csv", ["label,user,item", "1,2,3"])
    with pytest.raises(DataError, match=r"t\.csv: column\(s\) 'city'.*its columns are: label, user, item"):
        read_batches(path, "csv", make_schema(sparse=["user", "city"]))
    with pytest.raises(DataError, match=r"'click'"):
        read_batches(path, "csv", make_schema(sparse=["user"], label="click"))
    pq.write_table(pa.table({"label": [1], "user": [2]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"'city'.*its columns are: label, user"):
        read_batches(tmp_path / "t.parquet", "parquet", make_schema(sparse=["city"]))


def test_a_missing_column_names_the_file_column_it_differs_from_by_spaces_or_case(tmp_path):
    """A header written `label, user, Item` has columns ' user' and ' Item': the error listed them as
    `label,  user,  Item`, where the spaces that made `user` missing were hard to see."""
    path = write(tmp_path / "t.csv", ["label, user, Item,city", "1,2,3,4"])
    with pytest.raises(DataError) as err:
        read_batches(path, "csv", make_schema(sparse=["user", "item", "city"]))
    assert str(err.value).endswith(
        "; the file has ' user' (not 'user'), ' Item' (not 'item'): rename them in the file's header or in the schema"
    )
    with pytest.raises(DataError) as err:  # no look-alike: no hint
        read_batches(path, "csv", make_schema(sparse=["town"]))
    assert str(err.value).endswith("its columns are: label,  user,  Item, city")


def test_duplicate_header_columns_are_an_error(tmp_path):
    # Read by name, a column named twice was silently one of the two.
    path = write(tmp_path / "t.csv", ["label,a,b,a,b,c", "1,x,y,z,w,v"])
    with pytest.raises(DataError, match=r"t\.csv line 1: .*'a', 'b' more than once; rename or remove"):
        read_batches(path, "csv", make_schema(sparse=["a"]))
    tsv = write(tmp_path / "t.tsv", ["label\ta\ta", "1\tx\ty"])
    with pytest.raises(DataError, match=r"t\.tsv line 1: .*'a' more than once"):
        read_batches(tsv, "csv", make_schema(sparse=["a"]), {"delimiter": "\t"})
    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t1"])
    write(root / "ml.user", ["user_id:token\tage:token\tage:float", "1\t24\t3"])
    with pytest.raises(DataError, match=r"ml\.user line 1: .*'age' more than once \(with types token and"):
        read_batches(root, "movielens", ML_SCHEMA)
    # A parquet file may repeat a name too: pyarrow raised KeyError on the read by name.
    pq.write_table(pa.Table.from_arrays([pa.array([1]), pa.array([2]), pa.array([3])], ["label", "a", "a"]),
                   tmp_path / "t.parquet")  # fmt: skip
    with pytest.raises(
        DataError, match=r"t\.parquet: the parquet schema names column\(s\) 'a' more than once"
    ):
        read_batches(tmp_path / "t.parquet", "parquet", make_schema(sparse=["a"]))


def test_text_that_is_not_utf8_is_one_line_naming_its_line(tmp_path):
    """A Latin-1 header was 'internal error UnicodeDecodeError' (pyarrow's column names decode in Python), a
    Latin-1 cell 'lines 2-4: In CSV column #1: Row #2: CSV conversion error ...', counting rows in its chunk."""
    path = tmp_path / "t.csv"
    path.write_bytes(b"label,caf\xe9\n1,a\n")
    with pytest.raises(DataError, match=r"t\.csv line 1: not UTF-8 text \(byte 0xe9 at position 10\)"):
        read_all(path, "csv", make_schema(sparse=["a"]))
    path.write_bytes(b"label,a\n1,x\n0,caf\xe9\n1,y\n")
    with pytest.raises(
        DataError, match=r"t\.csv line 3: not UTF-8 text \(byte 0xe9 at position 6\); save the file as UTF-8$"
    ):
        read_all(path, "csv", make_schema(sparse=["a"]))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_a_utf16_file_says_to_save_it_as_utf8(tmp_path, encoding):
    """Excel's "Unicode Text" (UTF-16, a byte order mark or none) was "binary data, not delimited text; check
    the path and data.format"."""
    path = tmp_path / "t.csv"
    path.write_bytes("label,a\n1,café\n".encode(encoding))
    with pytest.raises(DataError) as err:
        read_batches(path, "csv", make_schema(sparse=["a"]))
    assert str(err.value) == f"{path} line 1: UTF-16 text, not UTF-8; save the file as UTF-8"
    path.write_bytes(b"\x00\x01\x02\x03\x04,\xff\n")  # other bytes with a NUL: as before
    with pytest.raises(DataError, match=r"line 1: binary data, not delimited text; check the path and data"):
        read_batches(path, "csv", make_schema(sparse=["a"]))


def test_a_file_with_no_line_end_is_not_read_whole_for_its_header(tmp_path, monkeypatch):
    """Its 'first line' was the whole file, read into memory however large (e.g. a data dump named .csv)."""
    monkeypatch.setattr("recscale.data.readers.text._LINE_MAX", 1 << 20)
    path = tmp_path / "t.csv"
    path.write_bytes(b"label,a" + b",b" * (1 << 20))  # 2 MiB, no line end
    with pytest.raises(DataError, match=r"t\.csv line 1: no line end in its first 1 MiB, so no header line"):
        read_all(path, "csv", make_schema(sparse=["a"]))
    path.write_bytes(b"label,a" + b",b" * (1 << 18) + b"\n1,x\n")  # long, but a line: read as a header
    with pytest.raises(DataError, match=r"names column"):  # 'b' more than once, so the header was read
        read_all(path, "csv", make_schema(sparse=["a"]))


@pytest.mark.parametrize(
    ("fmt", "schema", "good"),
    [
        ("csv", make_schema(sparse=["a"]), "1,x"),
        ("criteo", make_schema(dense=["I1"], sparse=["C1"]), criteo_line()),
        ("libsvm", make_schema(sparse=["a", "b"]), "1 1:1 2:1"),
    ],
)
def test_a_line_that_is_not_utf8_is_a_bad_row_that_skip_drops(tmp_path, monkeypatch, fmt, schema, good):
    """on_bad_row: skip stopped at a Latin-1 line as error did; now it drops and counts it, every later line
    keeping its number (small chunks: the lines fall in several)."""
    monkeypatch.setattr("recscale.data.readers.text.BLOCK_BYTES", 64)
    header = [b"label,a"] if fmt == "csv" else []
    latin1 = good.encode().replace(b"1", b"\xe9", 1)
    body = [good.encode()] * 6
    body[2] = body[4] = latin1
    path = tmp_path / f"t.{fmt}"
    path.write_bytes(b"\r\n".join([*header, *body]) + b"\r\n")
    offset = len(header)
    with pytest.raises(DataError, match=rf"line {3 + offset}: not UTF-8 text .*save the file as UTF-8$"):
        read_all(path, fmt, schema)
    stats = ReadStats()
    t = read_all(path, fmt, schema, on_bad_row="skip", stats=stats)
    assert (t.num_rows, stats.skipped) == (4, 2)
    assert [e.split(": ", 1) for e in stats.examples] == [
        [f"{path} line {n + offset}", f"not UTF-8 text (byte 0xe9 at position {latin1.index(0xE9) + 1})"]
        for n in (3, 5)
    ]


def test_a_quoted_line_break_is_an_error_not_a_shifted_line_count(tmp_path):
    """pyarrow joined the two lines into one row: the id held a line break and every later line number
    was off by one (a chunk boundary inside the cell made two bad rows instead)."""
    path = write(tmp_path / "t.csv", ["label,a", '1,"u', '1"', "0,y", "2,z"])
    with pytest.raises(DataError, match=r"t\.csv lines 2-5: a quoted cell holds a line break"):
        read_all(path, "csv", make_schema(sparse=["a"]))
    quoted = write(tmp_path / "q.csv", ["label,a", '1,"u,1"', "0,y"])  # quotes without line breaks read
    assert read_all(quoted, "csv", make_schema(sparse=["a"])).column("a").to_pylist() == ["u,1", "y"]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_blank_lines_at_the_end_of_a_file_with_quotes_are_no_quoted_line_break(tmp_path, newline):
    """A file ending in a blank line (an editor's, or `echo >> file`'s) counted that line as a row pyarrow had
    not parsed, so a file holding a quoted cell was refused: "a quoted cell holds a line break"."""
    path = write(tmp_path / "t.csv", ["label,a", '1,"u,1"', "0,y", "", ""], newline=newline)
    assert read_all(path, "csv", make_schema(sparse=["a"])).column("a").to_pylist() == ["u,1", "y"]
    bad = write(tmp_path / "b.csv", ["label,a", '1,"u,1"', "x,y", "0,z", ""], newline=newline)
    stats = ReadStats()
    t = read_all(bad, "csv", make_schema(sparse=["a"]), on_bad_row="skip", stats=stats)
    assert t.column("a").to_pylist() == ["u,1", "z"]
    assert stats.examples == [f"{bad} line 3: label 'x' is not 0 or 1"]


def test_a_carriage_return_inside_a_line_is_an_error_naming_it(tmp_path):
    """pyarrow ends a row at a lone \\r: a later bad row crashed (IndexError) locating its line, a Criteo
    line's parts were blamed on lines 1 and 2, and a file of \\r line ends read as header only."""
    csv = tmp_path / "t.csv"
    csv.write_bytes(b"label,a\n1,u\r0,v\n0,w\n2,x\n")
    with pytest.raises(DataError, match=r"t\.csv line 2: a carriage return \(\\r\) inside the line"):
        read_all(csv, "csv", make_schema(sparse=["a"]), on_bad_row="skip")
    row = ["1", "5", *[""] * 12, "68f\rd1e64", *[""] * 25]
    tsv = tmp_path / "t.tsv"
    tsv.write_bytes(("\t".join(row) + "\n" + "\t".join(["0", *row[1:14], "ab", *row[15:]]) + "\n").encode())
    with pytest.raises(DataError, match=r"t\.tsv line 1: a carriage return"):
        read_all(tsv, "criteo", make_schema(dense=["I1"], sparse=["C1"]), on_bad_row="skip")
    mac = tmp_path / "mac.csv"
    mac.write_bytes(b"label,a\r1,u\r0,v\r")
    with pytest.raises(DataError, match=r"mac\.csv line 1: a carriage return"):
        read_all(mac, "csv", make_schema(sparse=["a"]))
    # CRLF line ends, a \\r before one, and a quoted \\r still read.
    ok = tmp_path / "ok.csv"
    ok.write_bytes(b'label,a\r\n1,u\r\r\n0,"v\rw"\r\n')
    assert read_all(ok, "csv", make_schema(sparse=["a"])).column("a").to_pylist() == ["u", "v\rw"]


@pytest.mark.parametrize(
    ("fmt", "head", "row", "line"),
    [
        ("criteo", b"", criteo_line().encode(), 1),
        ("csv", b"label,a\r", b"1,x", 1),  # the header: one \r-ended "line" of the whole file
        ("csv", b"label,a\n", b"1,x", 2),
        ("libsvm", b"", b"1 1:1 2:1", 1),
    ],
)
def test_a_file_of_carriage_return_line_ends_fails_at_its_first_block(
    tmp_path, monkeypatch, fmt, head, row, line
):
    """Lines ending in \r alone (old Mac) were one line, read whole into memory before the error. The file
    is a gzip cut short at its end: a reader that got that far would report the damage instead."""
    monkeypatch.setattr("recscale.data.readers.text.BLOCK_BYTES", 4096)
    blob = gzip.compress(head + b"\r".join([row] * 50000) + b"\r")
    path = tmp_path / f"mac.{fmt}.gz"
    path.write_bytes(blob[:-40])
    schema = (
        make_schema(sparse=["a", "b"])
        if fmt == "libsvm"
        else make_schema(sparse=["a" if fmt == "csv" else "C1"])
    )
    with pytest.raises(
        DataError, match=rf"mac\.{fmt}\.gz line {line}: a carriage return \(\\r\) inside the line"
    ):
        read_all(path, fmt, schema)


def test_options_are_validated():
    assert set(options_model("libsvm").model_fields) == {"mode"}
    with pytest.raises(ConfigError, match="delimtier"):
        read_batches("x.csv", "csv", make_schema(sparse=["a"]), {"delimtier": ";"})
    with pytest.raises(ConfigError, match="mode"):
        read_batches("x.svm", "libsvm", make_schema(sparse=["a"]), {"mode": "dense"})
    with pytest.raises(ConfigError, match="on_bad_row"):
        read_batches("x.csv", "csv", make_schema(sparse=["a"]), on_bad_row="ignore")
    with pytest.raises(ConfigError, match="chunk_rows"):
        read_batches("x.csv", "csv", make_schema(sparse=["a"]), chunk_rows=0)


# ---------------------------------------------------------------- bad rows: error and skip modes

# (format, schema, options, good line, bad line, the expected reason)
BAD_ROWS = [
    ("csv", make_schema(dense=["x"], sparse=["a"]), {}, "1,2.5,a", "1,2.5", "has 2 columns, expected 3"),
    ("csv", make_schema(dense=["x"], sparse=["a"]), {}, "1,2.5,a", "0,1,a,b", "has 4 columns, expected 3"),
    ("csv", make_schema(dense=["x"], sparse=["a"]), {}, "1,2.5,a", "yes,1,a", "label 'yes' is not 0 or 1"),
    ("csv", make_schema(dense=["x"], sparse=["a"]), {}, "1,2.5,a", "2,1,a", "label '2' is not 0 or 1"),
    ("csv", make_schema(dense=["x"], sparse=["a"]), {}, "1,2.5,a", ",1,a", "label is missing"),
    ("csv", make_schema(dense=["x"], sparse=["a"]), {}, "1,2.5,a", "1,abc,a", "value 'abc' is not a number"),
    (
        "csv",
        make_schema(dense=["x"], sparse=["a"]),
        {},
        "1,2.5,a",
        "1,nan,a",
        "value 'nan' is NaN or infinite",
    ),
    ("csv", make_schema(dense=["x"], sparse=["a"]), {}, "1,2.5,a", "1,-inf,a", "'-inf' is NaN or infinite"),
    (
        "csv",
        make_schema(dense=["x"], sparse=["a"]),
        {},
        "1,2.5,a",
        "1,1e39,a",
        "'1e39' is beyond float32's range (±3.4e+38)",
    ),
    ("csv", make_schema(weighted=["h"]), {}, "1,a:1", "1,a:w", "weight 'w' is not a finite number"),
    ("criteo", CRITEO_SCHEMA, {}, criteo_line(), criteo_line()[:-9], "has 39 columns, expected 40"),
    ("criteo", CRITEO_SCHEMA, {}, criteo_line(), criteo_line("x"), "label 'x' is not 0 or 1"),
    (
        "criteo",
        CRITEO_SCHEMA,
        {},
        criteo_line(),
        criteo_line(ints=["1a"] * 13),
        "'I1' value '1a' is not a number",
    ),
    ("libsvm", make_schema(sparse=["a", "b"]), {}, "1 1:1 2:1", "1 1:1", "has 1 idx:val tokens, expected 2"),
    ("libsvm", make_schema(sparse=["a", "b"]), {}, "1 1:1 2:1", "1 1:1 2", "token '2' is not idx:val"),
    ("libsvm", make_schema(sparse=["a", "b"]), {}, "-1 1:1 2:1", "2 1:1 2:1", "label '2' is not -1, 0 or 1"),
    ("libsvm", make_schema(sparse=["a", "b"]), {}, "-1 1:1 2:1", "1:1 2:1", "label '1:1' is not -1, 0 or 1"),
    (
        "libsvm",
        make_schema(sparse=["a", "b"]),
        {},
        "-1 1:1 2:1",
        "1 1:1:1 2:1",
        "token '1:1:1' is not idx:val",
    ),
    (
        "libsvm",
        make_schema(weighted=["f"]),
        {"mode": "bag"},
        "1 1:1",
        "1 1:x",
        "token '1:x': val 'x' is not a finite",
    ),
]


@pytest.mark.parametrize(("fmt", "schema", "options", "good", "bad", "reason"), BAD_ROWS)
def test_bad_rows_error_and_skip(tmp_path, fmt, schema, options, good, bad, reason):
    header = [",".join(["label", *schema.dense_names, *schema.sparse_names])] if fmt == "csv" else []
    # The bad rows are body lines 3 and 6 (file lines 4 and 7 under a header); a blank line between.
    body = [good, good, bad, good, "", bad, good]
    path = write(tmp_path / f"data.{fmt}", header + body, newline="\r\n")
    offset = len(header)
    with pytest.raises(DataError) as err:
        read_all(path, fmt, schema, options)
    message = str(err.value)
    assert message.startswith(f"{path} line {3 + offset}: ")
    assert reason in message and "on_bad_row: skip" in message and "\n" not in message
    stats = ReadStats()
    t = read_all(path, fmt, schema, options, on_bad_row="skip", stats=stats, chunk_rows=2)
    assert (t.num_rows, stats.rows, stats.skipped) == (4, 4, 2)
    assert [e.split(": ", 1)[0] for e in stats.examples] == [f"{path} line {n + offset}" for n in (3, 6)]
    assert all(reason in e for e in stats.examples)


def test_skip_keeps_at_most_five_examples_and_all_bad_is_an_error(tmp_path):
    path = write(tmp_path / "t.csv", ["label,a"] + ["x,1"] * 8)
    stats = ReadStats()
    with pytest.raises(DataError) as err:  # why they were bad too, as skip's examples say it
        read_all(path, "csv", make_schema(sparse=["a"]), on_bad_row="skip", stats=stats)
    assert (
        str(err.value)
        == f"{path} has no data rows (8 bad rows dropped; first at line 2: label 'x' is not 0 or 1)"
    )
    assert stats.skipped == 8 and len(stats.examples) == 5
    assert stats.examples[0] == f"{path} line 2: label 'x' is not 0 or 1"


def test_parquet_bad_rows_name_the_row(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"label": [1, 0, 2, 1], "x": [1.0, math.nan, 3.0, 4.0]}), path, row_group_size=2)
    with pytest.raises(DataError, match=r"t\.parquet row 2: dense feature 'x' value nan is NaN or infinite"):
        read_all(path, "parquet", make_schema(dense=["x"]))
    stats = ReadStats()
    t = read_all(path, "parquet", make_schema(dense=["x"]), on_bad_row="skip", stats=stats)
    assert t.to_pydict() == {"label": [1.0, 1.0], "x": [1.0, 4.0]}
    assert stats.skipped == 2 and "row 3: label 2 is not 0 or 1" in stats.examples[1]


def test_movielens_bad_rows(tmp_path):
    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t1", "1\t11\tfive\t2", "2\t10\t3", "2\t11\t4\t4"])
    with pytest.raises(
        DataError, match=r"ml\.inter line 3: dense feature 'rating' value 'five' is not a number"
    ):
        read_all(root, "movielens", ML_SCHEMA, {"split": "all"})
    stats = ReadStats()
    t = read_all(root, "movielens", ML_SCHEMA, {"split": "all"}, on_bad_row="skip", stats=stats)
    assert t.num_rows == 2 and stats.skipped == 2
    assert "ml.inter line 4: has 3 columns, expected 4" in stats.examples[1]


def test_movielens_line_that_is_not_utf8_is_a_bad_row_that_skip_drops(tmp_path):
    root = write_movielens(tmp_path / "ml", ["1\t10\t5\t100", "2\t11\t3\t200", "1\t11\t4\t300"])
    inter = root / "ml.inter"
    inter.write_bytes(inter.read_bytes().replace(b"2\t11", b"2\t1\xe91"))
    with pytest.raises(DataError, match=r"ml\.inter line 3: not UTF-8 text"):
        read_all(root, "movielens", ML_SCHEMA, {"split": "all"})
    stats = ReadStats()
    t = read_all(root, "movielens", ML_SCHEMA, {"split": "all"}, on_bad_row="skip", stats=stats)
    assert (t.num_rows, stats.skipped) == (2, 1)
    assert stats.examples == [f"{inter} line 3: not UTF-8 text (byte 0xe9 at position 4)"]


def test_a_folder_without_movielens_files_says_what_to_give(tmp_path):
    """It said only "expected one .inter file in this directory, found []"."""
    with pytest.raises(DataError, match=r"found \[\]; give a folder of MovieLens atomic files"):
        read_all(tmp_path, "movielens", ML_SCHEMA, {"split": "all"})


def test_quote_false_reads_a_quote_as_a_character(tmp_path):
    """A TSV of free text whose cell starts with '"' ('"Best deal') had no way to be read: quoting ran the
    cell into the next lines ('a quoted cell holds a line break'). data.options.quote: false reads it."""
    from recscale.cli import main

    path = write(tmp_path / "t.tsv", ["label\ttitle\tsite", '1\t"Best deal\ta', "0\tplain\tb", "1\tx\ta"])
    schema = make_schema(sparse=["title", "site"])
    with pytest.raises(DataError, match=r"lines 2-4: a quoted cell .* set data\.options\.quote: false"):
        read_all(path, "csv", schema, {"delimiter": "\t"})
    table = read_all(path, "csv", schema, {"delimiter": "\t", "quote": False})
    assert table["title"].to_pylist() == ['"Best deal', "plain", "x"] and table["site"].to_pylist() == [
        "a",
        "b",
        "a",
    ]
    assert main(["data", "inspect", str(path), "--delimiter", "tab", "--no-quote"]) == 0
    assert read_all(write(tmp_path / "q.csv", ["label,a", '1,"x,y"']), "csv", make_schema(sparse=["a"]))[
        "a"
    ].to_pylist() == ["x,y"]  # quoting stays the default


def test_text_true_and_false_labels_are_one_and_zero(tmp_path):
    """pandas writes a boolean label column as True/False (Spark: true/false): a CSV of them was all bad rows,
    where the same column in Parquet (a boolean) read as 1/0."""
    path = write(tmp_path / "t.csv", ["label,a", "True,x", "false,y", " TRUE ,z", "1,w", "yes,v"])
    stats = ReadStats()
    table = read_all(path, "csv", make_schema(sparse=["a"]), on_bad_row="skip", stats=stats)
    assert table["label"].to_pylist() == [1.0, 0.0, 1.0, 1.0] and table["a"].to_pylist() == [
        "x",
        "y",
        "z",
        "w",
    ]
    assert stats.examples == [f"{path} line 6: label 'yes' is not 0 or 1"]
    from recscale.data.inspect import inspect_file

    assert inspect_file(path)["positive_rate"] == 0.75


def test_a_pipe_or_device_as_data_is_named_as_such(tmp_path):
    """A FIFO or device read as 'is empty (0 bytes)', and a pipe given as /dev/fd/N (``--data <(zcat F)``)
    as 'does not exist' (its name resolves to pipe:[N]): each is named as not a regular file now."""
    from recscale.data.sources import source_fingerprint

    schema = Schema(label="label", dense=[], sparse=[SparseFeature(name="a")])
    fifo = tmp_path / "data.csv"
    os.mkfifo(fifo)
    read, write = os.pipe()
    try:
        for path in (str(fifo), "/dev/null", f"/dev/fd/{read}"):
            with pytest.raises(DataError, match=r" is not a regular file \(a pipe"):
                source_fingerprint("csv", path, "train", {})
            with pytest.raises(DataError, match=r" is not a regular file \(a pipe"):
                next(read_batches(path, "csv", schema, {}))
    finally:
        os.close(read)
        os.close(write)


# ---------------------------------------------------------------- a split in several files


@pytest.mark.parametrize("fmt", ["csv", "criteo", "parquet"])
def test_a_split_in_parts_reads_as_the_whole_file(tmp_path, fmt):
    """A split written in parts (Spark's part-*, Criteo 1TB's day_0 ... day_23) read as one: a folder of them
    (its _SUCCESS and .crc markers left out, an empty part adding no rows) or a glob pattern, in name order."""
    rng = np.random.default_rng(0)
    rows = [(int(rng.integers(0, 2)), float(rng.normal()), f"u{rng.integers(0, 50)}") for _ in range(300)]
    schema = make_schema(dense=["I1"], sparse=["C1"])

    def write_part(path: Path, part: list) -> Path:
        if fmt == "csv":
            return write(path, ["label,I1,C1", *(f"{y},{x},{c}" for y, x, c in part)])
        if fmt == "criteo":
            pad = "\t" * 12, "\t" * 25
            return write(path, [f"{y}\t{x}{pad[0]}\t{c}{pad[1]}" for y, x, c in part])
        cols = list(zip(*part, strict=True)) if part else [[], [], []]
        table = pa.table({"label": pa.array(cols[0], pa.int64()), "I1": pa.array(cols[1], pa.float64()),
                          "C1": pa.array(cols[2], pa.string())})  # fmt: skip
        pq.write_table(table, path)
        return path

    whole = read_all(write_part(tmp_path / "whole", rows), fmt, schema)
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, (a, b) in enumerate([(0, 120), (120, 120), (120, 300)]):  # the second part is empty
        write_part(parts / f"part-{i:05d}", rows[a:b])
    (parts / "_SUCCESS").write_bytes(b"")
    (parts / ".part-00000.crc").write_bytes(b"\x00crc")
    stats = ReadStats()
    assert read_all(parts, fmt, schema, chunk_rows=64, stats=stats).equals(whole)
    assert stats.rows == 300
    assert read_all(f"{parts}/part-*", fmt, schema).equals(whole)


def test_a_bad_row_in_a_part_names_that_part_and_its_line(tmp_path):
    for i, body in enumerate(["1,a\n0,b\n", "1,c\n0,d,extra\n"]):
        (tmp_path / f"day_{i}.csv").write_text("label,user\n" + body)
    schema = make_schema(sparse=["user"])
    with pytest.raises(DataError, match=rf"^{tmp_path}/day_1\.csv line 3: has 3 columns"):
        read_all(tmp_path / "day_*.csv", "csv", schema)
    # A part whose header lacks a column is refused before any row is read, not once the read reaches it.
    (tmp_path / "day_1.csv").write_text("label,item\n1,c\n")
    with pytest.raises(DataError, match=r"day_1\.csv.*'user'"):
        read_batches(tmp_path / "day_*.csv", "csv", schema)
    # Each kept row's line is known with its file (predict --predictions joins scores back to them).
    (tmp_path / "day_1.csv").write_text("label,user\n1,c\n0,d\n1,e\n")
    stats = ReadStats(positions=[])
    assert read_all(tmp_path, "csv", schema, stats=stats).num_rows == 5
    assert [p.tolist() for p in stats.positions] == [[2, 3], [2, 3, 4]]
    assert stats.position_files == [str(tmp_path / "day_0.csv"), str(tmp_path / "day_1.csv")]


def test_data_paths_that_name_no_data_are_one_line(tmp_path):
    schema = make_schema(sparse=["user"])
    with pytest.raises(DataError, match=r"day_\*\.csv: no file matches this pattern; fix the pattern"):
        read_batches(tmp_path / "day_*.csv", "csv", schema)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty is a directory with no data files in it"):
        read_batches(tmp_path / "empty", "csv", schema)
    # A file whose name looks like a pattern is that file, not what the pattern would match.
    write(tmp_path / "run[1].csv", ["label,user", "1,a"])
    write(tmp_path / "run1.csv", ["label,user", "1,b", "0,c"])
    assert read_all(tmp_path / "run[1].csv", "csv", schema).num_rows == 1


def test_a_split_of_more_parts_than_open_files_allowed_reads(tmp_path):
    """Each part is opened as the read reaches it, not all at the start (a Spark job writes thousands)."""
    import resource

    for i in range(150):
        pq.write_table(pa.table({"label": [i % 2], "user": [f"u{i}"]}), tmp_path / f"part-{i:05d}.parquet")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
    try:
        table = read_all(tmp_path, "parquet", make_schema(sparse=["user"]))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert table.column("user").to_pylist() == [f"u{i}" for i in range(150)]


def test_a_csv_without_a_header_names_its_columns_in_the_options(tmp_path):
    """data.options.columns: a file without a header line (line 1 is data, and errors count from it)."""
    schema = make_schema(dense=["x"], sparse=["u"])
    options = {"columns": ["label", "u", "x"]}
    path = write(tmp_path / "t.csv", ["1,a,0.5", "0,a,", "1,b,2"])  # ids repeat: line 1 is no header
    assert read_all(path, "csv", schema, options).to_pydict() == {
        "label": [1.0, 0.0, 1.0], "x": [0.5, None, 2.0], "u": ["a", "a", "b"]
    }  # fmt: skip
    with pytest.raises(DataError, match=r"t\.csv line 2: has 2 columns, expected 3"):
        read_all(write(path, ["1,a,0.5", "0,b"]), "csv", schema, options)
    with pytest.raises(
        DataError, match=r"line 1 is a header naming data\.options\.columns; leave out columns"
    ):
        read_all(write(path, ["label,u,x", "1,a,0.5"]), "csv", schema, options)
    with pytest.raises(ConfigError, match=r"data\.options\.columns: names column\(s\) 'u' more than once"):
        read_all(path, "csv", schema, {"columns": ["label", "u", "u"]})
    with pytest.raises(DataError, match=r"no column 'x'|'x'"):
        read_all(write(path, ["1,a"]), "csv", schema, {"columns": ["label", "u"]})


def test_small_parts_are_parsed_once_each_without_threads(tmp_path, monkeypatch):
    """Per-part overhead: a part of one text chunk is parsed in the reading thread (starting a thread pool
    for it cost more than the parse), and its header is read once, by the check, not again by the read."""
    import pyarrow.csv as pacsv

    import recscale.data.chunks as chunks
    import recscale.data.readers.text as text

    for i in range(3):
        write(tmp_path / f"part-{i}.csv", ["label,user", f"1,u{i}", f"0,v{i}"])
    calls: list[int] = []
    parse = pacsv.read_csv
    monkeypatch.setattr(text.pacsv, "read_csv", lambda *a, **k: calls.append(1) or parse(*a, **k))
    monkeypatch.setattr(chunks, "ThreadPoolExecutor", None)  # any pool started would fail
    table = read_all(tmp_path, "csv", make_schema(sparse=["user"]))
    assert table.column("user").to_pylist() == ["u0", "v0", "u1", "v1", "u2", "v2"]
    assert len(calls) == 3  # one parse of each part's rows; their headers need no parser


def test_a_folder_of_folders_is_refused_and_a_recursive_pattern_reads_them(tmp_path):
    """Hive-style partitions (date=.../part-0.parquet) were "a directory with no data files in it", and a
    folder holding files and folders read its files alone, leaving the folders' rows out without a word."""
    schema = make_schema(sparse=["user"])
    root = tmp_path / "clicks"
    for i, day in enumerate(["date=2024-01-01", "date=2024-01-02"]):
        (root / day).mkdir(parents=True)
        pq.write_table(pa.table({"label": [1, 0], "user": [f"a{i}", f"b{i}"]}), root / day / "part-0.parquet")
    (root / "_SUCCESS").write_bytes(b"")
    with pytest.raises(
        DataError, match=r"^\S+clicks holds folders \(date=2024-01-01, date=2024-01-02\): .*Hive"
    ):
        read_batches(root, "parquet", schema)
    # What the message offers: every folder's files, in name order; a job's markers and _temporary/ left out.
    (root / "_temporary" / "0").mkdir(parents=True)
    pq.write_table(
        pa.table({"label": [1], "user": ["half-written"]}), root / "_temporary" / "0" / "part-0.parquet"
    )
    (root / "_committed_1").write_text('{"added": []}\n')
    table = read_all(root / "**" / "*", "parquet", schema)
    assert table.column("user").to_pylist() == ["a0", "b0", "a1", "b1"]
    # A file beside the folders does not make them read either.
    pq.write_table(pa.table({"label": [1], "user": ["top"]}), root / "part-9.parquet")
    with pytest.raises(DataError, match=r"holds folders"):
        read_batches(root, "parquet", schema)


def test_a_part_that_is_a_broken_link_or_no_file_is_refused_not_left_out(tmp_path):
    """A folder's or a pattern's entry that is not a regular file was left out: its rows lost without a word."""
    from recscale.data.sources import source_fingerprint

    schema = make_schema(sparse=["user"])
    write(tmp_path / "part-0.csv", ["label,user", "1,a"])
    (tmp_path / "part-1.csv").symlink_to(tmp_path / "gone.csv")
    for path in (tmp_path, tmp_path / "part-*"):
        with pytest.raises(
            DataError, match=r"part-1\.csv is a symbolic link to \S+gone\.csv, which does not exist"
        ):
            read_batches(path, "csv", schema)
        with pytest.raises(DataError, match=r"part-1\.csv is a symbolic link"):
            source_fingerprint("csv", str(path), "train", {})
    (tmp_path / "part-1.csv").unlink()
    os.mkfifo(tmp_path / "part-1.csv")
    with pytest.raises(DataError, match=r"part-1\.csv is not a regular file"):
        read_batches(tmp_path, "csv", schema)
    # A pattern that matches nothing says so, not that the path "does not exist".
    with pytest.raises(DataError, match=r"data\.train: \S+day_\*\.csv matches no file"):
        source_fingerprint("csv", str(tmp_path / "day_*.csv"), "train", {})


def test_a_part_without_a_header_says_its_first_line_is_data(tmp_path):
    """A file cut into parts after its header (split -l), or a Spark CSV written without one (its default):
    the error listed the first row's cells as 'its columns', not that the part has no header."""
    write(tmp_path / "part-0.csv", ["label,x,user", "1,1.5,a"])
    write(tmp_path / "part-1.csv", ["0,2.5,b", "1,3,c"])
    with pytest.raises(
        DataError, match=r"part-1\.csv: .*its columns are: 0, 2\.5, b; line 1 is a row of data"
    ):
        read_batches(tmp_path, "csv", make_schema(dense=["x"], sparse=["user"]))
    # A data row that repeats a value (Criteo's empty cells) failed first as a header naming columns twice.
    write(tmp_path / "part-1.csv", ["0,,3,,b", "1,,4,,c"])
    with pytest.raises(
        DataError, match=r"part-1\.csv line 1 is a row of data, not a header; .*data\.options\.columns"
    ):
        read_batches(tmp_path, "csv", make_schema(dense=["x"], sparse=["user"]))
    write(
        tmp_path / "part-1.csv", ["label,y,user", "0,2.5,b"]
    )  # a header naming another column: no such hint
    with pytest.raises(DataError, match=r"part-1\.csv: column\(s\) 'x' named .* label, y, user$"):
        read_batches(tmp_path, "csv", make_schema(dense=["x"], sparse=["user"]))
