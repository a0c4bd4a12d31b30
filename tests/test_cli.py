"""User mistakes reach the user as one line on stderr and exit code 2, never a traceback."""

import argparse
import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from recscale.cli import build_parser, main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FRAPPE_HEADER = "label,user,item,daytime,weekday,isweekend,homework,cost,weather,country,city"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def frappe_like(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join([FRAPPE_HEADER, *rows]) + "\n")
    return path


GOOD = [f"{i % 2},{i % 7},{i % 11},1,2,3,4,5,6,7,8" for i in range(64)]


@pytest.mark.parametrize(
    "rows, words",
    [
        ([*GOOD, "x,1,2,3,4,5,6,7,8,9,10"], ["label"]),
        ([*GOOD, "1,1,2,3"], ["column"]),
        ([], ["no data rows", "empty"]),
    ],
)
def test_bad_training_file_is_one_clear_line(tmp_path, capsys, rows, words):
    train = frappe_like(tmp_path / "train.csv", rows)
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                       f"data.train={train}", f"data.valid={train}", "train.max_steps=2", "train.progress=false")  # fmt: skip
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "train.csv" in err and any(w in err.lower() for w in words), err
    assert not (tmp_path / "run" / "ckpt").exists() or not any((tmp_path / "run" / "ckpt").iterdir())


def test_missing_file_and_bad_config(tmp_path, capsys):
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "r"),
                       f"data.train={tmp_path / 'nope.csv'}")  # fmt: skip
    assert code == 2 and "nope.csv" in err and "Traceback" not in err
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "train.batch_sise=3")
    assert code == 2 and "train.batch_sise" in err
    code, _, err = run(capsys, "eval", str(tmp_path / "no-run"), "--data", "x.csv")
    assert code == 2 and "not a recscale run directory" in err


def test_skip_counts_dropped_rows(tmp_path, capsys):
    train = frappe_like(tmp_path / "train.csv", [*GOOD, "x,1,2,3,4,5,6,7,8,9,10", "1,1,2"])
    code, out, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                         f"data.train={train}", f"data.valid={train}", "data.on_bad_row=skip",
                         "train.max_steps=2", "train.batch_size=16", "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["skipped_rows"]["train"] == 2 and report["valid"]["rows"] == 64


def test_eval_on_a_bad_row_names_its_own_option(tmp_path, capsys):
    """eval's error named data.on_bad_row, which eval takes no overrides for."""
    train = frappe_like(tmp_path / "train.csv", GOOD)
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                       f"data.train={train}", f"data.valid={train}", "train.max_steps=2", "train.batch_size=16",
                       "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    bad = frappe_like(tmp_path / "bad.csv", [*GOOD, "x,1,2,3,4,5,6,7,8,9,10"])
    code, _, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(bad))
    assert code == 2 and "bad.csv line 66" in err and "(pass --on-bad-row skip to drop such rows)" in err, err
    code, out, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(bad), "--on-bad-row", "skip")
    assert code == 0, err
    assert not torch.distributed.is_initialized()  # eval ends its process group, as train and export do
    assert json.loads(out)["skipped_rows"] == 1 and json.loads(out)["rows"] == 64


def test_eval_of_one_class_says_why_its_metrics_are_null(tmp_path, capsys):
    """A file of one class printed "auc": null, "ne": null and nothing else: a metric that is undefined
    read like one left out. A note on stderr now says why; the JSON on stdout stays one line."""
    train = frappe_like(tmp_path / "train.csv", GOOD)
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                       f"data.train={train}", f"data.valid={train}", "train.max_steps=2", "train.batch_size=16",
                       "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    ones = frappe_like(tmp_path / "ones.csv", [r for r in GOOD if r.startswith("1,")])
    code, out, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(ones))
    m = json.loads(out)
    assert code == 0 and m["auc"] is None and m["ne"] is None and m["calibration"] is not None
    assert err == "note: auc, ne are null: all 32 rows are positive (AUC and NE need both classes)\n"
    code, out, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(train))
    assert code == 0 and err == "" and json.loads(out)["auc"] is not None


def test_eval_and_predict_show_progress_on_a_terminal(tmp_path, capsys, monkeypatch):
    """eval and predict read, mapped and scored a file with no bar on a terminal, where train and data prepare
    show one: a Criteo-shaped file of 3M rows took 40 s, a day of Criteo ~10 minutes, without a sign."""
    import sys

    train = frappe_like(tmp_path / "train.csv", GOOD)
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                       f"data.train={train}", f"data.valid={train}", "train.max_steps=2", "train.batch_size=16",
                       "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(train))
    assert code == 0 and json.loads(out)["rows"] == 64
    assert "reading split" in err and "scoring" in err
    scores = str(tmp_path / "scores.csv")
    code, _, err = run(capsys, "predict", str(tmp_path / "run"), "--data", str(train), "--out", scores)
    assert code == 0 and "reading split" in err and "scoring" in err


def test_eval_of_a_file_whose_multi_id_column_is_empty_throughout(tmp_path, capsys):
    """A file where no row held an id of a multi-id field (tags empty in every row of a small eval file)
    crashed eval with "internal error ValueError: cannot mmap an empty file"; it scores as empty bags."""
    schema = ("data.schema={label: label, sparse: [{name: user}, {name: item}, "
              "{name: city, multi: true, weighted: true}]}")  # fmt: skip
    train = frappe_like(tmp_path / "train.csv", GOOD)
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"), schema,
                       f"data.train={train}", f"data.valid={train}", "train.max_steps=2", "train.batch_size=16",
                       "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    empty = frappe_like(tmp_path / "no-city.csv", [r.rsplit(",", 1)[0] + "," for r in GOOD])
    code, out, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(empty))
    assert code == 0 and err == "" and json.loads(out)["rows"] == 64


def test_eval_batches_rows_as_the_run_evaluated_them(tmp_path, capsys):
    """eval scored in batches of 8192 whatever the run's train.batch_size, where the run's own evaluations
    use max(batch_size, 8192): with fp8's per-tensor (per batch) activation scales `recscale eval` then
    disagreed with the report's test metrics for the same model and rows."""
    out = tmp_path / "run"
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(out),
                       "data.synthetic.rows={train: 9000, valid: 500, test: 9000}", "train.batch_size=9000",
                       "train.max_steps=1", "train.progress=false", "data.num_workers=0", "model.num_layers=1",
                       "model.embedding.dim=8", "model.quant={format: fp8_e4m3, where: ['*']}")  # fmt: skip
    assert code == 0, err
    code, printed, err = run(capsys, "eval", str(out))
    assert code == 0, err
    assert json.loads(printed) == json.loads((out / "report.json").read_text())["test"]


def test_eval_names_the_fields_none_of_whose_ids_training_saw(tmp_path, capsys):
    """A file writing its ids as 03 where training's wrote 3 scored every row as OOV: AUC fell to chance
    with nothing said (3.0 for 3 did too, which now reads as 3: the readers' id rule). eval now lists such fields (unknown_id_fields) and says why on stderr; not a field
    whose vocabulary is empty (min_count above every count), which is OOV in training too."""
    train = frappe_like(tmp_path / "train.csv", GOOD)
    schema = (
        "data.schema={label: label, sparse: [{name: user}, {name: item}, {name: daytime, min_count: 100}]}"
    )
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"), schema,
                       f"data.train={train}", f"data.valid={train}", "train.max_steps=2", "train.batch_size=16",
                       "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    padded = [",".join([r[0], *(f"0{c}" for c in r.split(",")[1:3]), *r.split(",")[3:]]) for r in GOOD]
    code, out, err = run(
        capsys, "eval", str(tmp_path / "run"), "--data", str(frappe_like(tmp_path / "f.csv", padded))
    )
    assert code == 0 and json.loads(out)["unknown_id_fields"] == ["user", "item"]
    assert err.startswith("note: no id of user, item is in the run's vocabularies") and err.count("\n") == 1
    # predict said nothing of it, where new rows are the likelier to write their ids another way
    scores = str(tmp_path / "scores.csv")
    code, _, err = run(
        capsys, "predict", str(tmp_path / "run"), "--data", str(tmp_path / "f.csv"), "--out", scores
    )
    assert code == 0 and err.startswith("note: no id of user, item is in the run's vocabularies"), err
    code, out, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(train))
    assert code == 0 and err == "" and "unknown_id_fields" not in json.loads(out)
    floats = [",".join([r[0], *(f"{c}.0" for c in r.split(",")[1:3]), *r.split(",")[3:]]) for r in GOOD]
    code, same, err = run(
        capsys, "eval", str(tmp_path / "run"), "--data", str(frappe_like(tmp_path / "f.csv", floats))
    )
    assert code == 0 and err == "" and json.loads(same) == json.loads(out)


@pytest.mark.parametrize(("fraction", "words"), [(0.01, "for the report; give a valid split with more rows, or a "
                                                   "larger fraction"), (0.99, "for selection")])  # fmt: skip
def test_a_report_fraction_that_empties_a_half_is_one_line(tmp_path, capsys, fraction, words):
    """A valid split too small for data.report_fraction left one half empty, and the run crashed with
    "internal error ValueError: torch.cat(): expected a non-empty list of Tensors" when it scored it."""
    train, valid = frappe_like(tmp_path / "train.csv", GOOD), frappe_like(tmp_path / "valid.csv", GOOD[:2])
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                       f"data.train={train}", f"data.valid={valid}", f"data.report_fraction={fraction}",
                       "train.max_steps=2", "train.batch_size=16", "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert (
        err.startswith(f"error: data.report_fraction={fraction} leaves no row of the valid split's 2 ")
        and words in err
    )
    assert not (tmp_path / "run").exists()


def test_eval_in_another_format_does_not_apply_the_runs_format_options(tmp_path, capsys):
    """A run on ';'-delimited CSV evaluated on Parquet failed with "data.options.delimiter: unknown key
    for format 'parquet'", a config key eval takes no override for: the CSV reader's options went along."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = frappe_like(tmp_path / "train.csv", GOOD)
    train.write_text(train.read_text().replace(",", ";"))
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                       f"data.train={train}", f"data.valid={train}", "data.options={delimiter: ';'}",
                       "train.max_steps=2", "train.batch_size=16", "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    columns = list(zip(*(r.split(",") for r in GOOD), strict=True))
    table = pa.table({n: [int(v) for v in c] for n, c in zip(FRAPPE_HEADER.split(","), columns, strict=True)})
    pq.write_table(table, tmp_path / "valid.parquet")
    code, out, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(tmp_path / "valid.parquet"),
                         "--format", "parquet")  # fmt: skip
    assert code == 0, err
    code, same, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(train))
    assert code == 0 and json.loads(out) == json.loads(same)


def test_eval_takes_reader_option_overrides_and_a_one_column_header_hints_at_the_delimiter(tmp_path, capsys):
    """A comma-delimited file scored by a run trained on ';' data failed on a one-column header, with no word
    of the delimiter, and eval had no way to change the run's reader options."""
    train = frappe_like(tmp_path / "train.csv", GOOD)
    semi = tmp_path / "semi.csv"
    semi.write_text(train.read_text().replace(",", ";"))
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"),
                       f"data.train={semi}", f"data.valid={semi}", "data.options={delimiter: ';'}",
                       "train.max_steps=2", "train.batch_size=16", "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    code, same, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(semi))  # the run's options
    assert code == 0, err
    code, _, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(train))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the header is one column for delimiter ';' but holds ','" in err
    assert "set data.options.delimiter to ','" in err
    for override in (["data.options.delimiter=','"], ["--data", str(train), "data.options={delimiter: ','}"]):
        argv = ["eval", str(tmp_path / "run"), *override] + (
            ["--data", str(train)] if len(override) == 1 else []
        )
        code, out, err = run(capsys, *argv)
        assert code == 0 and json.loads(out) == json.loads(same), err
    code, _, err = run(capsys, "eval", str(tmp_path / "run"), "--data", str(train), "train.max_steps=3")
    assert code == 2 and "eval takes overrides of the reader's options only" in err
    code, _, err = run(capsys, "eval", str(tmp_path / "run"), str(train))  # the file, without --data
    assert (
        code == 2
        and err
        == f"error: eval: '{train}' is no key=value override; give the file to score with --data {train}\n"
    )
    code, _, err = run(
        capsys, "eval", str(tmp_path / "run"), "--data", str(train), "data.options.delimtier=x"
    )
    assert code == 2 and "delimtier" in err and len(err.strip().splitlines()) == 1, err


def test_help_for_each_command():
    for argv in ([], ["train"], ["eval"], ["data", "inspect"], ["data", "prepare"], ["export"], ["serve"]):
        r = subprocess.run(
            [sys.executable, "-m", "recscale.cli", *argv, "--help"], capture_output=True, text=True
        )
        assert r.returncode == 0 and "usage: recscale" in r.stdout


def _options(
    parser: argparse.ArgumentParser, prog: str = "recscale"
) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prog} {name}")
        elif action.option_strings:
            yield prog, action


def test_every_option_with_a_default_says_it_in_its_help():
    """retrieval build's --index, --epochs, ..., dmt partition's --tolerance and --rows hid their defaults."""
    silent = [
        f"{prog} {action.option_strings[-1]}"
        for prog, action in _options(build_parser())
        if action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in (action.help or "")
    ]
    assert not silent


def test_sparse_optimizer_without_a_cpu_kernel_is_a_clear_error(tmp_path, capsys):
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"),
                       "data.synthetic.rows={train: 500, valid: 100, test: 100}", "train.max_steps=1",
                       "train.sparse_optimizer={name: adam, lr: 0.001}")  # fmt: skip
    assert code == 2 and "no fused CPU kernel" in err and "rowwise_adagrad" in err


def test_a_split_of_more_sparse_fields_than_the_soft_open_file_limit_prepares(tmp_path, capsys):
    """A split holds two scratch files open per vocabulary field while it is written: with Linux's default
    soft limit of 1024 open files, ~500 sparse fields failed with "Too many open files (check the path and the
    disk)". Commands raise the soft limit to the hard one (here: a soft limit of 256, 150 fields)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard limit of open files, {hard}, is below what the test needs")
    names = [f"c{j}" for j in range(150)]
    rows = [",".join([str(i % 2), *(str((i + j) % 5) for j in range(len(names)))]) for i in range(40)]
    (tmp_path / "wide.csv").write_text("\n".join([",".join(["label", *names]), *rows]) + "\n")
    (tmp_path / "wide.yaml").write_text(
        json.dumps(
            {
                "data": {
                    "format": "csv",
                    "train": str(tmp_path / "wide.csv"),
                    "schema": {"label": "label", "sparse": [{"name": n} for n in names]},
                },
                "model": {"name": "lr"},
            }
        )
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        code, out, err = run(
            capsys, "data", "prepare", str(tmp_path / "wide.yaml"), "--out", str(tmp_path / "p")
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert code == 0, err
    assert "40 rows" in out


def test_prepare_once_then_train_runs_on_it(tmp_path, capsys):
    train = frappe_like(tmp_path / "train.csv", GOOD)
    valid = frappe_like(tmp_path / "valid.csv", GOOD[:20])
    data = [f"data.train={train}", f"data.valid={valid}"]
    common = ["train.max_steps=2", "train.batch_size=16", "train.progress=false", "model.name=lr"]
    code, out, err = run(
        capsys, "data", "prepare", str(CONFIGS / "frappe.yaml"), *data, "--out", str(tmp_path / "prep")
    )
    assert code == 0, err
    assert "train" in out and "64 rows" in out and "data.prepared=" in out
    assert (tmp_path / "prep" / "preprocess.json").is_file() and (
        tmp_path / "prep" / "data" / "valid"
    ).is_dir()
    # Preparing again clears what a killed preparation left (it stayed for good, however large).
    (tmp_path / "prep" / "data" / ".valid.k1ll.tmp").mkdir()
    code, _, err = run(
        capsys, "data", "prepare", str(CONFIGS / "frappe.yaml"), *data, "--out", str(tmp_path / "prep")
    )
    assert code == 0 and not (tmp_path / "prep" / "data" / ".valid.k1ll.tmp").exists(), err
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "prep").rglob("*")}
    prepared = f"data.prepared={tmp_path / 'prep'}"
    for name in ("a", "b"):  # two runs share the preparation
        code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), *data, prepared, *common,
                           "--out", str(tmp_path / name))  # fmt: skip
        assert code == 0, err
        assert not (tmp_path / name / "data").exists()  # the run read the prepared splits
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "prep").rglob("*")} == before  # and never wrote them
    # the same run prepared in its own directory gives the same vocabularies and the same model
    code, _, err = run(
        capsys, "train", str(CONFIGS / "frappe.yaml"), *data, *common, "--out", str(tmp_path / "own")
    )
    assert code == 0, err
    own = json.loads((tmp_path / "own" / "preprocess.json").read_text())
    shared = json.loads((tmp_path / "a" / "preprocess.json").read_text())
    assert own["vocabs"] == shared["vocabs"]
    assert (
        json.loads((tmp_path / "own" / "report.json").read_text())["valid"]
        == json.loads((tmp_path / "a" / "report.json").read_text())["valid"]
    )
    # eval reads the run's own preprocess.json
    code, out, err = run(capsys, "eval", str(tmp_path / "a"), "--data", str(valid))
    assert code == 0 and json.loads(out)["rows"] == 20, err


def test_a_preparation_killed_mid_write_leaves_no_temporary_split_behind(tmp_path, capsys):
    """SIGKILL inside a split's write leaves its temporary directory (as large as the split: 70 MB for the
    demo's train) in DIR/data; the next `data prepare` into DIR (or sweep sharing it) kept it forever."""
    train = frappe_like(tmp_path / "train.csv", GOOD)
    data = [f"data.train={train}", f"data.valid={train}"]
    prep = tmp_path / "prep"
    left = prep / "data" / ".train.k1ll3d.tmp"
    (left / ".scratch").mkdir(parents=True)
    (left / "label.bin").write_bytes(b"\0" * 64)
    code, _, err = run(capsys, "data", "prepare", str(CONFIGS / "frappe.yaml"), *data, "--out", str(prep))
    assert code == 0, err
    assert sorted(p.name for p in (prep / "data").iterdir()) == ["train", "valid"]


def test_prepare_never_writes_into_a_run(tmp_path, capsys):
    """`data prepare --out RUN` refitted RUN/preprocess.json from its config: eval and export then mapped
    ids with vocabularies the run's tables were never trained with."""
    train = frappe_like(tmp_path / "train.csv", GOOD)
    data = [f"data.train={train}", f"data.valid={train}"]
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), *data, "train.max_steps=1",
                       "train.batch_size=16", "train.progress=false", "model.name=lr", "--out", str(tmp_path / "run"))  # fmt: skip
    assert code == 0, err
    before = (tmp_path / "run" / "preprocess.json").read_bytes()
    other = frappe_like(tmp_path / "other.csv", GOOD[:40])
    code, _, err = run(capsys, "data", "prepare", str(CONFIGS / "frappe.yaml"), f"data.train={other}",
                       f"data.valid={train}", "--out", str(tmp_path / "run"))  # fmt: skip
    assert code == 2 and "--out" in err and "is a run directory" in err, err
    assert (tmp_path / "run" / "preprocess.json").read_bytes() == before


def test_a_prepared_dir_that_does_not_match_is_refused(tmp_path, capsys):
    train = frappe_like(tmp_path / "train.csv", GOOD)
    other = frappe_like(tmp_path / "other.csv", GOOD[:40])
    data = [f"data.train={train}", f"data.valid={train}"]
    code, _, err = run(
        capsys, "data", "prepare", str(CONFIGS / "frappe.yaml"), *data, "--out", str(tmp_path / "prep")
    )
    assert code == 0, err
    prepared = f"data.prepared={tmp_path / 'prep'}"
    common = ["train.max_steps=2", "train.batch_size=16", "train.progress=false", "model.name=lr"]
    for change, words in (
        ([f"data.train={other}", f"data.valid={train}"], "other training data"),  # another training file
        (['data.options={delimiter: ","}', *data], "other training data"),  # other reading settings
        ([f"data.train={train}", f"data.valid={other}"], "valid split"),  # another valid file
    ):
        code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), *change, prepared, *common,
                           "--out", str(tmp_path / "run"))  # fmt: skip
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "data.prepared" in err and words in err and "recscale data prepare" in err, err
        assert not (tmp_path / "run").exists()
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), *data, f"data.prepared={tmp_path}", *common,
                       "--out", str(tmp_path / "run"))  # fmt: skip
    assert code == 2 and "not a prepared data directory" in err
    code, _, err = run(
        capsys,
        "data",
        "prepare",
        str(CONFIGS / "frappe.yaml"),
        *data,
        prepared,
        "--out",
        str(tmp_path / "p2"),
    )
    assert code == 2 and "data.prepared" in err


def test_a_prepared_dir_keeps_its_dropped_rows_and_refuses_on_bad_row_error(tmp_path, capsys):
    train = frappe_like(tmp_path / "train.csv", [*GOOD, "x,1,2,3,4,5,6,7,8,9,10", "1,1,2"])
    data = [f"data.train={train}", f"data.valid={train}"]
    code, out, err = run(capsys, "data", "prepare", str(CONFIGS / "frappe.yaml"), *data, "data.on_bad_row=skip",
                         "--out", str(tmp_path / "prep"))  # fmt: skip
    assert code == 0 and "2 bad rows dropped" in out, err
    prepared = f"data.prepared={tmp_path / 'prep'}"
    common = ["train.max_steps=2", "train.batch_size=16", "train.progress=false", "model.name=lr"]
    # the prepared splits lack rows that on_bad_row: error (the default) stops at
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), *data, prepared, *common,
                       "--out", str(tmp_path / "strict"))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "on_bad_row" in err and "dropped 2 bad rows" in err and "train.csv line 66" in err, err
    # with skip, the run reports the rows the preparation dropped, as a run reading the file does
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), *data, prepared, "data.on_bad_row=skip",
                       *common, "--out", str(tmp_path / "run"))  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["skipped_rows"] == {"train": 2, "valid": 2}
    # and so does a run resumed on its own materialised splits
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), *data, "data.on_bad_row=skip", *common,
                       "--out", str(tmp_path / "own"))  # fmt: skip
    assert code == 0, err
    code, _, err = run(capsys, "train", "--resume", "--out", str(tmp_path / "own"), "train.max_steps=4")
    assert code == 0, err
    report = json.loads((tmp_path / "own" / "report.json").read_text())
    assert report["steps"] == 4 and report["skipped_rows"] == {"train": 2, "valid": 2}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train", "C", "--nproc", "2", "--max-restarts", "-1"],
            "argument --max-restarts: must be >= 0, got -1",
        ),
        (["train", "C", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
        (
            ["train", "C", "--nproc", "2", "--local-world-size", "0"],
            "argument --local-world-size: must be >= 1",
        ),
        (["train", "C", "--nproc", "two"], "argument --nproc: expected an integer, got 'two'"),
        (["serve", "M", "--port", "99999"], "argument --port: must be 0 to 65535, got 99999"),
        (
            ["serve", "M", "--max-wait-ms", "nan"],
            "argument --max-wait-ms: must be a finite number >= 0, got nan",
        ),
        (["serve", "M", "--workers", "0"], "argument --workers: must be >= 1, got 0"),
        (["data", "inspect", "F", "--max-rows", "0"], "argument --max-rows: must be >= 1, got 0"),
        (
            ["shard", "plan", "C", "--out", "P", "--local-world-size", "0"],
            "argument --local-world-size: must be >= 1",
        ),
        (["retrieval", "build", "D", "--out", "O", "--k", "0"], "argument --k: must be >= 1, got 0"),
    ],
)
def test_out_of_range_flags_are_refused_by_the_parser(capsys, argv, message):
    """Counts and ports out of range are one line before anything runs (a negative --max-restarts used to
    train, then fail in torch elastic with a traceback; --port 99999 was an internal error)."""
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_batch_that_does_not_split_over_nproc_is_refused_before_the_launch(tmp_path, capsys):
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"),
                       "train.batch_size=128", "--nproc", "3")  # fmt: skip
    assert code == 2 and "must be a multiple of the 3 ranks" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("nproc", [[], ["--nproc", "1"]])
@pytest.mark.parametrize("qcomms", ["forward=int8", "backward=fp16", "dense=bf16"])
def test_qcomms_on_one_process_are_refused_before_a_file_is_written(tmp_path, capsys, nproc, qcomms):
    """One process sends nothing between ranks: without a word, TorchRec skipped the embedding codecs
    (forward, backward) and DDP's hook (dense) rounded the dense gradients with nothing sent."""
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"),
                       "data.synthetic.rows={train: 500, valid: 100, test: 100}", "train.max_steps=1",
                       f"distributed.qcomms.{qcomms}", *nproc)  # fmt: skip
    assert code == 2 and "distributed.qcomms" in err and "one process" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_an_out_that_holds_a_run_is_refused_before_the_launch(tmp_path, capsys):
    """Checked once, here: every rank used to print 'already holds a run', then 'rank N exited with code 2'."""
    run_dir = tmp_path / "r"
    (run_dir / "ckpt").mkdir(parents=True)
    (run_dir / "report.json").write_text("{}")
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(run_dir), "--nproc", "2")
    assert code == 2 and "already holds a run; pass resume=True (CLI: --resume)" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "quant, words",
    [
        ("{format: mxfp8_e4m3, where: [nope]}", "model.quant.where: nope matches no linear layer"),
        ("{layers: {nope: mxfp4}}", "model.quant.layers: nope is no linear layer of this model"),
    ],
)
def test_a_quant_plan_naming_no_layer_is_refused_before_the_launch(
    tmp_path, capsys, monkeypatch, quant, words
):
    """Each rank found it in its own build, after the launch and the data's preparation (30 s on 2 ranks)."""
    import recscale.distributed.launch as launch

    started = []
    monkeypatch.setattr(launch, "launch", lambda command, *_: started.append(command))
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"), "--nproc", "2",
                       f"model.quant={quant}")  # fmt: skip
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not started and not (tmp_path / "r").exists()


def test_a_trainer_checks_its_model_before_preparing_the_data(tmp_path, monkeypatch):
    import recscale.train.loop as loop
    from recscale.config import load_config
    from recscale.errors import ConfigError

    def prepared(*_):
        raise AssertionError("the data was prepared before the model was checked")

    monkeypatch.setattr(loop, "prepare_run_data", prepared)
    cfg = load_config(CONFIGS / "demo.yaml", ["model.quant={format: mxfp4, where: [head.*, nope]}"])
    with pytest.raises(ConfigError, match="model.quant.where: nope matches no linear layer"):
        loop.Trainer(cfg, tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_debug_reaches_the_ranks_of_nproc(tmp_path, capsys, monkeypatch):
    """--debug showed the launcher's traceback only: the ranks, where the error was, ran without it."""
    import recscale.distributed.launch as launch

    started = []
    monkeypatch.setattr(launch, "launch", lambda command, *_: started.append(command))
    code, _, _ = run(
        capsys, "--debug", "train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"), "--nproc", "2"
    )
    assert code == 0 and started[0][:4] == ["-m", "recscale.cli", "--debug", "train"]


@pytest.mark.parametrize("name", ["reduce_scatter_tensor", "all_gather_into_tensor"])
def test_upstream_deprecated_collectives_do_not_warn(name):
    """TorchRec's row-wise tables and FSDP2 call them: every rank of a row_wise or fsdp job printed the
    notice (4 lines of 2 ranks), which the user cannot act on."""
    import warnings

    from recscale.quiet import quiet_upstream

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # what reaches a user; quiet_upstream's filters go before it
        quiet_upstream()
        message = f"`torch.distributed.{name}` is deprecated. Please use `torch.distributed.x` instead."
        warnings.warn_explicit(message, FutureWarning, "c10d_logger.py", 83, "torch.distributed.c10d_logger")
    assert not seen


def test_recscales_own_warnings_are_one_line(tmp_path):
    """Python's format printed the path and line of the warning's caller and its source line: two lines
    for one thing the user can act on."""
    small = [
        "data.synthetic.rows.train=2000",
        "data.synthetic.rows.valid=500",
        "data.synthetic.rows.test=500",
    ]
    argv = ["train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"), *small, "train.progress=false"]
    done = subprocess.run(
        [sys.executable, "-m", "recscale.cli", *argv, "train.max_steps=2", "train.warmup_steps=3"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    first = done.stderr.splitlines()[0]
    assert first.startswith("warning: train.warmup_steps=3 is longer than the run's 2 steps"), done.stderr
    assert "UserWarning" not in done.stderr


def test_inspect_reads_a_csv_with_its_delimiter(tmp_path, capsys):
    """A ';' file was one column to inspect: it had no way to take data.options.delimiter."""
    path = tmp_path / "t.csv"
    path.write_text("label;a;b\n1;x;y\n0;z;w\n")
    code, out, err = run(capsys, "data", "inspect", str(path), "--delimiter", ";")
    assert code == 0, err
    assert [c["name"] for c in json.loads(out)["columns"]] == ["label", "a", "b"]


def test_eval_reads_a_directory_where_the_format_reads_one(tmp_path, capsys, shared_data):
    """MovieLens is a directory (ml-100k's files): eval takes the path the config itself gives."""
    ml = shared_data / "movielens-100k"
    code, _, err = run(capsys, "train", str(CONFIGS / "movielens.yaml"), "--out", str(tmp_path / "r"),
                       f"data.train={ml}", "train.max_steps=2", "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
    code, out, err = run(capsys, "eval", str(tmp_path / "r"), "--data", str(ml))
    assert code == 0, err
    assert 0 < json.loads(out)["auc"] < 1


@pytest.mark.parametrize("where", ["a directory", "under a file", "where no file can be made"])
def test_an_output_path_in_the_way_is_named_as_given(tmp_path, capsys, where):
    """--out naming a directory, running through a file, or in a directory that takes no files used to be
    reported on a temporary file's name (`.plan.json.x1y2.tmp: Is a directory`) or as 'File exists'."""
    (tmp_path / "f").write_text("a file")
    (tmp_path / "d").mkdir()
    out = {"a directory": tmp_path / "d", "under a file": tmp_path / "f/plan.json"}.get(
        where, Path("/proc/p.json")
    )
    code, _, err = run(capsys, "shard", "plan", str(CONFIGS / "demo.yaml"), "--out", str(out), "--nproc", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    # The first two before the planning (recscale.io.check_output), the last when the plan is written.
    assert {
        "a directory": f"error: --out {out} is a directory; name the file to write",
        "under a file": f"error: --out {out}: {tmp_path / 'f'} is a file, not a directory; name the file to write",
    }.get(where, f"error: {out}: No such file or directory") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"] and not any((tmp_path / "d").iterdir())


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["train", "C", "--bogus"], "recscale train"),
        (["data", "inspect", "F", "x=1"], "recscale data inspect"),
    ],
)
def test_an_unknown_option_is_named_by_its_command(capsys, argv, prog):
    """It was `recscale: unrecognized arguments: --bogus (see recscale --help)`, whose help lists no options."""
    code, _, err = run(capsys, *argv)
    assert code == 2 and err == f"error: {prog}: unrecognized arguments: {argv[-1]} (see {prog} --help)\n"


def test_shard_plan_refuses_a_batch_the_ranks_cannot_split(tmp_path, capsys):
    """`train --nproc 3` refuses batch 2048; `shard plan --nproc 3` planned that run anyway."""
    out = tmp_path / "plan.json"
    code, _, err = run(capsys, "shard", "plan", str(CONFIGS / "demo.yaml"), "--out", str(out), "--nproc", "3",
                       "data.synthetic.rows={train: 512, valid: 64}")  # fmt: skip
    assert code == 2 and not out.exists()
    assert (
        err
        == "error: train.batch_size 2048 must be a multiple of the 3 ranks: the global batch is split over them\n"
    )


def test_the_summary_prints_the_held_out_report_half(capsys):
    """With data.report_fraction the held-out half is the number nothing was tuned on; the summary
    printed only the selection half."""
    from recscale.cli import print_report

    m = {"auc": 0.9, "logloss": 0.3, "ne": 0.5, "calibration": 1.0, "rows": 10}
    print_report({"model": "lr", "steps": 1, "examples_per_s": 1, "mflops_per_example": 0.0, "run_dir": "r",
                  "parameters": {"dense": 1, "sparse": 1}, "valid": m, "report": m | {"rows": 11, "gauc": 0.7}})  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert "valid  auc 0.9000  logloss 0.3000  ne 0.5000  calibration 1.0000  rows 10" in lines
    assert "report auc 0.9000  logloss 0.3000  ne 0.5000  calibration 1.0000  gauc 0.7000  rows 11" in lines


@pytest.mark.parametrize(("mflops", "text"), [(0.00032, "0.000320 MFLOP"), (0.590848, "0.591 MFLOP")])
def test_the_summary_shows_a_small_models_flops(capsys, mflops, text):
    """LR and FM cost a few hundred FLOPs per example: the summary printed 0.000 MFLOP/example."""
    from recscale.cli import print_report

    print_report({"model": "lr", "steps": 1, "examples_per_s": 1, "mflops_per_example": mflops, "run_dir": "r",
                  "parameters": {"dense": 1, "sparse": 1}})  # fmt: skip
    assert f"  ·  {text}/example (forward)" in capsys.readouterr().out


def test_the_summary_says_when_nothing_was_evaluated(capsys):
    """A run on a train file alone printed its speed and parameters and no word of quality."""
    from recscale.cli import print_report

    report = {"model": "lr", "steps": 1, "examples_per_s": 1, "mflops_per_example": 0.0, "run_dir": "r",
              "parameters": {"dense": 1, "sparse": 1}}  # fmt: skip
    print_report(report)
    assert "note: the run has no valid or test split, so nothing was evaluated" in capsys.readouterr().out
    m = {"auc": 0.9, "logloss": 0.3, "ne": 0.5, "calibration": 1.0, "rows": 10}
    print_report(report | {"test": m})
    assert "nothing was evaluated" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.name=dhen", "model.heads=3"], "DHEN heads (3) must divide the embedding dim (16)"),
        (["model.name=finalmlp", "model.fs1_context=[nope]"], "FinalMLP context features ['nope']"),
        (["model.name=xdeepfm", "model.cin_layers=[3, 4]"], "split_half"),
    ],
)
def test_model_parameters_that_do_not_fit_are_one_config_line(tmp_path, capsys, overrides, words):
    # These were "internal error ValueError: ... report it", raised while building the model.
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"),
                       "data.synthetic.rows={train: 500, valid: 100, test: 100}", "train.max_steps=1",
                       *overrides)  # fmt: skip
    assert code == 2 and err.startswith("error: model (") and "internal error" not in err, err
    assert words in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["train", "data prepare", "sweep"])
def test_a_directory_another_process_writes_is_refused(tmp_path, capsys, command):
    """Two trainings into one --out at once both exited 0 with one run's config.yaml, the other's
    report.json and checkpoints, and metrics.jsonl interleaved. The second is refused, and leaves the
    first's directory alone."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "theirs.txt").write_text("the other process's file")
    holder = subprocess.Popen(  # holds out as a running command would, until its stdin closes
        [sys.executable, "-c", f"from recscale.io import Hold; h = Hold({str(out)!r}); print('held', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        tiny = ["data.synthetic.rows={train: 256, valid: 64}", "train.max_steps=1"]
        if command == "sweep":
            sweep = tmp_path / "sweep.yaml"
            sweep.write_text(
                f"base: {CONFIGS / 'demo.yaml'}\noverrides: {json.dumps(tiny)}\nout: {out}\n"
                "families: {lr: {model: {name: lr}, sizes: [{}]}}\n"
            )
            argv = ["sweep", str(sweep)]
        else:
            argv = [*command.split(), str(CONFIGS / "demo.yaml"), *tiny, "--out", str(out)]
        code, _, err = run(capsys, *argv)
    finally:
        holder.communicate("")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{out}: in use by another recscale process" in err and "wait for it to finish" in err
    assert sorted(p.name for p in out.iterdir()) == [".lock", "theirs.txt"]
    # Once that process has ended, the directory is free.
    assert run(capsys, "train", str(CONFIGS / "demo.yaml"), *tiny, "--out", str(out))[0] == 0


def test_a_second_hold_in_one_process_keeps_the_directory_held(tmp_path):
    """A POSIX lock drops when any descriptor of its file closes: a first Hold collected (a notebook's
    failed Trainer, rebound) let another process into the directory a second Hold still held."""
    import gc

    from recscale.io import Hold

    def other_process_gets_it() -> bool:
        probe = f"from recscale.io import Hold, InUse\ntry:\n    Hold({str(tmp_path)!r})\nexcept InUse:\n    exit(3)"
        return subprocess.run([sys.executable, "-c", probe]).returncode == 0

    first, second = Hold(tmp_path), Hold(tmp_path)
    del first
    gc.collect()
    assert not other_process_gets_it()
    second.release()
    assert other_process_gets_it()


@pytest.mark.parametrize(
    "script", ["profile_step.py", "op_time.py", "step_time.py", "device_codecs.py", "fuxictr_prepare.py"]
)
def test_benches_that_parse_their_own_arguments_answer_help(script):
    """`--help` was a traceback: profile_step.py and op_time.py read it as the config's path,
    device_codecs.py asserted CUDA, fuxictr_prepare.py imported fuxictr first; step_time.py exited 1."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    done = subprocess.run(
        [sys.executable, str(bench / script), "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.startswith(f"usage: {script} "), done.stderr
    assert "Traceback" not in done.stderr


def test_the_training_report_notes_a_split_of_one_class(capsys):
    from recscale.cli import print_report

    split = {"auc": float("nan"), "logloss": 0.5, "ne": float("nan"), "calibration": 0.9, "rows": 10}
    report = {"model": "lr", "steps": 1, "examples_per_s": 1.0, "parameters": {"dense": 1, "sparse": 1},
              "mflops_per_example": 0.0, "valid": split, "run_dir": "r"}  # fmt: skip
    print_report(report)
    assert "note: valid auc, ne are null: all 10 rows are positive" in capsys.readouterr().out


def test_a_permission_error_says_to_fix_permissions_first():
    """EACCES said 'choose a path you may write' for files recscale only reads (a run's checkpoint, data)."""
    import errno

    from recscale.cli import _os_error_line

    line = _os_error_line(PermissionError(errno.EACCES, "Permission denied", "runs/x/best/.metadata"))
    assert line == (
        "runs/x/best/.metadata: Permission denied (permission denied; fix its permissions "
        "(an output: or choose a path you may write))"
    )


TINY = ["data.synthetic.rows={train: 512, valid: 128, test: 128}", "data.num_workers=0", "model.embedding.dim=8",
        "model.num_layers=1", "train.batch_size=64", "train.max_steps=2", "train.progress=false"]  # fmt: skip


def test_the_report_prints_where_stdout_cannot_encode_it(tmp_path, monkeypatch):
    """In an ASCII locale (LC_ALL=C with PYTHONUTF8=0) the report's '·' raised UnicodeEncodeError once the run
    had trained: 'internal error', exit code 1. What stdout cannot encode is escaped, as on stderr; a file
    name's undecodable byte (a surrogate) is written as that byte."""
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii", errors="surrogateescape", write_through=True)
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert main(["train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"), *TINY]) == 0
    assert "model wukong  \\xb7  2 steps" in raw.getvalue().decode("ascii")
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    assert main(["--help"]) == 0
    print("runs/\udce9 \u00b7")
    assert raw.getvalue().endswith(b"runs/\xe9 \xc2\xb7\n")


def test_a_command_started_with_stderr_closed_runs(tmp_path):
    """`recscale train ... 2>&-` (or a daemon's setup): Python leaves sys.stderr None, on which the progress
    check called isatty(): 'internal error AttributeError' before the first step."""
    argv = ["train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r"), *TINY, "train.progress=true"]
    done = subprocess.run([sys.executable, "-m", "recscale.cli", *argv], stdout=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.close(2), timeout=300)  # fmt: skip
    assert done.returncode == 0 and "run directory:" in done.stdout, done.stdout
    assert (tmp_path / "r" / "report.json").is_file()


def test_a_name_an_ascii_locale_cannot_express_is_one_line(tmp_path):
    """Under LC_ALL=C with PYTHONUTF8=0 file names are ASCII: a config whose base: names bäse.yaml failed with
    'internal error UnicodeEncodeError' (exit 1). The line says to run under a UTF-8 locale."""
    (tmp_path / "bäse.yaml").write_text(f"base: {CONFIGS / 'demo.yaml'}\n")
    (tmp_path / "run.yaml").write_text("base: bäse.yaml\n")
    env = os.environ | {"LC_ALL": "C", "PYTHONUTF8": "0"}
    argv = ["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "r")]
    done = subprocess.run(
        [sys.executable, "-m", "recscale.cli", *argv], env=env, capture_output=True, timeout=300
    )
    err = done.stderr.decode("ascii").strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, err
    assert "holds '\\xe4', which this locale's encoding (ascii) cannot express" in err[0], err
    assert "run under a UTF-8 locale" in err[0] and not (tmp_path / "r").exists()


def test_an_override_an_ascii_locale_did_not_decode_says_so():
    """Under LC_ALL=C with PYTHONUTF8=0 the argument 'model.name=wükong' arrives as surrogate escapes, which
    were reported as 'the value is not valid YAML (unacceptable character #xdcc3 ...)'."""
    from recscale.config_files import apply_overrides
    from recscale.errors import ConfigError

    undecoded = "model.name=w\udcc3\udcbckong"  # the UTF-8 bytes of 'ü', as an ASCII locale hands them over
    with pytest.raises(ConfigError) as e:
        apply_overrides({}, [undecoded])
    assert str(e.value).startswith("override 'model.name=wükong' holds characters this locale's encoding")
    assert str(e.value).endswith("run under a UTF-8 locale (e.g. LC_ALL=C.UTF-8) or set PYTHONUTF8=1")


def test_a_name_that_is_not_utf8_is_one_line(tmp_path, capsys):
    """An --out of Latin-1 bytes ('r\\xe9') failed with 'internal error UnicodeEncodeError ... surrogates not
    allowed' (TensorBoard writes only UTF-8 names). The line names it and says to rename it."""
    out = tmp_path / os.fsdecode(b"r\xe9")
    code, _, err = run(capsys, "train", str(CONFIGS / "demo.yaml"), "--out", str(out), *TINY)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "r\\xe9" in err and "is not UTF-8" in err and "rename it" in err, err


def test_bayes_floor_line_leaves_out_an_undefined_ne(capsys):
    """A valid split of one class printed the synthetic teacher's floor as 'ne nan'; ne is left out there
    (the split's note says why), and printed where defined."""
    from recscale.cli import print_report

    valid = {"auc": math.nan, "logloss": 0.1, "ne": math.nan, "calibration": 0.9, "rows": 8}
    report = {"model": "lr", "steps": 2, "examples_per_s": 10, "parameters": {"dense": 1, "sparse": 2},
              "mflops_per_example": 0.001, "valid": valid, "run_dir": "r"}  # fmt: skip
    print_report(report | {"bayes_logloss": 0.05, "bayes_ne": math.nan})
    out = capsys.readouterr().out
    assert "Bayes floor (synthetic teacher): logloss 0.0500\n" in out, out
    assert "note: valid auc, ne are null: all 8 rows are positive" in out, out
    print_report(report | {"bayes_logloss": 0.05, "bayes_ne": 0.5})
    assert "Bayes floor (synthetic teacher): logloss 0.0500  ne 0.5000\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"RANK": "1"}, "the environment sets RANK=1 but not WORLD_SIZE, as a launcher sets both"),
        ({"WORLD_SIZE": "2"}, "the environment sets WORLD_SIZE=2 but not RANK"),
        ({"RANK": "1", "WORLD_SIZE": "1"}, "the environment's RANK=1 WORLD_SIZE=1 is no rank of a job"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"},
            "the environment variable LOCAL_RANK='x' is not a",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2"},
            "the environment sets RANK and WORLD_SIZE, as torchrun does, but not MASTER_ADDR",
        ),
    ],
)
def test_a_rank_left_in_the_environment_is_one_line(tmp_path, monkeypatch, capsys, env, said):
    """RANK=1 left in the shell failed a local train inside gloo ('rank < size. 1 vs 1', an internal error),
    RANK and WORLD_SIZE without torchrun's MASTER_ADDR inside torch's rendezvous, and made eval print
    nothing (rank 0 alone prints): every command says what is wrong with the environment first."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said}") and err.count("\n") == 1
    assert "unset them for a run in one process" in err and not (tmp_path / "r").exists()


def test_a_run_or_preparation_inside_a_split_folder_is_refused_before_it_writes(tmp_path, capsys):
    """`train --out parts/run` with data.train: parts/ made its run a folder of the split, which a later read
    of the split refuses (or, a pattern's, reads its files as data); data prepare --out likewise."""
    parts = tmp_path / "parts"
    parts.mkdir()
    frappe_like(parts / "part-0.csv", GOOD)
    data = [f"data.train={parts}", f"data.valid={parts / 'part-0.csv'}", "train.max_steps=1"]
    for argv in (["train", str(CONFIGS / "frappe.yaml"), "--out"], ["data", "prepare", str(CONFIGS / "frappe.yaml"), "--out"]):  # fmt: skip
        code, _, err = run(capsys, *argv, str(parts / "out"), *data)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{parts / 'out'} is inside data.train {parts}, whose files are the split; choose" in err
        assert not (parts / "out").exists()


@pytest.mark.parametrize(("pattern", "out"), [("parts/**/*.csv", "parts/runs/r1"), ("runs/*/*", "runs/r1")])
def test_a_run_whose_files_a_split_pattern_would_match_is_refused(tmp_path, capsys, pattern, out):
    """`data.train: parts/**/*.csv` with `--out parts/runs/r1`, or `runs/*/*` with `--out runs/r1`: the run's own
    files (report.json, config.yaml, ...) would be read as parts of the split by its next read."""
    (tmp_path / "parts" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "old").mkdir(parents=True)
    frappe_like(tmp_path / "parts" / "a" / "part-0.csv", GOOD)
    frappe_like(tmp_path / "runs" / "old" / "part-0.csv", GOOD)
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / out),
                       f"data.train={tmp_path / pattern}", "data.valid=null", "train.max_steps=1")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        f"{tmp_path / out}: data.train {tmp_path / pattern} would match files written there as parts" in err
    )
    assert not (tmp_path / out).exists()
    code, _, err = run(capsys, "train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "elsewhere"),
                       f"data.train={tmp_path / pattern}", "data.valid=null", "train.max_steps=1",
                       "train.progress=false", "model.name=lr")  # fmt: skip
    assert code == 0, err
