"""Warm start (``train.init_from``): a new run from the model another run kept, on new data."""

import json
import shutil
from pathlib import Path

import pytest

from recscale.cli import main
from recscale.config import load_config
from recscale.data.preprocess import Preprocessor
from recscale.errors import ConfigError, RecscaleError
from recscale.train.loop import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = ["data.synthetic.rows={train: 4000, valid: 1000, test: 500}", "data.synthetic.num_sparse=4",
         "data.synthetic.vocab_sizes=50", "data.num_workers=0", "model.embedding.dim=8", "model.num_layers=1",
         "train.batch_size=256", "train.progress=false", "train.eval_every=5", "train.max_steps=10"]  # fmt: skip
# Learning rates far below a float32 weight's last bit: a step changes no weight.
FROZEN = ["train.max_steps=1", "train.dense_optimizer={name: sgd, lr: 1.0e-30}",
          "train.sparse_optimizer={name: sgd, lr: 1.0e-30}"]  # fmt: skip


def train(tmp_path: Path, name: str, *overrides: str) -> dict:
    """The report of a small demo run into ``tmp_path / name``."""
    return Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL, *overrides]), tmp_path / name).fit()


def test_a_warm_start_begins_at_the_kept_model(tmp_path):
    """Started from a run and not moved (learning rates below the weights' last bit), a run scores as the
    model that run kept, to the last digit, on one process and under another sharding, without the Platt
    scaling that run fitted at its end; its preprocessing is that run's, and the report says where it started."""
    plain = train(tmp_path, "plain")
    train(tmp_path, "a", "train.calibrate=true")  # the same training, then calibrated
    for name, more in (("b", []), ("c", ["distributed.sharding=data_parallel"])):
        again = train(tmp_path, name, f"train.init_from={tmp_path / 'a'}", *FROZEN, *more)
        assert again["valid"] == plain["valid"] and again["test"] == plain["test"], name
        assert again["init_from"] == {
            "run": str(tmp_path / "a"), "checkpoint": str(tmp_path / "a" / "best"), "step": plain["best_step"],
            "oov_share": again["init_from"]["oov_share"],
        }  # fmt: skip
        digest = Preprocessor.load(tmp_path / "a" / "preprocess.json").digest()
        assert Preprocessor.load(tmp_path / name / "preprocess.json").digest() == digest
    moved = train(tmp_path, "d", f"train.init_from={tmp_path / 'a'}", "train.max_steps=1")
    assert moved["valid"] != plain["valid"]  # the comparison can tell a step that moves the weights
    # Trained on without the Platt scaling: the first step's loss is the uncalibrated model's
    train(tmp_path, "e", f"train.init_from={tmp_path / 'plain'}", "train.max_steps=1", "train.log_every=1")
    train(tmp_path, "f", f"train.init_from={tmp_path / 'a'}", "train.max_steps=1", "train.log_every=1")
    assert first_loss(tmp_path / "f") == first_loss(tmp_path / "e")


def first_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if r["split"] == "train")


def test_new_data_is_mapped_with_the_runs_vocabularies(tmp_path):
    """Ids the first run never saw are out of vocabulary in the warm start (its tables have no rows for them),
    their share in the report; a field none of whose ids it knows warns."""
    lines = ["label,user,item"] + [f"{i % 2},u{i % 10},i{i % 7}" for i in range(400)]
    (tmp_path / "day1.csv").write_text("\n".join(lines) + "\n")
    # day 2: half its users new, every item written another way
    lines = ["label,user,item"] + [f"{i % 2},u{i % 10 + 5 * (i % 2)},item{i % 7}" for i in range(400)]
    (tmp_path / "day2.csv").write_text("\n".join(lines) + "\n")
    schema = "data.schema={label: label, sparse: [{name: user}, {name: item}]}"
    common = [schema, "data.num_workers=0", "model.name=fm", "train.batch_size=100", "train.max_steps=4",
              "train.progress=false", "train.early_stopping=null"]  # fmt: skip
    cfg = load_config(
        CONFIGS / "frappe.yaml", [f"data.train={tmp_path / 'day1.csv'}", "data.valid=null", *common]
    )
    Trainer(cfg, tmp_path / "a").fit()
    cfg = load_config(
        CONFIGS / "frappe.yaml",
        [
            f"data.train={tmp_path / 'day2.csv'}",
            "data.valid=null",
            *common,
            f"train.init_from={tmp_path / 'a'}",
        ],
    )
    with pytest.warns(
        UserWarning, match=r"train.init_from .*: no id of item in the training split is in that run"
    ):
        report = Trainer(cfg, tmp_path / "b").fit()
    new_users = sum(i % 10 + 5 * (i % 2) >= 10 for i in range(400)) / 400
    assert report["init_from"]["oov_share"] == {"user": new_users, "item": 1.0}
    assert Preprocessor.load(tmp_path / "b" / "preprocess.json").digest() == (
        Preprocessor.load(tmp_path / "a" / "preprocess.json").digest()
    )


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("model.num_layers=2", r"trained with model\.num_layers 1 and this run sets 2; a run starts from another's"),
        ("model.embedding.dim=16", r"trained with model\.embedding\.dim 8 and this run sets 16"),
        ("data.synthetic.num_sparse=5", r"trained with data\.schema\.sparse \['s0', 's1', 's2', 's3', 'm0', 'm1'\] and this run sets \['s0', 's1', 's2', 's3', 's4', 'm0', 'm1'\]; a run starts"),
    ],
)  # fmt: skip
def test_a_run_of_another_model_or_features_is_refused(tmp_path, override, words):
    train(tmp_path, "a")
    with pytest.raises(ConfigError, match=rf"^train.init_from {tmp_path / 'a'} {words}"):
        train(tmp_path, "b", f"train.init_from={tmp_path / 'a'}", override)
    assert not (tmp_path / "b").exists()


def test_a_source_without_a_model_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "b"), *SMALL,
                 f"train.init_from={tmp_path / 'empty'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert (
        code != 0
        and err
        == f"error: train.init_from: {tmp_path / 'empty'}: not a recscale run directory (no config.yaml)\n"
    )
    train(tmp_path, "a")
    shutil.rmtree(tmp_path / "a" / "best")
    for ckpt in (tmp_path / "a" / "ckpt").iterdir():
        shutil.rmtree(ckpt)
    with pytest.raises(
        RecscaleError, match="holds no complete checkpoint to start from; train that run first"
    ):
        train(tmp_path, "b", f"train.init_from={tmp_path / 'a'}")


def test_a_resumed_warm_start_needs_its_source_no_more(tmp_path):
    """Resumed from its own checkpoint, a warm-started run reads nothing of the run it started from."""
    train(tmp_path, "a")
    train(tmp_path, "b", f"train.init_from={tmp_path / 'a'}", "train.max_steps=5")
    shutil.rmtree(tmp_path / "a")
    cfg = load_config(
        CONFIGS / "demo.yaml", [*SMALL, f"train.init_from={tmp_path / 'a'}", "train.max_steps=10"]
    )
    report = Trainer(cfg, tmp_path / "b", resume=True).fit()
    assert report["steps"] == 10 and report["init_from"] == {"run": str(tmp_path / "a")}
    assert json.loads((tmp_path / "b" / "report.json").read_text())["steps"] == 10


@pytest.mark.dist
def test_two_ranks_start_from_a_one_process_run(tmp_path):
    """DCP reshards the run's tables over the new run's ranks: not moved, the two ranks score as its model."""
    plain = train(tmp_path, "a")
    over = [*SMALL, f"train.init_from={tmp_path / 'a'}", *FROZEN]
    assert (
        main(["train", str(CONFIGS / "demo.yaml"), "--out", str(tmp_path / "b"), "--nproc", "2", *over]) == 0
    )
    assert json.loads((tmp_path / "b" / "report.json").read_text())["valid"] == plain["valid"]


def test_a_resume_before_a_checkpoint_refuses_a_source_trained_again(tmp_path):
    """Resumed before its first checkpoint, a warm start reads its source again: one trained again since, on
    other ids, has tables of another vocabulary than the one this run mapped its data with."""
    train(tmp_path, "a")
    train(tmp_path, "b", f"train.init_from={tmp_path / 'a'}", "train.max_steps=2")
    for left in ("ckpt", "best"):  # as a kill before the first checkpoint leaves it
        shutil.rmtree(tmp_path / "b" / left)
    shutil.rmtree(tmp_path / "a")
    train(tmp_path, "a", "data.synthetic.vocab_sizes=40")
    cfg = load_config(
        CONFIGS / "demo.yaml", [*SMALL, f"train.init_from={tmp_path / 'a'}", "train.max_steps=2"]
    )
    with pytest.raises(
        RecscaleError, match="its vocabularies are no longer the ones this run prepared its data with"
    ):
        Trainer(cfg, tmp_path / "b", resume=True)
