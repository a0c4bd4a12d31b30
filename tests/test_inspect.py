"""`data inspect`: format guessing, inferred column types, counts, and the real datasets."""

import datetime
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recscale.data.inspect import guess_format, inspect_file
from recscale.errors import DataError


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def criteo_line(label: str = "1", i1: str = "5", c1: str = "68fd1e64") -> str:
    return "\t".join([label, i1, *(str(i) for i in range(12)), c1, *(f"{i:08x}" for i in range(25))])


def columns(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["columns"]}


def test_guess_format(tmp_path):
    assert guess_format(write(tmp_path / "a.csv", ["label,a", "1,2"])) == "csv"
    assert guess_format(write(tmp_path / "a.txt", ["label,a", "1,2"])) == "csv"
    assert guess_format(write(tmp_path / "day_0", [criteo_line()])) == "criteo"
    assert guess_format(write(tmp_path / "a.libfm", ["-1 3:1 7:1"])) == "libsvm"
    pq.write_table(pa.table({"label": [1]}), tmp_path / "a.bin")
    assert guess_format(tmp_path / "a.bin") == "parquet"  # by its magic bytes
    assert guess_format(tmp_path / "x.inter") == "movielens"
    # A folder is MovieLens only with its .inter file: a folder of CSVs was read as MovieLens. The files it
    # offers are data: a Spark job's _SUCCESS was offered first.
    (tmp_path / "_SUCCESS").write_bytes(b"")
    with pytest.raises(
        DataError,
        match=r"is a directory with no MovieLens \.inter file; .* give one of its files \(a\.bin, a\.csv",
    ):
        guess_format(tmp_path)
    write(tmp_path / "ml.inter", ["user_id:token\titem_id:token\trating:float\ttimestamp:float"])
    assert guess_format(tmp_path) == "movielens"
    with pytest.raises(DataError, match="cannot tell its format"):
        guess_format(write(tmp_path / "a.dat", ["hello"]))
    with pytest.raises(DataError, match="no such file"):
        guess_format(tmp_path / "missing.csv")
    # A glob pattern, as training takes one: its one file, or its files one after another.
    assert inspect_file(tmp_path / "a.c?v")["rows"] == 1
    write(tmp_path / "b.csv", ["a,label", "3,0"])  # its columns in another order, as training reads by name
    report = inspect_file(tmp_path / "*.csv")
    assert (report["rows"], report["files"], report["positive_rate"]) == (2, 2, 0.5)
    # JSON lines were guessed csv by their commas: columns '{"label": 1', ' "a": "x"}' and schema null.
    for lines in (['{"label": 1, "a": "x"}'], ['[{"label": 1, "a": "x"},', '{"label": 0, "a": "y"}]']):
        with pytest.raises(DataError, match=r"a\.jsonl: JSON, which recscale does not read; convert it"):
            guess_format(write(tmp_path / "a.jsonl", lines))
    assert guess_format(write(tmp_path / "a.txt", ["[id],[label]", "1,0"])) == "csv"


def test_a_delimiter_means_csv(tmp_path):
    # A tab-separated file with a header was 'cannot tell its format' despite --delimiter (csv's option).
    path = write(tmp_path / "t.tsv", ["label\tuser", "1\tu", "0\tv"])
    report = inspect_file(path, options={"delimiter": "\t"})
    assert (report["format"], report["rows"], columns(report)["user"]["cardinality"]) == ("csv", 2, 2)


def test_a_tab_delimited_file_says_how_to_inspect_it(tmp_path, capsys):
    """A .tsv was 'cannot tell its format' without a word of --delimiter; with --format csv it was one column
    and schema null; and --delimiter '\\t', as a shell passes it, was 'at most 1 character'."""
    from recscale.cli import main

    path = write(tmp_path / "t.tsv", ["label\tuser", "1\tu", "0\tv"])
    with pytest.raises(DataError, match=r"cannot tell its format; pass --format, .*pass --delimiter '\\t'"):
        guess_format(path)
    with pytest.raises(DataError, match=r"t.tsv line 1: the header is one column .* pass --delimiter"):
        inspect_file(path, "csv")
    for flag in ("\\t", "tab"):
        assert main(["data", "inspect", str(path), "--delimiter", flag]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["options"], report["rows"], report["schema"]) == (
            {"delimiter": "\t"},
            2,
            {"sparse": [{"name": "user"}]},
        )


def test_inspect_csv_infers_types(tmp_path):
    path = write(
        tmp_path / "t.csv",
        ["label,price,user,tags,note", "1,1.5,7,a|b,x", "0,2,7,,y", "1,,8,b|c,", "bad,row"],
    )
    report = inspect_file(path)
    json.dumps(report)  # JSON-able
    assert (report["format"], report["rows"], report["bad_rows"]) == ("csv", 3, 1)
    assert report["bad_row_examples"] == [f"{path} line 5: has 2 columns, expected 5"]
    assert report["positive_rate"] == pytest.approx(2 / 3)
    cols = columns(report)
    assert [c["type"] for c in report["columns"]] == ["label", "dense", "sparse", "multi", "sparse"]
    assert cols["price"] == {"name": "price", "type": "dense", "cardinality": 2, "missing": 1,
                             "range": {"min": 1.5, "max": 2.0, "mean": 1.75, "std": 0.25}}  # fmt: skip
    assert cols["user"]["cardinality"] == 2 and cols["user"]["missing"] == 0
    assert cols["tags"]["cardinality"] == 3 and cols["tags"]["missing"] == 1  # distinct ids a, b, c
    assert cols["note"]["cardinality"] == 2 and cols["note"]["missing"] == 1


def test_inspect_refuses_duplicate_header_columns(tmp_path):
    path = write(tmp_path / "t.csv", ["label,a,b,a", "1,x,y,z"])
    with pytest.raises(DataError, match=r"t\.csv line 1: the header names column\(s\) 'a' more than once"):
        inspect_file(path)
    pq.write_table(pa.Table.from_arrays([pa.array([1]), pa.array([2])], ["a", "a"]), tmp_path / "t.parquet")
    with pytest.raises(
        DataError, match=r"t\.parquet: the parquet schema names column\(s\) 'a' more than once"
    ):
        inspect_file(tmp_path / "t.parquet")


def test_inspect_max_rows(tmp_path):
    path = write(tmp_path / "t.csv", ["label,a"] + [f"{i % 2},{i}" for i in range(100)])
    report = inspect_file(path, max_rows=10)
    assert report["rows"] == 10 and columns(report)["a"]["cardinality"] == 10


@pytest.mark.parametrize(
    ("name", "lines"),
    [
        (
            "t.csv",
            ["label,a", "1,2,3", "x,2", "1,2,3", "1,5", "0,6", "1,7"],
        ),  # wrong column counts, a bad label
        ("day_0", [criteo_line("x")] * 3 + [criteo_line()] * 3),
        ("t.libfm", ["2 1:1 2:1", "1 1:1 2", "1 1:1:1 2:1", "1 1:1 2:1", "0 3:1 2:1", "1 4:1 2:1"]),
    ],
)
def test_inspect_max_rows_bounds_the_rows_read_good_or_bad(tmp_path, name, lines):
    """max_rows counted good rows only (criteo, libsvm: the reader dropped the bad ones before the count;
    csv: rows of a wrong column count did not count), reading on past the bound."""
    report = inspect_file(write(tmp_path / name, lines), max_rows=3)
    assert (report["rows"], report["bad_rows"], len(report["bad_row_examples"])) == (0, 3, 3)
    report = inspect_file(tmp_path / name, max_rows=4)
    assert (report["rows"], report["bad_rows"]) == (1, 3)


def test_inspect_criteo(tmp_path):
    path = write(tmp_path / "day_0", [criteo_line("0", "", "")] + [criteo_line()] * 3)
    report = inspect_file(path)
    assert (report["format"], report["rows"], report["positive_rate"]) == ("criteo", 4, 0.75)
    cols = columns(report)
    assert len(cols) == 40 and cols["I1"]["type"] == "dense" and cols["C26"]["type"] == "sparse"
    assert cols["I1"]["missing"] == 1 and cols["C1"] == {
        "name": "C1",
        "type": "sparse",
        "cardinality": 1,
        "missing": 1,
    }


def test_inspect_libsvm_fields_and_bag(tmp_path):
    fields = inspect_file(write(tmp_path / "a.libfm", ["1 3:1 7:1", "-1 4:1 7:1", "-1 5:1 8:1"]))
    assert fields["options"] == {"mode": "fields"} and fields["positive_rate"] == pytest.approx(1 / 3)
    assert [(c["name"], c["cardinality"]) for c in fields["columns"]] == [("label", 2), ("f1", 3), ("f2", 2)]
    bag = inspect_file(write(tmp_path / "b.svm", ["1 3:0.5 7:1", "0 4:1", "1"]))
    assert bag["options"] == {"mode": "bag"}
    assert columns(bag)["features"] == {
        "name": "features",
        "type": "multi",
        "cardinality": 3,
        "missing": 1,
        "length": {"mean": 1.0, "p50": 1, "p90": 2, "max": 2},
    }

    # A file of labels alone (a CSV of one column read as libsvm) has no features to inspect.
    with pytest.raises(DataError, match="no libsvm features"):
        inspect_file(write(tmp_path / "c.txt", ["1", "0", "1"]), "libsvm")


def test_inspect_parquet(tmp_path):
    table = pa.table(
        {
            "label": [1, 0, 0, 0],
            "x": [0.5, None, 1.5, 1.5],
            "id": [1, 2, 2, None],
            "t": [[1], [], [2, 3], None],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    report = inspect_file(tmp_path / "t.parquet")
    assert report["positive_rate"] == 0.25
    assert report["columns"] == [
        {"name": "label", "type": "label", "cardinality": 2, "missing": 0},
        {
            "name": "x",
            "type": "dense",
            "cardinality": 2,
            "missing": 1,
            "range": {"min": 0.5, "max": 1.5, "mean": pytest.approx(7 / 6), "std": pytest.approx(2**0.5 / 3)},
        },
        {"name": "id", "type": "sparse", "cardinality": 2, "missing": 1},
        {
            "name": "t",
            "type": "multi",
            "cardinality": 3,
            "missing": 2,
            "length": {"mean": 0.75, "p50": 0, "p90": 2, "max": 2},
        },
    ]


def test_inspect_parquet_label_of_no_numbers_is_a_column_like_any(tmp_path):
    # A date 'label' was 'internal error ArrowNotImplementedError: Unsupported cast from date32[day] ...'.
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"label": [datetime.date(2024, 1, 1), None], "u": ["a", "b"]}), path)
    report = inspect_file(path)
    assert report["rows"] == 2 and report["positive_rate"] is None
    assert columns(report)["label"] == {"name": "label", "type": "sparse", "cardinality": 1, "missing": 1}


def test_inspect_parquet_odd_column_types(tmp_path):
    # Nested columns were an internal error (no 'unique' kernel); fixed-size lists are multi-id columns.
    table = pa.table(
        {
            "label": [1, 0],
            "s": [{"a": 1}, {"a": 2}],
            "n": [[[1]], [[2], [3]]],
            "f": pa.array([[1, 2], [2, 3]], pa.list_(pa.int32(), 2)),
            "d": pa.array(["x", "y"]).dictionary_encode(),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    cols = columns(inspect_file(tmp_path / "t.parquet", tables=True))
    assert cols["s"] == {"name": "s", "type": "unsupported", "arrow_type": "struct<a: int64>"}
    assert cols["n"]["type"] == "unsupported" and cols["n"]["arrow_type"].startswith("list<element: list<")
    assert (cols["f"]["type"], cols["f"]["cardinality"], cols["f"]["pooling"]) == ("multi", 3, 2.0)
    assert (cols["d"]["type"], cols["d"]["cardinality"]) == ("sparse", 2)


def test_inspect_real_frappe_and_movielens(shared_data):
    frappe = inspect_file(shared_data / "frappe" / "valid.csv")
    assert frappe["rows"] == 57_722 and frappe["positive_rate"] == pytest.approx(19_063 / 57_722)
    assert all(c["type"] == "sparse" for c in frappe["columns"][1:]) and len(frappe["columns"]) == 11
    ml = inspect_file(shared_data / "movielens-100k")
    assert (ml["format"], ml["rows"], ml["positive_rate"]) == ("movielens", 100_000, 0.55375)
    cols = columns(ml)
    assert cols["user_id"]["cardinality"] == 943 and cols["item_id"]["cardinality"] == 1682
    assert cols["class"]["type"] == "multi" and cols["timestamp"]["type"] == "dense"
    assert "rating" not in cols  # the label's source


def _as_training_reads(path: Path, fmt: str, report: dict) -> tuple[int, int, list[str]]:
    """(rows, bad rows, examples) of a read of ``path`` in skip mode with the schema inspect inferred."""
    from recscale.data.readers import ReadStats, read_batches
    from recscale.data.schema import DenseFeature, Schema, SparseFeature

    kinds = {c["name"]: c["type"] for c in report["columns"]}
    schema = Schema(
        dense=[DenseFeature(name=n) for n, k in kinds.items() if k == "dense"],
        sparse=[
            SparseFeature(name=n, multi=k == "multi", weighted=c.get("weighted", False))
            for n, k, c in ((c["name"], c["type"], c) for c in report["columns"])
            if k in ("sparse", "multi")
        ],
    )
    stats = ReadStats()
    rows = sum(b.num_rows for b in read_batches(path, fmt, schema, on_bad_row="skip", stats=stats))
    return rows, stats.skipped, stats.examples


def test_inspect_counts_rows_as_training_reads_them(tmp_path):
    # A bad label was counted in both rows and bad_rows, without a line number; a NaN in a column
    # inspect infers as dense (which training drops) was no bad row at all.
    path = write(
        tmp_path / "t.csv",
        ["label,price,user", "1,1.5,7", "x,2.5,8", "0,nan,9", "1,0.5", "1,inf,11", "0,0.25,12", ",1,13"],
    )
    report = inspect_file(path)
    assert (report["rows"], report["bad_rows"]) == (2, 5)
    assert report["bad_row_examples"] == [
        f"{path} line 3: label 'x' is not 0 or 1",
        f"{path} line 4: dense feature 'price' value 'nan' is NaN or infinite",
        f"{path} line 5: has 2 columns, expected 3",
        f"{path} line 6: dense feature 'price' value 'inf' is NaN or infinite",
        f"{path} line 8: label is missing",
    ]
    assert _as_training_reads(path, "csv", report) == (2, 5, report["bad_row_examples"])
    # Every statistic covers the rows training reads, no others.
    assert report["positive_rate"] == 0.5
    assert columns(report)["price"] == {"name": "price", "type": "dense", "cardinality": 2, "missing": 0,
                                        "range": {"min": 0.25, "max": 1.5, "mean": 0.875, "std": 0.625}}  # fmt: skip
    assert columns(report)["user"]["cardinality"] == 2

    # max_rows: the first rows only, a parser-rejected row after the cut not counted.
    report = inspect_file(path, max_rows=2)
    assert (report["rows"], report["bad_rows"], len(report["bad_row_examples"])) == (1, 1, 1)

    # NaN in an integer-looking column: it is sparse, so "nan" is an id as training reads it.
    path = write(tmp_path / "s.csv", ["label,user", "1,7", "0,nan"])
    report = inspect_file(path)
    assert (report["rows"], report["bad_rows"], columns(report)["user"]["type"]) == (2, 0, "sparse")


def test_inspect_counts_ids_as_training_reads_them(tmp_path):
    # "3.0" is id 3 in training (as a Parquet float 3.0 is): inspect counted it as a second id.
    report = inspect_file(write(tmp_path / "t.csv", ["label,a", "1,3", "0,3.0", "1,007", "0,7"]))
    assert columns(report)["a"] == {"name": "a", "type": "sparse", "cardinality": 3, "missing": 0}


def test_inspect_counts_a_line_that_is_not_utf8_as_a_bad_row(tmp_path):
    # It stopped inspect, which reads as training does with on_bad_row: skip.
    path = tmp_path / "t.csv"
    path.write_bytes(b"label,a\n1,x\n0,caf\xe9\n1,y\n")
    report = inspect_file(path)
    assert (report["rows"], report["bad_rows"], columns(report)["a"]["cardinality"]) == (2, 1, 2)
    assert report["bad_row_examples"] == [f"{path} line 3: not UTF-8 text (byte 0xe9 at position 6)"]


def test_inspect_parquet_counts_rows_as_training_reads_them(tmp_path):
    table = pa.table(
        {
            "label": [1, 2, 0, 1, None],
            "x": [0.5, 1.5, float("nan"), 1e300, 2.5],  # 1e300 is infinite in float32, as training reads it
            "id": [1, 2, 3, 4, 5],
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    report = inspect_file(path)
    assert (report["rows"], report["bad_rows"], report["positive_rate"]) == (1, 4, 1.0)
    assert report["bad_row_examples"] == [
        f"{path} row 2: label 2 is not 0 or 1",
        f"{path} row 3: dense feature 'x' value nan is NaN or infinite",
        f"{path} row 4: dense feature 'x' value 1e+300 is beyond float32's range (±3.4e+38)",
        f"{path} row 5: label is missing",
    ]
    assert _as_training_reads(path, "parquet", report) == (1, 4, report["bad_row_examples"])
    assert columns(report)["id"]["cardinality"] == 1


def test_inspect_parquet_weights_are_their_features_weights_not_ids(tmp_path):
    """h__w, the weights of multi-id column h, was inspected as a multi-id column of its own (its weights
    counted as ids), and its rows were not checked as training checks them."""
    table = pa.table(
        {
            "label": [1, 0, 1, 0],
            "h": [["a", "b"], ["c"], ["d"], ["e"]],
            "h__w": pa.array([[1.0, 2.0], [0.5, 1.0], [math.nan], [2.0]]),
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    report = inspect_file(path)
    cols = columns(report)
    assert cols["h__w"] == {"name": "h__w", "type": "weights", "feature": "h"}
    assert cols["h"]["weighted"] is True and cols["h"]["cardinality"] == 3  # a, b, e
    assert (report["rows"], report["bad_rows"]) == (2, 2)
    assert _as_training_reads(path, "parquet", report) == (2, 2, report["bad_row_examples"])


def test_inspect_parquet_float_lists_as_training_reads_them(tmp_path):
    # A list<double> column is multi: an element that is not a whole number is a bad row, as in training.
    table = pa.table({"label": [1, 0, 1], "h": pa.array([[1.0, 2.0], [1.5], None], pa.list_(pa.float64()))})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    report = inspect_file(path)
    assert (report["rows"], report["bad_rows"], columns(report)["h"]["type"]) == (2, 1, "multi")
    assert report["bad_row_examples"][0].startswith(f"{path} row 2: sparse feature 'h' id 1.5 is not a whole")
    assert _as_training_reads(path, "parquet", report) == (2, 1, report["bad_row_examples"])


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_inspect_reports_history_lengths_and_the_rows_max_len_cuts(tmp_path, fmt, capsys):
    """inspect said nothing of a history's lengths: how long they run, and how many rows a max_len cuts."""
    from recscale.cli import main
    from recscale.data.readers import ReadStats, read_batches
    from recscale.data.schema import Schema

    histories = [[str(i) for i in range(n)] for n in (0, 1, 1, 2, 3, 3, 4, 5, 8, 10)]
    path = tmp_path / f"t.{fmt}"
    if fmt == "csv":  # an empty cell is an empty history
        write(path, ["label,h", *(f"{i % 2},{'|'.join(h)}" for i, h in enumerate(histories))])
    else:
        pq.write_table(pa.table({"label": [i % 2 for i in range(10)], "h": histories}), path)
    h = columns(inspect_file(path, max_len=4))["h"]
    assert h["type"] == "multi" and h["missing"] == 1
    assert h["length"] == {"mean": 3.7, "p50": 3, "p90": 8, "max": 10, "truncated": 3}
    assert "truncated" not in columns(inspect_file(path))["h"]["length"]
    stats = ReadStats()
    schema = Schema.model_validate({"sparse": [{"name": "h", "multi": True, "max_len": 4}]})
    for _ in read_batches(path, fmt, schema, stats=stats):
        pass
    assert stats.truncated == {"h": h["length"]["truncated"]}  # the rows training cuts

    assert main(["data", "inspect", str(path), "--max-len", "8"]) == 0
    assert columns(json.loads(capsys.readouterr().out))["h"]["length"]["truncated"] == 1


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_inspect_max_len_counts_no_cut_of_a_history_training_refuses(tmp_path, fmt):
    """A history with an empty element (3||7, a null in a list) is a bad row for a sequence feature, which
    training drops with on_bad_row: skip; inspect counted its cut as truncated all the same (2 against
    training's 1)."""
    from recscale.data.readers import ReadStats, read_batches
    from recscale.data.schema import Schema

    path = tmp_path / f"t.{fmt}"
    if fmt == "csv":
        write(path, ["label,h", "1,1|2|3|4|5", "0,1||2|3|4|5", "1,7|8|", "0,"])
    else:
        h = [["1", "2", "3", "4", "5"], ["1", None, "2", "3", "4", "5"], ["7", "8", ""], []]
        pq.write_table(pa.table({"label": [1, 0, 1, 0], "h": h}), path)
    length = columns(inspect_file(path, max_len=3))["h"]["length"]
    assert length["max"] == 5 and length["truncated"] == 1  # a bag's lengths, a history's cuts
    stats = ReadStats()
    schema = Schema.model_validate({"sparse": [{"name": "h", "multi": True, "max_len": 3}]})
    for _ in read_batches(path, fmt, schema, on_bad_row="skip", stats=stats):
        pass
    assert (stats.truncated, stats.skipped) == ({"h": 1}, 2)


def test_inspect_gives_the_schema_that_trains_on_the_file(tmp_path):
    """`data inspect` listed each column's inferred type, and the user wrote data.schema from it by hand;
    its "schema" is that block (JSON, which YAML reads), and a run trains with it as given."""
    from recscale.config import load_config
    from recscale.train.loop import Trainer

    # The first column a pandas index, whose empty name training refuses: left out of the schema (it was
    # null), and named so. A dense column reaching beyond +-10 (price, to 1575.5) is suggested standardised.
    path = write(
        tmp_path / "t.csv",
        [",label,price,ratio,user,tags"]
        + [f"{i},{i % 2},{i * 25 + 0.5},{i / 8 - 4},{i % 5},a|{i % 3}" for i in range(64)],
    )
    report = inspect_file(path)
    assert (
        columns(report)["ratio"]["range"]["min"] == -4 and columns(report)["ratio"]["range"]["max"] == 3.875
    )
    assert report["schema"] == {
        "dense": [{"name": "price", "scale": "standard"}, {"name": "ratio"}],
        "sparse": [{"name": "user"}, {"name": "tags", "multi": True}],
    }
    assert report["schema_left_out"] == [""]
    config = (
        f"data: {{format: csv, train: {path}, num_workers: 0, schema: {json.dumps(report['schema'])}}}\n"
        "model: {name: fm}\ntrain: {batch_size: 16, max_steps: 2, progress: false}\n"
    )
    (tmp_path / "run.yaml").write_text(config)
    assert Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()["steps"] == 2
    # A fixed layout gives its own; columns with no label column give none.
    criteo = inspect_file(write(tmp_path / "day_0", [criteo_line()] * 2))["schema"]
    assert [f["name"] for f in criteo["dense"]] == [f"I{i}" for i in range(1, 14)] and len(
        criteo["sparse"]
    ) == 26
    assert inspect_file(write(tmp_path / "u.csv", ["click,user", "1,3"]))["schema"] is None


def test_label_names_the_label_column_and_the_schema_trains(tmp_path, capsys):
    """A click log's label is rarely named 'label': `--label click` makes the schema (data.schema.label
    click) that training reads; without it the schema is null and a note says how to name it."""
    from recscale.cli import main
    from recscale.data.readers import read_batches
    from recscale.data.schema import Schema

    no_label = write(tmp_path / "n.csv", ["click,hour", "1,14102100", "0,14102101"])
    assert main(["data", "inspect", str(no_label)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["schema"] is None and "no label column 'label'" in err and "--label COLUMN" in err
    path = write(tmp_path / "t.csv", ["click,hour,price,label", "1,14102100,1.5,x", "0,14102101,2.5,y"])
    report = inspect_file(path, label="click")
    # A column named 'label' is what the readers call the label column: left out, not a feature.
    assert report["schema"] == {"label": "click", "dense": [{"name": "price"}], "sparse": [{"name": "hour"}]}
    assert report["schema_left_out"] == ["label"] and report["positive_rate"] == 0.5
    batch = next(read_batches(path, "csv", Schema(**report["schema"])))
    assert batch.column("label").to_pylist() == [1.0, 0.0]
    pq.write_table(pa.table({"y": [1, 0, 1], "user": ["a", "b", "a"]}), tmp_path / "t.parquet")
    assert inspect_file(tmp_path / "t.parquet", label="y")["schema"] == {
        "label": "y",
        "sparse": [{"name": "user"}],
    }
    assert main(["data", "inspect", str(tmp_path / "t.parquet"), "--label", "y"]) == 0
    assert capsys.readouterr().err == ""
    with pytest.raises(
        DataError, match=r"t\.csv: --label 'y' is not a column of the file; its columns are: click"
    ):
        inspect_file(path, label="y")
    with pytest.raises(DataError, match="--label names a csv or parquet column; a criteo file's label"):
        inspect_file(write(tmp_path / "day_0", [criteo_line()]), label="click")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_inspect_refuses_a_file_without_data_rows(tmp_path, capsys, fmt):
    """A header and no rows was reported as 'rows: 0' with a guessed schema, where training refuses the
    file with 'has no data rows': inspect now says so too, in one line, exit 2."""
    from recscale.cli import main

    if fmt == "csv":
        path = write(tmp_path / "empty.csv", ["label,a,b"])
    else:
        path = tmp_path / "empty.parquet"
        pq.write_table(pa.table({"label": pa.array([], pa.int64()), "a": pa.array([], pa.float64())}), path)
    with pytest.raises(DataError, match="has no data rows"):
        inspect_file(path)
    code = main(["data", "inspect", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "has no data rows" in err, err


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_inspect_shows_progress_on_a_terminal(tmp_path, capsys, monkeypatch, suffix):
    """data inspect read a file with no bar on a terminal, where train and data prepare show one: a
    Criteo-shaped file of 3M rows took 19 s, a day of Criteo minutes, without a sign. Off a terminal: none."""
    import sys

    from recscale.cli import main

    table = pa.table({"label": [0, 1] * 50, "user": [str(i % 7) for i in range(100)]})
    path = tmp_path / f"t{suffix}"
    if suffix == ".csv":
        path.write_text("label,user\n" + "".join(f"{i % 2},{i % 7}\n" for i in range(100)))
    else:
        pq.write_table(table, path)
    assert main(["data", "inspect", str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == 100 and err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["data", "inspect", str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == 100 and f"reading {path.name}" in err


def test_a_csv_without_a_header_is_noticed_and_inspected_with_its_columns(tmp_path, capsys):
    """A headerless CSV's first data line was taken for its header: columns '1', 'a', '0.5' and a note to pass
    --label. The note says line 1 reads as data; --columns names them (data.options.columns) and the schema
    it reports trains."""
    from recscale.cli import main
    from recscale.config import load_config
    from recscale.train.loop import Trainer

    path = write(tmp_path / "t.csv", ["1,a,0.5", "0,b,1.5", "1,a,2"])
    assert main(["data", "inspect", str(path)]) == 0
    err = capsys.readouterr().err
    assert "line 1 reads as data, not a header: name its 3 columns with --columns" in err, err
    assert main(["data", "inspect", str(path), "--columns", "label,user,price"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 3 and report["options"] == {"columns": ["label", "user", "price"]}
    assert report["schema"] == {"dense": [{"name": "price"}], "sparse": [{"name": "user"}]}
    config = (
        f"data: {{format: csv, train: {path}, num_workers: 0, options: {json.dumps(report['options'])}, "
        f"schema: {json.dumps(report['schema'])}}}\nmodel: {{name: fm}}\ntrain: {{batch_size: 2, max_steps: 2, progress: false}}\n"
    )
    (tmp_path / "run.yaml").write_text(config)
    assert Trainer(load_config(tmp_path / "run.yaml"), tmp_path / "r").fit()["steps"] == 2


@pytest.mark.parametrize("fmt", ["csv", "parquet", "criteo"])
def test_inspect_reads_a_split_in_parts_as_training_does(tmp_path, fmt):
    """data inspect of a folder or pattern of parts read only one file (or refused): it reads them all, in name
    order, as training does; a bad row names its part, and a part of other columns is one line."""
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "_SUCCESS").write_bytes(b"")
    rows = [[f"{i % 2},{i},u{i % 5}" for i in range(a, b)] for a, b in ((0, 30), (30, 50))]
    for k, part in enumerate(rows):
        if k == 1:
            bad = {"csv": "1,2", "criteo": "1,x,u1", "parquet": part[3]}[
                fmt
            ]  # a short line; a non-number in I1
            part = [*part[:3], bad, *part[4:]]
        if fmt == "csv":
            write(parts / f"part-{k}.csv", ["label,price,user", *part])
        elif fmt == "criteo":
            write(parts / f"part-{k}", [criteo_line(label=r[0], i1=r.split(",")[1]) for r in part])
        else:
            cells = [r.split(",") for r in part]
            pq.write_table(
                pa.table(
                    {
                        "label": [int(c[0]) for c in cells],
                        "price": [float(c[1]) for c in cells],
                        "user": [c[2] for c in cells],
                    }
                ),  # fmt: skip
                parts / f"part-{k}.parquet",
            )
    report = inspect_file(parts, fmt=fmt)
    assert report["files"] == 2
    if fmt == "parquet":
        assert report["rows"] == 50 and report["bad_rows"] == 0
    else:
        assert report["rows"] == 49 and report["bad_rows"] == 1
        assert report["bad_row_examples"][0].startswith(str(parts / "part-1")), report["bad_row_examples"]
    if fmt == "csv":
        write(parts / "part-2.csv", ["label,cost,user", "1,2,u1"])
        with pytest.raises(DataError, match=r"part-2\.csv line 1: its columns \(label, cost, user\) are not"):
            inspect_file(parts)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_weight_names_the_row_weight_column_not_a_dense_feature(tmp_path, fmt):
    """Without --weight a column of weights is numbers, a dense feature: the suggested schema trained on the
    weights as an input (and adding data.schema.weight then clashed with it)."""
    table = pa.table({"label": [0, 1, 1, 0], "w": [0.5, 2.0, 1.0, 3.0], "user": ["a", "b", "a", "c"]})
    path = tmp_path / f"t.{fmt}"
    if fmt == "csv":
        path.write_text("label,w,user\n0,0.5,a\n1,2.0,b\n1,1.0,a\n0,3.0,c\n")
    else:
        pq.write_table(table, path)
    assert inspect_file(path)["schema"]["dense"] == [{"name": "w"}]
    schema = inspect_file(path, weight="w")["schema"]
    assert schema["weight"] == "w" and "dense" not in schema and schema["sparse"] == [{"name": "user"}]
    with pytest.raises(
        DataError, match="--weight 'x' is not a column of the file; its columns are: label, w, user"
    ):
        inspect_file(path, weight="x")


def test_a_column_unique_on_every_row_is_noted_as_a_row_id(tmp_path, capsys):
    """Avazu's `id` (an impression id) was suggested as a feature without a word: distinct on every row, its
    table never sees an id twice. A sample of 1,000 rows or more notes it; a small one does not (too few rows
    to tell a row id from a large vocabulary)."""
    from recscale.cli import main

    rows = [f"{10**18 + i},{i % 2},u{i % 37}" for i in range(1200)]
    path = write(tmp_path / "t.csv", ["id,label,user", *rows])
    assert main(["data", "inspect", str(path)]) == 0
    err = capsys.readouterr().err
    assert (
        "note: id holds a distinct value on each of the 1,200 rows (a row id?)" in err and "user" not in err
    )
    assert main(["data", "inspect", str(write(tmp_path / "s.csv", ["id,label,user", *rows[:100]]))]) == 0
    assert "row id" not in capsys.readouterr().err


def test_weighted_id_cells_are_noted(tmp_path, capsys):
    """A multi-id column written for `weighted: true` (`a:0.5|b:2`) was counted and suggested as plain ids
    without a word: every id reading id:weight, a fraction among them, marks it looks_weighted, with a note;
    namespaced ids (`genre:3`, whole numbers only) do not."""
    from recscale.cli import main

    path = write(
        tmp_path / "t.csv",
        ["label,hist,genres", "1,a:0.5|b:2,g:1|g:2", "0,c:1.5|a:1,g:3", "1,a:0.25,g:1|g:4"],
    )
    assert main(["data", "inspect", str(path)]) == 0
    out, err = capsys.readouterr()
    cols = columns(json.loads(out))
    assert cols["hist"].get("looks_weighted") is True and "looks_weighted" not in cols["genres"]
    assert "note: every id of hist reads id:weight" in err and "genres" not in err
