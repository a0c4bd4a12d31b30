"""``recscale precision probe`` on a tiny trained run: the plan file, and that it loads back as model.quant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recscale.cli import main
from recscale.config import load_config
from recscale.distributed.env import shutdown
from recscale.models.quant import QuantLinear, linear_names, quantize_model
from recscale.models.registry import build_model
from recscale.train.build import feature_set
from recscale.train.probe import calibration_sample, logits, lowered, probe
from recscale.train.runs import load_trained

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("probe") / "run"
    code = main(["train", str(DEMO), "--out", str(out), "data.synthetic.rows={train: 2000, valid: 500, test: 500}",
                 "train.max_steps=30", "train.progress=false"])  # fmt: skip
    assert code == 0
    return out


def _strict_json(path: Path) -> dict:
    def refuse(c: str) -> None:
        raise AssertionError(f"{path} holds {c}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_probe_writes_a_plan_that_loads_back(run, tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["precision", "probe", str(run), "--formats", "mxfp8_e4m3", "mxfp4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "all layers" in printed and "model.quant.layers=" in printed
    plan = _strict_json(out)
    assert {"model.quant", "per_layer", "baseline", "with_plan", "all_layers"} <= set(plan)
    assert plan["target"] == "mxfp8_e4m3" and plan["tolerance"] == 5e-4 and plan["rows"] == 500
    assert plan["precision"] == "fp32" and "(fp32 elsewhere" in printed and "\nfp32: AUC" in printed

    cfg, pre, _ = load_trained(run)
    model = build_model(cfg.model.name, feature_set(pre), cfg.model.embedding, cfg.model.params)
    names = linear_names(model)
    rows = plan["per_layer"]
    assert [(r["layer"], r["format"]) for r in rows] == [
        (n, f) for n in names for f in ("mxfp8_e4m3", "mxfp4")
    ]
    for r in rows:
        assert r["rel_err"] > 0 and r["sqnr_db"] > 0 and 0 < r["auc"] < 1
        assert r["d_auc"] == pytest.approx(r["auc"] - plan["baseline"]["auc"])
        assert r["sqnr_db"] == pytest.approx(-20 * torch.tensor(r["rel_err"]).log10().item())
    err = {(r["layer"], r["format"]): r["rel_err"] for r in rows}
    assert all(err[n, "mxfp4"] > err[n, "mxfp8_e4m3"] for n in names)

    layers = plan["model.quant"]["layers"]
    assert set(layers) <= set(names) and set(layers.values()) <= {"mxfp8_e4m3"}
    assert -plan["with_plan"]["d_auc"] <= 5e-4
    # what the CLI tells the user to pass back, through the config, into a model of the run
    override = printed.split("train with it: ")[1].strip().removesuffix(")").strip("'")
    quant = load_config(DEMO, [override]).model.quant
    assert quant is not None and quant.layers == layers
    assert quantize_model(model, quant) == [n for n in names if n in layers]

    # every layer lowered to mxfp4 moves the logits more than to mxfp8_e4m3
    change = {f: plan["all_layers"][f]["logit_rel_change"] for f in ("mxfp8_e4m3", "mxfp4")}
    assert 0 < change["mxfp8_e4m3"] < change["mxfp4"]


def test_probe_api_lowers_and_restores(run) -> None:
    cfg, pre, built = load_trained(run)
    batches = calibration_sample(run, cfg, pre, None, 300)
    assert sum(b.size for b in batches) == 300
    z0 = logits(built.module, batches)
    names = linear_names(built.model)
    change = {}
    for fmt in ("mxfp8_e4m3", "mxfp4"):
        with lowered(built.model, dict.fromkeys(names, fmt)) as q:
            assert all(isinstance(m, QuantLinear) and m.fmt == fmt for m in q.values())
            change[fmt] = (logits(built.module, batches) - z0).norm().item()
        assert not any(isinstance(built.model.get_submodule(n), QuantLinear) for n in names)
    assert 0 < change["mxfp8_e4m3"] < change["mxfp4"]
    assert torch.equal(logits(built.module, batches), z0)  # restored exactly
    # a tolerance nothing breaks takes every layer
    shutdown()  # the group load_trained above started
    plan = probe(run, rows=300, formats=["mxfp8_e4m3"], tolerance=1.0)
    assert list(plan["model.quant"]["layers"]) == names
    assert not dist.is_initialized()  # the group the probe's model load started ends with it


def test_a_bf16_run_is_probed_in_bf16(tmp_path, capsys) -> None:
    """A train.precision=bf16 run trains and evaluates under bf16 autocast: the probe's baseline and every
    lowered model are scored so too (it measured them in fp32), and its output says so. In bf16 a layer
    lowered to the bf16 format computes exactly what it computes plain: its output error is zero."""
    from recscale.train.metrics import ctr_metrics

    run = tmp_path / "run"
    code = main(["train", str(DEMO), "--out", str(run), "data.synthetic.rows={train: 2000, valid: 500, test: 500}",
                 "train.max_steps=10", "train.progress=false", "train.precision=bf16"])  # fmt: skip
    assert code == 0
    capsys.readouterr()
    out = tmp_path / "plan.json"
    assert main(["precision", "probe", str(run), "--formats", "bf16", "mxfp8_e4m3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = _strict_json(out)
    assert plan["precision"] == "bf16" and "(bf16 elsewhere" in printed and "\nbf16: AUC" in printed

    cfg, pre, built = load_trained(run)
    batches = calibration_sample(run, cfg, pre, None, 16384)
    labels = torch.cat([b.labels for b in batches])
    bf16, fp32 = (ctr_metrics(logits(built.module, batches, p), labels) for p in ("bf16", "fp32"))
    assert plan["baseline"] == {"auc": bf16["auc"], "logloss": bf16["logloss"]}
    assert plan["baseline"]["logloss"] != fp32["logloss"]  # the two precisions do score apart
    for r in plan["per_layer"]:
        if r["format"] == "bf16":  # the same computation as the plain bf16 layer
            assert r["rel_err"] == 0 and r["sqnr_db"] is None and r["d_auc"] == r["d_logloss"] == 0, r
        else:
            assert r["rel_err"] > 0, r


def test_probe_user_errors(run, tmp_path, capsys) -> None:
    for argv, words in [
        (["precision", "probe", str(run), "--formats", "mxfp5"], "unknown format mxfp5"),
        (
            ["precision", "probe", str(run), "--tolerance", "-1"],
            "argument --tolerance: must be a finite number >= 0, got -1",
        ),
        (["precision", "probe", str(run), "--data", str(tmp_path / "x.csv")], "no such file"),
        (["precision", "probe", str(tmp_path)], "not a recscale run directory"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err


def test_calibration_leaves_the_held_out_report_rows_alone(run) -> None:
    """With data.report_fraction the probe calibrates on valid's selection rows only: its plan is a
    selection decision, and the held-out rows must stay unseen."""
    from recscale.data.dataset import held_out

    cfg, pre, _ = load_trained(run)
    every = calibration_sample(run, cfg, pre, None, 10**6)
    held = cfg.model_copy(update={"data": cfg.data.model_copy(update={"report_fraction": 0.5})})
    selection = calibration_sample(run, held, pre, None, 10**6)
    keep = ~held_out(500, 0.5)
    assert sum(b.size for b in every) == 500 and sum(b.size for b in selection) == int(keep.sum())
    labels = torch.cat([b.labels for b in every])
    assert torch.equal(torch.cat([b.labels for b in selection]), labels[torch.from_numpy(keep)])


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory) -> tuple[Path, Path]:
    """A run trained on a small Frappe-like CSV file, and the file."""
    tmp = tmp_path_factory.mktemp("csv")
    csv = tmp / "data.csv"
    header = "label,user,item,daytime,weekday,isweekend,homework,cost,weather,country,city"
    rows = [f"{i % 2},{i % 7},{i % 11},1,2,3,4,5,6,7,8" for i in range(64)]
    csv.write_text("\n".join([header, *rows]) + "\n")
    config = Path(__file__).resolve().parents[1] / "configs" / "frappe.yaml"
    assert main(["train", str(config), "--out", str(tmp / "run"), f"data.train={csv}", f"data.valid={csv}",
                 "model.name=lr", "train.max_steps=2", "train.progress=false"]) == 0  # fmt: skip
    return tmp / "run", csv


def test_probe_out_is_checked_before_the_probe(csv_run, tmp_path, capsys) -> None:
    """--out naming the --data file replaced the calibration data with the plan; a directory failed only
    after the whole probe had run. Both are refused first, as eval refuses its --predictions."""
    run, csv = csv_run
    capsys.readouterr()
    before = csv.read_bytes()
    config = (run / "config.yaml").read_bytes()
    for out, words in [(csv, "is the --data file;"), (tmp_path, "is a directory"),
                       (run / "config.yaml", "is the run's own config.yaml")]:  # fmt: skip
        argv = ["precision", "probe", str(run), "--data", str(csv), "--formats", "mxfp4", "--out", str(out)]
        assert main(argv) == 2
        printed, err = capsys.readouterr()
        assert printed == "" and words in err and len(err.strip().splitlines()) == 1, err
    assert csv.read_bytes() == before and (run / "config.yaml").read_bytes() == config


def test_one_class_calibration_data_says_what_would_help(csv_run, tmp_path, capsys) -> None:
    """Every row of a --data file of one class is already in the sample: the line said to give more --rows."""
    run, csv = csv_run
    ones = tmp_path / "ones.csv"
    lines = csv.read_text().splitlines()
    ones.write_text("\n".join([lines[0], *(r for r in lines[1:] if r.startswith("1,"))]) + "\n")
    capsys.readouterr()
    assert main(["precision", "probe", str(run), "--data", str(ones), "--formats", "mxfp4"]) == 2
    err = capsys.readouterr().err
    assert "the 32 calibration rows hold one class only; calibrate on a --data file holding both" in err, err
    assert (
        main(["precision", "probe", str(run), "--data", str(ones), "--rows", "8", "--formats", "mxfp4"]) == 2
    )
    assert "the 8 calibration rows hold one class only; give more --rows" in capsys.readouterr().err


def test_probe_calibrates_on_a_directory_where_the_format_reads_one(tmp_path, capsys, shared_data) -> None:
    """MovieLens is a directory (ml-100k's files), which eval scores; the probe refused it as no such file."""
    ml = shared_data / "movielens-100k"
    config = Path(__file__).resolve().parents[1] / "configs" / "movielens.yaml"
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), f"data.train={ml}", "model.name=lr",
                 "train.max_steps=2", "train.progress=false"]) == 0  # fmt: skip
    capsys.readouterr()
    out = tmp_path / "plan.json"
    argv = [
        "precision",
        "probe",
        str(run),
        "--data",
        str(ml),
        "--rows",
        "2000",
        "--formats",
        "mxfp4",
        "--out",
        str(out),
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert _strict_json(out)["rows"] == 2000


def test_probe_calibrates_on_the_valid_split_of_data_prepared(csv_run, tmp_path, capsys) -> None:
    """A run trained on data.prepared has no data/ of its own: its splits are in the prepared directory,
    where the probe and dmt partition did not look (they said the run had none)."""
    _, csv = csv_run
    config = Path(__file__).resolve().parents[1] / "configs" / "frappe.yaml"
    data = [f"data.train={csv}", f"data.valid={csv}"]
    assert main(["data", "prepare", str(config), *data, "--out", str(tmp_path / "prep")]) == 0
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), *data, f"data.prepared={tmp_path / 'prep'}",
                 "model.name=lr", "train.max_steps=2", "train.progress=false"]) == 0  # fmt: skip
    out = tmp_path / "plan.json"
    capsys.readouterr()
    argv = ["precision", "probe", str(run), "--formats", "mxfp4", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert _strict_json(out)["rows"] == 64
    # dmt partition reads its training sample there too (it said the run's training split was gone)
    partition = ["dmt", "partition", str(run), "--towers", "2", "--out", str(tmp_path / "towers.yaml")]
    assert main(partition) == 0, capsys.readouterr().err
    # prepared again from other data: its ids are not the run's
    other = tmp_path / "other.csv"
    other.write_text(csv.read_text().replace(",1,2,3,4,5,6,7,8\n", ",9,2,3,4,5,6,7,8\n"))
    assert main(["data", "prepare", str(config), f"data.train={other}", f"data.valid={other}", "--out",
                 str(tmp_path / "prep")]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    assert "not the preparation this run was trained on" in capsys.readouterr().err
    assert main(partition) == 2
    assert "not the preparation this run was trained on" in capsys.readouterr().err


def test_a_synthetic_run_without_valid_rows_is_not_sent_to_data(tmp_path, capsys) -> None:
    """A synthetic run trained without valid or test rows has nothing to calibrate on, and --data, which the
    line told it to give, is refused for synthetic runs: the line names what does help."""
    run = tmp_path / "run"
    assert main(["train", str(DEMO), "--out", str(run), "data.synthetic.rows={train: 500}", "train.max_steps=2",
                 "train.progress=false"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["precision", "probe", str(run), "--formats", "mxfp4"]) == 2
    err = capsys.readouterr().err
    assert "train a run with valid rows in data.synthetic.rows" in err and "--data" not in err, err
