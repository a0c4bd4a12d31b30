"""``data.valid_fraction``: one labelled file read as a training and a valid split."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from recscale.cli import main
from recscale.config import DataConfig, load_config
from recscale.errors import ConfigError
from recscale.train.data import prepare_run_data

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ROWS = 500
SCHEMA = {"label": "label", "dense": [{"name": "row"}], "sparse": [{"name": "user"}]}


def one_file(path: Path) -> Path:
    """ROWS rows whose dense ``row`` is the row's index and whose ``user`` is ``u<index>``: each id on one row."""
    path.write_text("label,row,user\n" + "".join(f"{i % 2},{i},u{i}\n" for i in range(ROWS)))
    return path


def cut(train: Path, run: Path, chunk_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the training split's row indices, the valid split's, which users the vocabulary holds (ROWS,) bool)."""
    data = DataConfig(
        format="csv", train=str(train), schema=SCHEMA, valid_fraction=0.2, chunk_rows=chunk_rows
    )
    pre, splits, _ = prepare_run_data(data, run, resume=False, main=True, progress=False)
    assert set(splits) == {"train", "valid"}
    rows = [
        splits[s].gather_arrays(np.arange(len(splits[s])))[0][:, 0].astype(np.int64)
        for s in ("train", "valid")
    ]
    return rows[0], rows[1], pre.lookup("user", pa.array([f"u{i}" for i in range(ROWS)])) != 0


def test_the_file_is_cut_in_two_the_same_way_whatever_the_chunks(tmp_path):
    """Every row in exactly one split, about the fraction in valid, and the same rows whatever the read's chunk
    size (each chunk hashes its rows' positions in the whole read, not in the chunk); the vocabulary is
    fitted on the training rows only: an id seen only in valid rows is unknown, as a valid file's would be."""
    train = one_file(tmp_path / "all.csv")
    fit, valid, known = cut(train, tmp_path / "a", chunk_rows=65536)
    assert sorted([*fit, *valid]) == list(range(ROWS)) and 0.15 * ROWS < len(valid) < 0.25 * ROWS
    assert known[fit].all() and not known[valid].any()
    again = cut(train, tmp_path / "b", chunk_rows=7)  # 72 chunks
    assert (again[0] == fit).all() and (again[1] == valid).all() and (again[2] == known).all()


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["data.valid_fraction=0.1"], "but data.valid names a file of its own"),
        (["data.valid=null", "data.valid_fraction=0.1", "data.format=movielens"],
         "but format movielens splits its ratings by time"),
    ],
)  # fmt: skip
def test_a_valid_fraction_beside_a_valid_split_is_refused(overrides, words):
    with pytest.raises(
        ConfigError, match=f"data.valid_fraction holds rows of data.train out as the valid split, {words}"
    ):
        load_config(CONFIGS / "frappe.yaml", overrides)
    with pytest.raises(ConfigError, match="format 'synthetic' reads no file and takes no valid_fraction"):
        load_config(CONFIGS / "demo.yaml", ["data.valid_fraction=0.1"])


def test_valid_rows_from_the_training_file_serve_what_a_valid_split_does():
    """report_fraction and calibrate need a valid split: one held out of the training file is one."""
    cfg = load_config(
        CONFIGS / "frappe.yaml",
        ["data.valid=null", "data.valid_fraction=0.1", "data.report_fraction=0.5", "train.calibrate=true"],
    )
    assert cfg.data.valid_fraction == 0.1


@pytest.mark.parametrize(
    ("fraction", "split", "fix"), [(1e-05, "valid", "larger"), (0.99999, "train", "smaller")]
)
def test_a_fraction_that_empties_a_split_is_one_line(tmp_path, capsys, fraction, split, fix):
    train = one_file(tmp_path / "all.csv")
    code = main(["train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"), f"data.train={train}",
                 "data.valid=null", "data.test=null", f"data.valid_fraction={fraction}", f"data.schema={SCHEMA}",
                 "model.name=lr", "train.max_steps=1", "train.progress=false"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (
        f"error: data.valid_fraction={fraction} leaves no row of data.train ({train}) for the {split} split; "
        f"give a {fix} fraction\n"
    )
    assert not (tmp_path / "run").exists()


def test_bad_rows_of_the_file_are_counted_once(tmp_path):
    """Both splits read the whole file and drop its bad rows: the report counted them under train and valid."""
    train = one_file(tmp_path / "all.csv")
    train.write_text(train.read_text() + "1,not-a-number,u1\n")
    data = DataConfig(format="csv", train=str(train), schema=SCHEMA, valid_fraction=0.2, on_bad_row="skip")
    _, _, stats = prepare_run_data(data, tmp_path / "run", resume=False, main=True, progress=False)
    assert stats["train"].skipped == 1 and stats["valid"].skipped == 0


def test_eval_scores_the_runs_own_splits_as_its_report_did(tmp_path, capsys):
    """The valid rows of data.valid_fraction are no file to give eval: `eval --split` scores the run's own
    rows, each half of data.report_fraction as report.json scored it, to the last digit."""
    train = one_file(tmp_path / "all.csv")
    code = main(["train", str(CONFIGS / "frappe.yaml"), "--out", str(tmp_path / "run"), f"data.train={train}",
                 "data.valid=null", "data.valid_fraction=0.4", "data.report_fraction=0.5", f"data.schema={SCHEMA}",
                 "model.name=lr", "train.max_steps=3", "train.progress=false"])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    capsys.readouterr()
    for split in ("valid", "report"):
        assert main(["eval", str(tmp_path / "run"), "--split", split]) == 0
        scored = json.loads(capsys.readouterr().out)
        # every held-out row's user is on that row only: none is in the vocabulary, and eval says so
        assert scored.pop("unknown_id_fields") == ["user"] and scored == report[split]
    assert main(["eval", str(tmp_path / "run"), "--split", "train"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows + report["valid"]["rows"] + report["report"]["rows"] == ROWS
    assert main(["eval", str(tmp_path / "run"), "--split", "valid", "--data", str(train)]) == 2
    assert capsys.readouterr().err == (
        "error: eval --split valid scores the run's own valid rows, which --data does not apply to; leave it out, "
        "or score a file with --data\n"
    )
