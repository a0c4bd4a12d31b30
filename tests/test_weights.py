"""Per-row importance weights (``data.schema.weight``): read, materialised, trained on, scored."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recscale.cli import main
from recscale.config import load_config
from recscale.data.dataset import ArrayDataset
from recscale.data.materialize import materialize
from recscale.data.readers import ReadStats, read_batches
from recscale.data.schema import Schema
from recscale.errors import ConfigError, DataError
from recscale.models.blocks import Calibration
from recscale.serve.scorer import Scorer
from recscale.train.loop import Trainer
from recscale.train.metrics import auc, ctr_metrics, group_auc, undefined_note
from recscale.train.runs import eval_run

SCHEMA = {"label": "label", "weight": "w", "dense": [{"name": "x"}], "sparse": [{"name": "user"}]}


def random_rows(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits with ties, 0/1 labels, integer weights 0..3, groups 0..5), each (n,)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, generator=g).round(decimals=1)
    labels = (torch.rand(n, generator=g) < 0.35).double()
    return logits, labels, torch.randint(0, 4, (n,), generator=g), torch.randint(0, 6, (n,), generator=g)


@pytest.mark.parametrize("seed", range(5))
def test_integer_weights_score_as_the_rows_repeated(seed):
    """Every weighted metric is the unweighted one of the data with each row repeated by its weight (0: gone)."""
    logits, labels, w, groups = random_rows(seed, 400)
    rep = torch.repeat_interleave(torch.arange(len(w)), w)
    weighted, repeated = ctr_metrics(logits, labels, w.double()), ctr_metrics(logits[rep], labels[rep])
    for k in ("auc", "logloss", "ne", "calibration"):
        assert weighted[k] == pytest.approx(repeated[k], rel=1e-12, abs=1e-12), k
    assert weighted["weight_sum"] == len(rep) and weighted["rows"] == len(w)
    g_weighted, g_repeated = (
        group_auc(logits, labels, groups, w.double()),
        group_auc(logits[rep], labels[rep], groups[rep]),
    )
    assert g_weighted["gauc"] == pytest.approx(g_repeated["gauc"], rel=1e-12, abs=1e-12)


def test_weighted_auc_is_the_weighted_pair_count():
    """Brute force: each (positive, negative) pair weighs w_pos * w_neg, ranked right 1, tied one half."""
    rng = np.random.default_rng(3)
    z, y, w = np.round(rng.normal(size=60), 1), rng.random(60) < 0.4, rng.random(60) * 3
    pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
    d = z[pos][:, None] - z[neg][None, :]
    pair = w[pos][:, None] * w[neg][None, :]
    want = float((pair * ((d > 0) + 0.5 * (d == 0))).sum() / pair.sum())
    got = auc(torch.from_numpy(z), torch.from_numpy(y.astype(np.float64)), torch.from_numpy(w))
    assert got == pytest.approx(want, rel=1e-12)
    assert np.isnan(
        auc(torch.from_numpy(z), torch.from_numpy(y.astype(np.float64)), torch.from_numpy(w * ~y))
    )


@pytest.mark.parametrize("seed", range(5))
def test_weights_of_one_give_the_unweighted_metrics_exactly(seed):
    logits, labels, _, groups = random_rows(seed, 500)
    ones = torch.ones(len(labels))
    plain, weighted = ctr_metrics(logits, labels), ctr_metrics(logits, labels, ones)
    assert {k: weighted[k] for k in plain} == plain  # to the last bit, not merely within 1e-12
    assert group_auc(logits, labels, groups, ones) == group_auc(logits, labels, groups)


def test_calibration_fits_integer_weights_as_the_rows_repeated():
    logits, labels, w, _ = random_rows(7, 400)
    logits = 1.7 * logits + 0.3 * labels
    rep = torch.repeat_interleave(torch.arange(len(w)), w)
    weighted = Calibration().fit(logits, labels, w.double())
    assert weighted == pytest.approx(Calibration().fit(logits[rep], labels[rep]), abs=1e-6)
    assert Calibration().fit(logits, labels, torch.ones(len(w))) == Calibration().fit(logits, labels)


# ---------------------------------------------------------------- reading


def read(path: Path, on_bad_row: str = "error", fmt: str = "csv") -> tuple[list[pa.RecordBatch], ReadStats]:
    stats = ReadStats()
    schema = Schema.model_validate(SCHEMA)
    return list(read_batches(path, fmt, schema, on_bad_row=on_bad_row, stats=stats)), stats  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cell", "why"),
    [
        ("abc", "weight 'abc' is not a number"),
        ("-1", "weight '-1' is negative"),
        ("nan", "weight 'nan' is NaN or infinite"),
        ("inf", "weight 'inf' is NaN or infinite"),
        ("", "weight is missing"),
        ("1e39", "weight '1e39' is beyond float32's range"),
    ],
)
def test_a_bad_weight_cell_is_a_bad_row(tmp_path, cell, why):
    path = tmp_path / "d.csv"
    path.write_text(f"label,w,x,user\n1,0.5,1,a\n0,{cell},2,b\n1,2,3,c\n")
    with pytest.raises(DataError, match=rf"^{path} line 3: {why}.*data.on_bad_row: skip") as e:
        read(path)
    assert "\n" not in str(e.value)
    batches, stats = read(path, "skip")
    assert stats.skipped == 1 and why in stats.examples[0]
    assert batches[0].column("weight").to_pylist() == [0.5, 2.0]


def test_parquet_weights_are_read_and_checked(tmp_path):
    path = tmp_path / "d.parquet"
    cols = {"label": [1, 0, 1], "w": [0.5, None, 2.0], "x": [1.0, 2.0, 3.0], "user": ["a", "b", "c"]}
    pq.write_table(pa.table(cols), path)
    with pytest.raises(DataError, match=rf"^{path} row 2: weight is missing"):
        read(path, fmt="parquet")
    pq.write_table(pa.table(cols | {"w": ["1", "0", "2"]}), path)  # numbers as text, as CSV reads them
    assert read(path, fmt="parquet")[0][0].column("weight").to_pylist() == [1.0, 0.0, 2.0]
    pq.write_table(pa.table(cols | {"w": [[1.0], [2.0], [3.0]]}), path)
    with pytest.raises(
        DataError, match="column 'w' is list<.*>; it must hold one number per row \\(the row weight\\)"
    ):
        read(path, fmt="parquet")


@pytest.mark.parametrize("fmt", ["criteo", "libsvm", "movielens"])
def test_formats_of_a_fixed_layout_refuse_a_weight_column(tmp_path, fmt):
    (tmp_path / "run.yaml").write_text(
        f"data: {{format: {fmt}, train: {tmp_path}, schema: {json.dumps(SCHEMA)}}}\nmodel: {{name: lr}}\n"
    )
    with pytest.raises(ConfigError, match=rf"data.schema.weight: format '{fmt}' has a fixed layout") as e:
        load_config(tmp_path / "run.yaml")
    assert "\n" not in str(e.value)


def test_a_feature_named_weight_clashes_only_with_row_weights():
    plain = {"label": "label", "sparse": [{"name": "weight"}]}
    assert Schema.model_validate(plain).column_names() == ["label", "weight"]
    with pytest.raises(ValueError, match="'weight' the row weights"):
        Schema.model_validate(plain | {"weight": "w"})


def test_a_schema_without_weight_dumps_as_before():
    """Digests and fingerprints of schemas (preprocess.json, materialised splits) stay what they were."""
    assert "weight" not in Schema.model_validate({"sparse": [{"name": "a"}]}).model_dump()
    assert Schema.model_validate(SCHEMA).model_dump()["weight"] == "w"


def test_a_split_carries_the_weights_and_one_without_reads_as_weight_one(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("label,w,x,user\n1,0.5,1,a\n0,0,2,b\n1,2,3,c\n")
    schema = Schema.model_validate(SCHEMA)
    materialize(read_batches(path, "csv", schema), schema, tmp_path / "weighted")
    ds = ArrayDataset(tmp_path / "weighted")
    assert ds.weights().tolist() == [0.5, 0.0, 2.0]
    batch = ds.gather(np.array([2, 0]))
    assert batch.weights.tolist() == [2.0, 0.5] and batch.to(torch.device("cpu")).weights.tolist() == [
        2.0,
        0.5,
    ]
    assert ds.subset(np.array([False, True, True])).weights().tolist() == [0.0, 2.0]
    plain = schema.model_copy(update={"weight": None})
    materialize(read_batches(path, "csv", plain), plain, tmp_path / "plain")
    meta = json.loads((tmp_path / "plain" / "meta.json").read_text())
    assert "weight" not in meta and not (tmp_path / "plain" / "weight.bin").exists()  # as splits were before
    unweighted = ArrayDataset(tmp_path / "plain")
    assert unweighted.weights() is None and unweighted.gather(np.arange(3)).weights is None
    (tmp_path / "weighted" / "weight.bin").write_bytes(b"\0" * 4)  # cut short
    with pytest.raises(DataError, match="weight.bin: 4 bytes where the split's meta.json needs 12"):
        ArrayDataset(tmp_path / "weighted")


# ---------------------------------------------------------------- training


def write_run(
    tmp_path: Path, name: str, rows: list[tuple[int, float, float, int]], weight: bool, more: str = ""
) -> Path:
    """A run config training LR (hashed ids: a row's id is the same whatever else the file holds) on
    ``rows`` (label, weight, x, user) in one batch of every row, so each step sees the whole file."""
    head = "label,w,x,user" if weight else "label,x,user"
    lines = [f"{y},{w},{x},{u}" if weight else f"{y},{x},{u}" for y, w, x, u in rows]
    (tmp_path / f"{name}.csv").write_text("\n".join([head, *lines]) + "\n")
    schema = {**SCHEMA, "sparse": [{"name": "user", "hash_buckets": 16}]}
    if not weight:
        del schema["weight"]
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"data: {{format: csv, train: {tmp_path / f'{name}.csv'}, num_workers: 0, schema: {json.dumps(schema)}{more}}}\n"
        "model: {name: fm}\n"
        f"train: {{batch_size: {len(rows)}, epochs: 6, log_every: 1, progress: false, early_stopping: null, "
        "dense_optimizer: {name: adam, lr: 0.05}}\n"
    )
    return config


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "train"]


def base_rows(n: int = 48) -> list[tuple[int, float, float, int]]:
    rng = np.random.default_rng(0)
    return [
        (int(rng.random() < 0.4), 1.0, round(float(rng.normal()), 3), int(rng.integers(0, 9)))
        for _ in range(n)
    ]


def test_weight_two_trains_as_the_row_twice(tmp_path):
    """Rows of weight 2 train as those rows written twice. The loss is sum(w * l) / rows: the weighted file
    also holds as many rows of weight 0 as the other file has copies, so both divide by the same count, and
    every step (one batch of the whole file) has the same loss, up to the order of the sums."""
    rows = base_rows()
    twice = rows[::4]
    weighted = [(y, 2.0 if i % 4 == 0 else 1.0, x, u) for i, (y, _, x, u) in enumerate(rows)]
    weighted += [(1 - y, 0.0, -x, (u + 3) % 9) for y, _, x, u in twice]  # weigh nothing: no gradient
    a = Trainer(load_config(write_run(tmp_path, "a", weighted, True)), tmp_path / "ra").fit()
    b = Trainer(load_config(write_run(tmp_path, "b", rows + twice, False)), tmp_path / "rb").fit()
    assert a["steps"] == b["steps"] == 6
    assert losses(tmp_path / "ra") == pytest.approx(losses(tmp_path / "rb"), rel=1e-5)


def test_weights_of_one_train_the_unweighted_run_exactly(tmp_path):
    rows = base_rows()
    a = Trainer(
        load_config(write_run(tmp_path, "a", rows, True, f", valid: {tmp_path / 'a.csv'}")), tmp_path / "ra"
    ).fit()
    b = Trainer(
        load_config(write_run(tmp_path, "b", rows, False, f", valid: {tmp_path / 'b.csv'}")), tmp_path / "rb"
    ).fit()
    assert losses(tmp_path / "ra") == losses(tmp_path / "rb")
    assert a["valid"] == b["valid"] | {"weight_sum": len(rows)}


def test_eval_scores_with_the_weights_where_the_file_has_them(tmp_path, capsys):
    rows = base_rows()
    weighted = [(y, float(i % 3), x, u) for i, (y, _, x, u) in enumerate(rows)]
    config = write_run(tmp_path, "a", weighted, True, f", valid: {tmp_path / 'a.csv'}")
    report = Trainer(load_config(config, ["train.calibrate=true"]), tmp_path / "r").fit()
    assert report["valid"]["weight_sum"] == sum(w for _, w, _, _ in weighted)
    assert report["calibration"]["weight_sum"] == report["valid"]["weight_sum"]  # what Platt's fit weighed
    # Platt scaling fitted on the weighted rows: their weighted mean prediction is their weighted CTR.
    assert report["valid"]["calibration"] == pytest.approx(1.0, abs=0.02)
    m = eval_run(tmp_path / "r", str(tmp_path / "a.csv"), predictions=tmp_path / "scored.csv")
    assert m == pytest.approx(report["valid"], rel=1e-6)
    # --predictions carries each row's weight: its weighted metrics recompute from the file alone
    scored = np.genfromtxt(tmp_path / "scored.csv", delimiter=",", names=True)
    assert scored["weight"].tolist() == [w for _, w, _, _ in weighted]
    logloss = -(
        scored["weight"] * np.log(np.where(scored["label"] > 0, scored["score"], 1 - scored["score"]))
    )
    assert logloss.sum() / scored["weight"].sum() == pytest.approx(m["logloss"], rel=1e-6)
    write_run(tmp_path, "plain", rows, False)  # the same rows, no weight column: scored unweighted
    plain = eval_run(tmp_path / "r", str(tmp_path / "plain.csv"))
    assert "weight_sum" not in plain and plain["rows"] == len(rows) and plain["logloss"] != m["logloss"]
    assert main(["export", str(tmp_path / "r"), "--out", str(tmp_path / "m")]) == 0
    served, labels = Scorer(tmp_path / "m").score_file(tmp_path / "plain.csv")  # scores need no weights
    assert len(served) == len(rows) and labels.tolist() == [y for y, _, _, _ in rows]
    assert (
        main(
            [
                "predict",
                str(tmp_path / "r"),
                "--data",
                str(tmp_path / "plain.csv"),
                "--out",
                str(tmp_path / "p.csv"),
            ]
        )
        == 0
    )
    (tmp_path / "bad.csv").write_text("label,w,x,user\n1,1,0.5,3\n0,-2,0.5,3\n")
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "r"), "--data", str(tmp_path / "bad.csv")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.csv line 3: weight '-2' is negative (pass --on-bad-row skip" in err[0], err


def test_a_balanced_ranks_loss_weighs_its_rows_too(tmp_path):
    """With ``global_size`` (ranks holding unequal parts, ``distributed.balance``) the loss is this rank's
    sum(w * l) over the global mean's share of rows: on one rank, the weighted mean loss of the batch."""
    rows = [(y, float(i % 3), x, u) for i, (y, _, x, u) in enumerate(base_rows())]
    config = load_config(write_run(tmp_path, "a", rows, True))
    mean, summed = (Trainer(config, tmp_path / f"r{i}") for i in range(2))
    batch = mean.train_ds.gather(np.arange(len(rows)))
    assert batch.weights is not None and batch.weights.tolist() == [w for _, w, _, _ in rows]
    a, b = mean.train_step(batch), summed.train_step(batch, global_size=len(rows))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    for t in (mean, summed):
        t.close()


# ---------------------------------------------------------------- weights of no size, or far from 1


def test_rows_of_no_weight_score_nan_and_say_why():
    """All rows of weight 0: every weighted mean is 0/0. NaN with a note naming the weights (a float division
    raised ZeroDivisionError, an internal error in eval and train)."""
    logits, labels, _, _ = random_rows(0, 50)
    m = ctr_metrics(logits, labels, torch.zeros(50))
    assert all(np.isnan(m[k]) for k in ("auc", "logloss", "ne", "calibration")) and m["weight_sum"] == 0
    assert "all 50 rows are of weight 0 (data.schema.weight)" in undefined_note(m)


@pytest.mark.parametrize("split", ["train", "valid"])
def test_a_split_whose_rows_all_weigh_0_is_refused(tmp_path, split):
    rows = base_rows()
    config = write_run(tmp_path, "a", [(y, 1.0, x, u) for y, _, x, u in rows], True)
    write_run(tmp_path, "zero", [(y, 0.0, x, u) for y, _, x, u in rows], True)
    cfg = load_config(config, [f"data.{split}={tmp_path / 'zero.csv'}"])
    with pytest.raises(DataError, match=f"data.{split}: all 48 rows weigh 0 in column 'w'"):
        Trainer(cfg, tmp_path / "r").fit()


@pytest.mark.parametrize("scale", [1e-9, 1e30])
def test_training_weights_far_from_one_warn(tmp_path, scale):
    """Weights of 1e30 square past float32 in Adam's state: the model stayed as initialised, without a word."""
    rows = [(y, scale, x, u) for y, _, x, u in base_rows()]
    with pytest.warns(UserWarning, match="divide the weights by their mean"):
        Trainer(load_config(write_run(tmp_path, "a", rows, True)), tmp_path / "r")


def test_eval_of_a_file_without_the_weight_column_says_it_is_unweighted(tmp_path):
    rows = base_rows()
    Trainer(load_config(write_run(tmp_path, "a", rows, True)), tmp_path / "r").fit()
    write_run(tmp_path, "plain", rows, False)
    with pytest.warns(UserWarning, match="has no column 'w'.*scored unweighted"):
        eval_run(tmp_path / "r", str(tmp_path / "plain.csv"))


def test_a_weight_column_listed_as_a_feature_says_so():
    """It was 'feature names must be unique; repeated: w', which names no weight."""
    with pytest.raises(
        ValueError, match="'w' is the row-weight column \\(schema.weight\\) and a feature too"
    ):
        Schema.model_validate({**SCHEMA, "dense": [{"name": "x"}, {"name": "w"}]})


@pytest.mark.dist
def test_two_ranks_train_weighted_rows_as_one_process(tmp_path):
    """Each rank weighs its share of the global batch, and the ranks' mean loss is the one-process weighted loss
    (sum(w * l) / rows over the whole batch), step by step; unweighted, the losses differ."""
    rng = np.random.default_rng(1)
    rows = [(y, float(rng.choice([0.5, 1.0, 2.0, 3.0])), x, u) for y, _, x, u in base_rows()]
    config = write_run(tmp_path, "w", rows, True)
    one = Trainer(load_config(config), tmp_path / "one").fit()
    assert main(["train", str(config), "--out", str(tmp_path / "two"), "--nproc", "2"]) == 0
    assert one["steps"] == 6 and losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    Trainer(load_config(write_run(tmp_path, "u", rows, False)), tmp_path / "unweighted").fit()
    assert losses(tmp_path / "unweighted")[0] != pytest.approx(losses(tmp_path / "one")[0], rel=1e-3)


def test_eval_of_parts_of_which_some_lack_the_weight_column_is_one_line(tmp_path):
    """Only the first part was asked for the weight column: parts after it without one failed as a missing
    column, and parts with one after a first without were scored unweighted without a word."""
    rows = base_rows()
    Trainer(load_config(write_run(tmp_path, "a", rows, True)), tmp_path / "r").fit()
    parts = tmp_path / "parts"
    parts.mkdir()
    write_run(tmp_path, "plain", rows, False)
    (parts / "day1.csv").write_text((tmp_path / "a.csv").read_text())
    (parts / "day2.csv").write_text((tmp_path / "plain.csv").read_text())
    (parts / "day3.csv").write_text("")  # an empty part: no header, no rows, no say
    with pytest.raises(
        DataError,
        match=rf"{parts}: column 'w' is in some of its files \(.*day1.csv\) and not in others \(.*day2.csv\)",
    ):
        eval_run(tmp_path / "r", str(parts))
    (parts / "day2.csv").write_text((tmp_path / "a.csv").read_text())
    m = eval_run(tmp_path / "r", str(parts))
    assert m["rows"] == 2 * len(rows) and m["weight_sum"] == 2 * sum(w for _, w, _, _ in rows)


def test_negative_sampling_reports_the_weight_it_kept(tmp_path):
    """report.json's negative_sampling gave the rows kept, not what they weigh, for weighted rows."""
    rows = [(y, float(i % 3 + 1), x, u) for i, (y, _, x, u) in enumerate(base_rows())]
    cfg = load_config(write_run(tmp_path, "a", rows, True, ", negative_sampling_rate: 0.5"))
    trainer = Trainer(cfg, tmp_path / "r")
    kept = trainer.train_ds.weights()
    report = trainer.fit()["negative_sampling"]
    assert report["train_rows"] == len(kept) < len(rows) and report["train_weight_sum"] == float(kept.sum())
