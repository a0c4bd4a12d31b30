"""recscale export / serve: the exported model scores as the trained one, tampering is caught, and the
HTTP service answers in row order, refuses bad requests with one line and keeps serving."""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import ctrl_c_as_in_a_terminal
from fastapi.testclient import TestClient

from recscale.cli import main
from recscale.errors import RUN_DIR, CheckpointError, DataError
from recscale.serve.artifact import MANIFEST, WEIGHTS
from recscale.serve.scorer import Scorer
from recscale.serve.server import ServeOptions, create_app, scoring

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HEADER = "label,user,item,daytime,weekday,isweekend,homework,cost,weather,country,city,x,tags"
# A dense feature (log1p) and a multi-id one beside Frappe's ten fields: every kind of input is mapped.
SCHEMA = ("data.schema={label: label, dense: [{name: x, transform: log1p}], sparse: [{name: user}, {name: item}, "
          "{name: daytime}, {name: weekday}, {name: isweekend}, {name: homework}, {name: cost}, {name: weather}, "
          "{name: country}, {name: city}, {name: tags, multi: true}]}")  # fmt: skip


def _csv(path: Path, rows: int, seed: int, ids: int, x_from: float = 0.0) -> Path:
    rng = random.Random(seed)
    lines = [HEADER]
    for _ in range(rows):
        sparse = [str(rng.randrange(ids)) for _ in range(10)]
        x = "" if rng.random() < 0.1 else f"{x_from + rng.random() * 50:.3f}"
        tags = "|".join(str(rng.randrange(ids)) for _ in range(rng.randrange(4)))
        lines.append(",".join([str(rng.randrange(2)), *sparse, x, tags]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(path: Path) -> list[dict]:
    """The file's rows as a client sends them: ids as integers, missing values null."""
    out = []
    for line in path.read_text().splitlines()[1:]:
        cells = line.split(",")
        row: dict = {n: int(c) for n, c in zip(HEADER.split(",")[1:11], cells[1:11], strict=True)}
        row["x"] = float(cells[11]) if cells[11] else None
        row["tags"] = [int(t) for t in cells[12].split("|")] if cells[12] else []
        out.append(row)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("serve")
    train, valid = _csv(d / "train.csv", 400, 0, 30), _csv(d / "valid.csv", 120, 1, 40)  # valid: unseen ids
    argv = ["train", str(CONFIGS / "frappe.yaml"), "--out", str(d / "run"), f"data.train={train}",
            f"data.valid={valid}", SCHEMA, "train.max_steps=6", "train.batch_size=64", "train.progress=false",
            "model.num_layers=1", "model.dropout=0.5", "train.calibrate=true"]  # fmt: skip
    assert main(argv) == 0
    # Calibrated (not the identity), so the export tests also check the artifact carries the calibration.
    assert json.loads((d / "run" / "report.json").read_text())["calibration"]["scale"] != 1.0
    return {"run": d / "run", "valid": valid, "root": d}


def _export(trained: dict[str, Path], tables: str = "fp32", dense: str = "fp32") -> Path:
    out = trained["root"] / f"model-{tables}-{dense}"
    if not out.exists():
        assert (
            main(["export", str(trained["run"]), "--out", str(out), "--tables", tables, "--dense", dense])
            == 0
        )
    return out


def _trained_logits(trained: dict[str, Path]) -> np.ndarray:
    from recscale.train.data import prepare_split
    from recscale.train.evaluate import predict
    from recscale.train.runs import load_trained

    cfg, pre, built = load_trained(trained["run"])
    ds, _ = prepare_split(
        cfg.data, pre, "valid", str(trained["valid"]), trained["root"] / "split", progress=False
    )
    return predict(built.module, ds, 64, 0).numpy()


def test_exported_fp32_scores_equal_the_trained_model(trained):
    scorer = Scorer(_export(trained))
    expected = torch.sigmoid(torch.from_numpy(_trained_logits(trained))).numpy()
    logits, labels = scorer.score_file(trained["valid"])
    np.testing.assert_allclose(torch.sigmoid(torch.from_numpy(logits)).numpy(), expected, atol=1e-5, rtol=0)
    # the JSON path (raw values, integer ids, nulls, unseen ids) maps rows exactly as training did
    body = json.dumps({"rows": _rows(trained["valid"])}).encode()
    np.testing.assert_allclose(scorer.probabilities(scorer.parser.parse(body)), expected, atol=1e-5, rtol=0)
    assert len(labels) == 120 and expected.std() > 0  # the model is not constant: the check can fail


def test_export_lets_the_training_model_go_before_it_writes_the_file(trained, tmp_path, monkeypatch):
    """export held the training model (its tables and their optimizer state) and the tables assembled from it
    while it built and wrote the file, each as large as the tables: 5.8 GB of peak memory for a run with 1 GB of
    tables (15M ids), 4.8 GB now. Neither is alive once the weights are serialised."""
    import gc
    import weakref

    import recscale.serve.artifact as artifact
    import recscale.serve.export as export
    import recscale.train.runs as runs

    refs: dict[str, weakref.ref] = {}
    alive: list[str] = []
    load, save, full = runs.load_trained, artifact.save_safetensors, export._full

    def assembling(name, t):
        out = full(name, t)
        refs.setdefault("assembled", weakref.ref(out))
        return out

    def loading(*args, **kwargs):
        cfg, pre, built = load(*args, **kwargs)
        refs["model"] = weakref.ref(built.model)
        table = next(v for k, v in built.model.state_dict().items() if "embedding" in k)
        refs["table"] = weakref.ref(table)
        return cfg, pre, built

    def saving(tensors):
        gc.collect()
        alive.extend(name for name, ref in refs.items() if ref() is not None)
        return save(tensors)

    monkeypatch.setattr(runs, "load_trained", loading)
    monkeypatch.setattr(artifact, "save_safetensors", saving)
    monkeypatch.setattr(export, "_full", assembling)
    export.export_run(trained["run"], tmp_path / "model")
    assert set(refs) == {"model", "table", "assembled"} and alive == []
    assert Scorer(tmp_path / "model").manifest.model == "wukong"  # a model that loads


def test_a_scaled_run_scores_new_files_and_exports_as_it_evaluated(tmp_path, capsys):
    """x ~ 1e3 with scale: standard: eval and predict of a new file, and the exported Scorer (file and JSON
    rows), map it with the training statistics exactly as the run's own evaluation of the same rows did."""
    from recscale.data.dataset import ArrayDataset
    from recscale.train.evaluate import predict
    from recscale.train.runs import load_trained

    train, valid = (
        _csv(tmp_path / "train.csv", 300, 0, 30, 1e3),
        _csv(tmp_path / "valid.csv", 100, 1, 40, 1e3),
    )
    run, new = tmp_path / "run", tmp_path / "new.csv"
    argv = ["train", str(CONFIGS / "frappe.yaml"), "--out", str(run), f"data.train={train}", f"data.valid={valid}",
            f"data.test={valid}", SCHEMA.replace("transform: log1p", "scale: standard"), "train.max_steps=4",
            "train.batch_size=64", "train.progress=false", "model.num_layers=1", "model.dropout=0"]  # fmt: skip
    assert main(argv) == 0
    shutil.copy(valid, new)
    cfg, pre, built = load_trained(run)
    mean, std = pre.scales["x"]
    assert 500 < mean < 1050 and std > 100  # the training statistics (its missing x filled with 0)
    logits = predict(built.module, ArrayDataset(run / "data" / "test"), 64, 0).numpy()
    expected = torch.sigmoid(torch.from_numpy(logits)).numpy()
    assert expected.std() > 0  # the model is not constant: the checks can fail
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(new)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(printed) == json.loads((run / "report.json").read_text())["test"]
    assert main(["predict", str(run), "--data", str(new), "--out", str(tmp_path / "p.csv")]) == 0
    scores = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1, usecols=0)
    np.testing.assert_allclose(scores, expected, atol=1e-7, rtol=0)
    assert main(["export", str(run), "--out", str(tmp_path / "model")]) == 0
    scorer = Scorer(tmp_path / "model")
    assert scorer.pre.scales == pre.scales
    got, _ = scorer.score_file(new)
    np.testing.assert_allclose(got, logits, atol=1e-5, rtol=0)
    body = json.dumps({"rows": _rows(new)}).encode()
    np.testing.assert_allclose(scorer.probabilities(scorer.parser.parse(body)), expected, atol=1e-5, rtol=0)


def test_a_bf16_run_exported_in_fp32_scores_as_its_eval(trained, tmp_path):
    """A train.precision=bf16 run evaluates under bf16 autocast; its fp32 export scored in fp32, up to
    ~2e-2 off in the logits from `recscale eval` of the same rows (docs: the fp32 export scores exactly as
    the trained model)."""
    from recscale.train.data import prepare_split
    from recscale.train.evaluate import predict
    from recscale.train.runs import load_trained

    run, valid = tmp_path / "run", trained["valid"]
    argv = ["train", str(CONFIGS / "frappe.yaml"), "--out", str(run), f"data.train={trained['root'] / 'train.csv'}",
            f"data.valid={valid}", SCHEMA, "train.max_steps=6", "train.batch_size=64", "train.progress=false",
            "model.num_layers=1", "train.precision=bf16", "train.dense_optimizer.lr=0.05"]  # fmt: skip
    assert main(argv) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "m")]) == 0
    cfg, pre, built = load_trained(run)
    ds, _ = prepare_split(cfg.data, pre, "valid", str(valid), tmp_path / "split", progress=False)
    evaluated = predict(built.module, ds, 64, 0, "bf16").numpy()
    assert np.abs(evaluated - predict(built.module, ds, 64, 0, "fp32").numpy()).max() > 1e-4  # bf16 differs
    logits, _ = Scorer(tmp_path / "m").score_file(valid)
    np.testing.assert_allclose(logits, evaluated, atol=1e-6, rtol=0)
    # Its bf16 export too: the matrices round as autocast rounds them; vectors (biases, norms) stay fp32,
    # as they are under autocast (rounded to bf16 too, the logits were ~1.6e-2 off).
    assert main(["export", str(run), "--out", str(tmp_path / "b"), "--dense", "bf16"]) == 0
    logits, _ = Scorer(tmp_path / "b").score_file(valid)
    np.testing.assert_allclose(logits, evaluated, atol=1e-6, rtol=0)


def test_a_bf16_export_of_a_quantized_run_scores_as_its_eval(trained, tmp_path):
    """A model.quant layer computes with fq(W); --dense bf16 stored bf16(W), whose fq moved (MX block
    maxima and grid points shift), so the export scored off its run's eval. It stores fq(W), exact in bf16
    for MX formats, and keeps a per-tensor FP8 layer's weight fp32 (bf16 cannot hold its grid)."""
    from safetensors.torch import load_file

    from recscale.train.data import prepare_split
    from recscale.train.evaluate import predict
    from recscale.train.runs import load_trained

    run, valid = tmp_path / "run", trained["valid"]
    argv = ["train", str(CONFIGS / "frappe.yaml"), "--out", str(run), f"data.train={trained['root'] / 'train.csv'}",
            f"data.valid={valid}", SCHEMA, "train.max_steps=6", "train.batch_size=64", "train.progress=false",
            "model.num_layers=1", "train.precision=bf16", "train.dense_optimizer.lr=0.05",
            'model.quant={format: mxfp4, layers: {"head.0": fp8_e4m3}}']  # fmt: skip
    assert main(argv) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "b"), "--dense", "bf16"]) == 0
    cfg, pre, built = load_trained(run)
    ds, _ = prepare_split(cfg.data, pre, "valid", str(valid), tmp_path / "split", progress=False)
    logits, _ = Scorer(tmp_path / "b").score_file(valid)
    # One batch of 8192, as score_file reads: a per-tensor FP8 scale is its batch's.
    evaluated = predict(built.module, ds, 8192, 0, "bf16").numpy()
    np.testing.assert_allclose(logits, evaluated, atol=1e-6, rtol=0)
    w = load_file(tmp_path / "b" / WEIGHTS)
    assert w["head.2.weight"].dtype == torch.bfloat16 and w["head.0.weight"].dtype == torch.float32


@pytest.mark.parametrize("tables, dense, tol", [("fp16", "fp32", 1e-3), ("int8", "fp32", 2e-2),
                                                ("int4", "fp32", 5e-2), ("fp32", "bf16", 5e-2),
                                                ("int8", "int8", 2e-2)])  # fmt: skip
def test_quantized_variants_score_close_and_store_small_tables(trained, tables, dense, tol):
    base = Scorer(_export(trained))
    model = _export(trained, tables, dense)
    scorer = Scorer(model)
    a = torch.sigmoid(torch.from_numpy(base.score_file(trained["valid"])[0]))
    b = torch.sigmoid(torch.from_numpy(scorer.score_file(trained["valid"])[0]))
    assert (a - b).abs().max() < tol
    from safetensors.torch import load_file

    w = load_file(model / WEIGHTS)
    table = w["embedding.ebc.embedding_bags.t_user.weight"]
    d = 16  # configs/frappe.yaml's embedding dim
    row_bytes = {"fp32": 4 * d, "fp16": 2 * d, "int8": d + 4, "int4": d // 2 + 4}[
        tables
    ]  # + fp16 scale, bias
    assert table.dtype == (torch.float32 if tables == "fp32" else torch.uint8)
    assert table.shape[1] * table.element_size() == row_bytes  # fbgemm's row padding is not saved
    live = scorer.model.state_dict()["embedding.ebc.embedding_bags.t_user.weight"]  # fbgemm's own storage
    live = getattr(live, "elem", live)
    assert torch.equal(live.view(torch.uint8)[:, :row_bytes], table.view(torch.uint8))
    if dense == "bf16":
        dense_w = {k: t for k, t in w.items() if not k.startswith("embedding.ebc.")}
        assert all(t.dtype == (torch.bfloat16 if t.ndim >= 2 else torch.float32) for t in dense_w.values())
    if dense == "int8":
        matrices = [k for k, t in w.items() if not k.startswith("embedding.ebc.") and t.ndim >= 2]
        assert matrices and all(w[k].dtype == torch.int8 and w[k + ".int8_scale"].dtype == torch.float32
                                for k in matrices)  # fmt: skip
        assert (a - b).abs().max() > 0  # the weights were really rounded


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda m: (m / WEIGHTS).write_bytes(_flip((m / WEIGHTS).read_bytes(), 1000)), ["weights.safetensors", "sha256"]),
    # one byte appended: the size differs from the manifest's (it was called larger than any artifact)
    (lambda m: (m / WEIGHTS).write_bytes((m / WEIGHTS).read_bytes() + b"x"), ["weights.safetensors", "bytes where"]),
    (lambda m: (m / "config.yaml").write_text((m / "config.yaml").read_text().replace("dim: 16", "dim: 32")),
     ["config.yaml", "sha256"]),
    (lambda m: (m / "preprocess.json").unlink(), ["preprocess.json", "missing"]),
    (lambda m: (m / MANIFEST).write_text("{"), ["manifest.json", "not a recscale model manifest"]),
    (lambda m: (m / MANIFEST).unlink(), ["not an exported model"]),
])  # fmt: skip
def test_a_tampered_artifact_fails_to_load_with_one_line(trained, tmp_path, capsys, edit, words):
    model = _copy(_export(trained), tmp_path / "m")
    edit(model)
    with pytest.raises(CheckpointError) as e:
        Scorer(model)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert main(["serve", str(model), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words[0] in err


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def test_serve_on_a_taken_port_is_one_line(trained, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        code = main(["serve", str(_export(trained)), "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot listen on 127.0.0.1" in err, err


def test_export_refuses_to_overwrite_a_directory_that_is_not_a_model(trained, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["export", str(trained["run"]), "--out", str(tmp_path)]) == 2
    assert "not an exported model" in capsys.readouterr().err and (tmp_path / "keep.txt").is_file()
    # A retrieval model has a manifest.json too: export replaced it without a word.
    retrieval = tmp_path / "retrieval"
    retrieval.mkdir()
    (retrieval / MANIFEST).write_text('{"format": "recscale-retrieval", "version": 1}')
    assert main(["export", str(trained["run"]), "--out", str(retrieval)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {retrieval}: exists and is not an exported model; name a new directory (it is created)\n"
    )
    assert (retrieval / MANIFEST).read_text() == '{"format": "recscale-retrieval", "version": 1}'
    # An exported model is replaced.
    model = _copy(_export(trained), tmp_path / "model")
    assert main(["export", str(trained["run"]), "--out", str(model), "--tables", "fp16"]) == 0
    assert json.loads((model / MANIFEST).read_text())["tables"] == "fp16"


def test_run_commands_given_an_exported_model_say_so_and_leave_it_whole(trained, tmp_path, capsys):
    """An export holds a config.yaml, so `eval MODEL_DIR` said "no complete checkpoint to evaluate; train
    the run first", and `train --out MODEL_DIR` (or `data prepare --out`) wrote into it, overwriting the
    config.yaml and preprocess.json its manifest hashes: the export no longer loaded."""
    model = _copy(_export(trained), tmp_path / "model")
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    assert main(["eval", str(model), "--data", str(trained["valid"])]) == 2
    assert capsys.readouterr().err == (
        f"error: {model}: is an exported model; not a run directory: give a run's (what `recscale train "
        "--out` wrote)\n"
    )
    assert main(["train", str(CONFIGS / "frappe.yaml"), "--out", str(model), "train.progress=false"]) == 2
    assert capsys.readouterr().err == (
        f"error: {model}: is an exported model; choose another {RUN_DIR} for the run\n"
    )
    assert main(["data", "prepare", str(CONFIGS / "frappe.yaml"), "--out", str(model)]) == 2
    assert capsys.readouterr().err == (
        f"error: {model}: is an exported model; choose another --out for the prepared data\n"
    )
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    Scorer(model)  # still loads


@pytest.fixture(scope="module")
def scorer(trained) -> Scorer:
    return Scorer(_export(trained), max_rows=256)


@pytest.fixture(scope="module")
def client(scorer):
    with TestClient(create_app(scorer, ServeOptions(max_body_bytes=64 << 10))) as c:
        yield c


def test_score_answers_in_row_order_and_health_endpoints(client, scorer, trained):
    rows = _rows(trained["valid"])[:50]
    expected = scorer.probabilities(scorer.parser.parse(json.dumps({"rows": rows}).encode()))
    r = client.post("/score", json={"rows": rows})
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["scores"], expected, atol=1e-6)
    r = client.post("/score", json={"rows": rows[::-1]})
    np.testing.assert_allclose(r.json()["scores"], expected[::-1], atol=1e-6)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["ready"] is True
    # FastAPI's own answers have the server's error shape too (they were {"detail": ...})
    assert client.get("/nope").json() == {"error": "Not Found"} and client.get("/nope").status_code == 404
    assert (
        client.get("/score").json() == {"error": "Method Not Allowed"}
        and client.get("/score").status_code == 405
    )


GOOD = {"user": 1, "item": "2", "daytime": 3, "weekday": 4, "isweekend": 5, "homework": 6, "cost": 7,
        "weather": 8, "country": 9, "city": 10, "x": 1.5, "tags": [1, "2"]}  # fmt: skip
BAD = [
    (b"{", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b"[]", 422, "JSON object"),
    (b'{"rows": []}', 422, "rows"),
    (b'{"rows": 3}', 422, "rows"),
    (b'{"rows": [1]}', 422, "rows[0]"),
    (json.dumps({"rows": [GOOD], "x": 1}).encode(), 422, "unknown key"),
    (json.dumps({"rows": [{k: v for k, v in GOOD.items() if k != "city"}]}).encode(), 422, "missing feature 'city'"),
    (json.dumps({"rows": [GOOD | {"citty": 1}]}).encode(), 422, "unknown feature 'citty'"),
    (json.dumps({"rows": [GOOD | {"user": True}]}).encode(), 422, "rows[0].user"),
    (json.dumps({"rows": [GOOD | {"user": 1.5}]}).encode(), 422, "rows[0].user"),
    (json.dumps({"rows": [GOOD, GOOD | {"x": "1"}]}).encode(), 422, "rows[1].x"),
    (json.dumps({"rows": [GOOD | {"tags": "1|2"}]}).encode(), 422, "rows[0].tags"),
    (json.dumps({"rows": [GOOD | {"x": 1e39}]}).encode(), 422, "rows[0].x"),
    (b'{"rows": [{"user": NaN}]}', 422, "rows[0]"),
    (b'{"rows": [{"user": "\\ud800"}]}', 400, "JSON"),
    (json.dumps({"rows": [GOOD] * 257}).encode(), 413, "at most 256 rows"),
    (b" " * (65 << 10), 413, "larger than"),
]  # fmt: skip


@pytest.mark.parametrize("body, status, words", BAD)
def test_bad_requests_get_a_4xx_with_one_line(client, body, status, words):
    r = client.post("/score", content=body)
    assert r.status_code == status, r.text
    reason = r.json()["error"]
    assert words in reason and "\n" not in reason, reason


def test_dense_values_up_to_float32_max_are_scored_as_training_reads_them(client, scorer):
    """The server refused |x| above 3.4e38 as "not a finite number", where float32 (and training's
    readers) go to 3.4028235e38: 3.40282e38 was accepted in a training file and refused here."""
    top = float(np.finfo(np.float32).max)
    for x in (3.40282e38, top, -top):
        r = client.post("/score", json={"rows": [GOOD | {"x": x}]})
        assert r.status_code == 200 and np.isfinite(r.json()["scores"]).all(), r.text
    r = client.post("/score", json={"rows": [GOOD | {"x": 3.5e38}]})
    assert r.status_code == 422 and "float32" in r.json()["error"]


def test_bad_request_counts_wrong_fields_not_union_branches() -> None:
    """A value that is neither a string nor an integer fails both members of the union: one wrong field was
    reported as "(and 1 more errors)", three as "(and 4 more errors)"."""
    from recscale.data.schema import DenseFeature, Schema, SparseFeature
    from recscale.serve.rows import RequestError, RowParser

    parser = RowParser(
        Schema(dense=[DenseFeature(name="x")], sparse=[SparseFeature(name=n) for n in "abc"]), 8
    )
    good = {"x": 1.0, "a": 1, "b": "2", "c": None}

    def reason(row: dict) -> str:
        with pytest.raises(RequestError) as e:
            parser.parse(json.dumps({"rows": [row]}).encode())
        return str(e.value)

    assert reason(good | {"a": True}) == "rows[0].a: must be a string, an integer or null, got True"
    assert reason(good | {"a": True, "b": 1.5}).endswith("got True (and 1 more error)")
    assert reason({"a": True, "b": 1.5, "c": [], "x": "1"}).endswith(" (and 3 more errors)")


def _mutations(rng: random.Random, n: int) -> list[bytes]:
    good = json.dumps({"rows": [GOOD, GOOD | {"tags": None, "x": None}]}).encode()
    values = [None, True, -1, 2**70, 1e308, "", "é", [], [[]], {}, {"a": 1}, "\x00", [None], [1.5]]
    out = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:  # random bytes, or a truncated / spliced body
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(40))))
        elif kind == 1:
            cut = rng.randrange(len(good))
            out.append(good[:cut] + good[rng.randrange(len(good)) :])
        else:  # structurally valid JSON with a wrong value somewhere
            row = dict(GOOD)
            key = rng.choice([*GOOD, "label", "rows"])
            row[key] = rng.choice(values)
            out.append(json.dumps({"rows": [GOOD, row]}).encode())
    return out


def test_fuzzed_requests_never_take_the_server_down(client, scorer):
    for body in _mutations(random.Random(0), 300):
        r = client.post("/score", content=body)
        assert r.status_code in (200, 400, 413, 422), (body, r.status_code, r.text)
        if r.status_code != 200:
            assert "\n" not in r.json()["error"]
    r = client.post("/score", json={"rows": [GOOD]})
    assert r.status_code == 200 and 0 < r.json()["scores"][0] < 1


def test_batcher_merges_concurrent_requests_and_answers_each_its_own(scorer, trained):
    rows = _rows(trained["valid"])
    batches = [scorer.parser.parse(json.dumps({"rows": rows[i : i + 7]}).encode()) for i in range(0, 105, 7)]
    alone = [scorer.probabilities(b) for b in batches]
    calls = []
    real = scorer.probabilities
    scorer.probabilities = lambda b: calls.append(b.num_rows) or real(b)  # type: ignore[method-assign]
    try:
        batcher = scoring(scorer, ServeOptions(max_batch=64, max_wait_ms=200))
        futures = [batcher.submit(b) for b in batches]
        got = [f.result(timeout=30) for f in futures]
        batcher.stop()
    finally:
        del scorer.probabilities
    for a, g in zip(alone, got, strict=True):
        np.testing.assert_allclose(g, a, atol=1e-6)
    assert len(calls) < len(batches) and max(calls) <= 64  # merged, never past max_batch


def test_a_request_cancelled_while_it_waits_does_not_stop_the_batcher(scorer, trained):
    """A cancelled request's future cannot take a result: setting it raised in the scoring thread, which
    ended, and every later request waited forever."""
    body = json.dumps({"rows": _rows(trained["valid"])[:3]}).encode()
    batcher = scoring(scorer, ServeOptions(max_batch=64, max_wait_ms=300))
    try:
        gone = batcher.submit(scorer.parser.parse(body))
        assert gone.cancel()  # its handler was cancelled while the batch still gathered
        kept = batcher.submit(scorer.parser.parse(body))
        assert len(kept.result(timeout=30)) == 3
        later = batcher.submit(scorer.parser.parse(body))  # the thread is still there to score it
        assert len(later.result(timeout=30)) == 3
    finally:
        batcher.stop()


def _as_nohup() -> None:
    ctrl_c_as_in_a_terminal()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _start_serve(trained, *extra: str, workers: int = 1, nohup: bool = False) -> tuple[subprocess.Popen, str]:
    """``recscale serve`` on a free port (--port 0: the first line names it), once each of its
    ``workers`` processes has answered /readyz. ``nohup``: SIGHUP ignored, in a process group of its own."""
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    argv = ["serve", str(_export(trained)), "--port", "0", "--workers", str(workers), *extra]
    proc = subprocess.Popen(
        [sys.executable, "-m", "recscale.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_nohup if nohup else ctrl_c_as_in_a_terminal,
        process_group=0 if nohup else None,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    port = int(re.search(r"http://127\.0\.0\.1:(\d+) ", line).group(1))  # type: ignore[union-attr]
    assert port > 0, line
    url = f"http://127.0.0.1:{port}"
    deadline, ready = time.time() + 120, set()
    while len(ready) < workers:
        # Checked on every try, not only on refused ones: the answers may all come from one worker.
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()  # first, so that reading its stderr cannot wait on a live server
            pytest.fail(
                f"serve: {len(ready)} of {workers} workers ready after 120 s: {proc.communicate()[1][-2000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                answer = json.loads(r.read())
            assert answer["ready"] is True
            if answer["pid"] in ready:
                time.sleep(0.2)  # another worker is still starting
            ready.add(answer["pid"])
        except OSError:
            time.sleep(0.5)
    return proc, url


def test_serve_command_finishes_in_flight_requests_on_sigterm(trained):
    # A long batching wait keeps the request in flight while the signal arrives.
    proc, url = _start_serve(trained, "--max-wait-ms", "1500")
    try:
        answer: list = []
        req = urllib.request.Request(f"{url}/score", data=json.dumps({"rows": [GOOD]}).encode())
        client = threading.Thread(
            target=lambda: answer.append(json.loads(urllib.request.urlopen(req, timeout=30).read()))
        )
        client.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        client.join(timeout=30)
        assert len(answer) == 1 and len(answer[0]["scores"]) == 1  # answered, not dropped
        assert proc.wait(timeout=60) == -signal.SIGTERM  # uvicorn re-raises the signal once shut down
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_ctrl_c_exits_at_once_without_a_traceback(trained):
    """The first SIGINT drains (a request is held in the batching wait); the second exits without
    draining, and uvicorn used to log the cancelled lifespan's traceback as it did."""
    proc, url = _start_serve(trained, "--max-wait-ms", "3000")
    try:
        req = urllib.request.Request(f"{url}/score", data=json.dumps({"rows": [GOOD]}).encode())
        threading.Thread(target=lambda: urllib.request.urlopen(req, timeout=30), daemon=True).start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in err and err.strip().endswith("interrupted"), err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_workers_each_load_the_model_and_score_alike(trained, scorer):
    proc, url = _start_serve(trained, workers=2)
    try:
        body = json.dumps({"rows": _rows(trained["valid"])[:20]}).encode()
        want = scorer.probabilities(scorer.parser.parse(body))
        for _ in range(6):  # a new connection each time: both workers answer some
            with urllib.request.urlopen(urllib.request.Request(f"{url}/score", data=body), timeout=30) as r:
                np.testing.assert_allclose(json.loads(r.read())["scores"], want, atol=1e-6)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        # The supervisor stops its workers gracefully, then ends as one server does (it exited 0).
        assert proc.returncode == -signal.SIGTERM
        assert "is_fx_tracing" not in err, err  # the workers silence upstream notices as the CLI does
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_workers_under_nohup_outlive_the_terminal(trained):
    """uvicorn's supervisor takes over every signal it knows, ignored ones too: under nohup a hang-up killed the
    workers (SIGHUP's default action, which they started with) and the supervisor restarted them, dropping what
    they were serving. A signal ignored when the server started stays ignored; SIGTERM still stops it."""
    proc, _ = _start_serve(trained, workers=2, nohup=True)
    try:
        workers = _workers_of(proc.pid)
        os.killpg(proc.pid, signal.SIGHUP)  # the hang-up, to the server's process group
        time.sleep(3)
        assert proc.poll() is None and _workers_of(proc.pid) == workers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGTERM and "died" not in err, err[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _workers_of(pid: int) -> list[int]:
    """The processes ``pid`` spawned as its server workers (not multiprocessing's resource tracker)."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
        except OSError:  # gone meanwhile
            pass
    return out


def _loaded(pid: int, library: bytes) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_bytes()
    except OSError:  # gone
        return False


@pytest.mark.parametrize("restarted", [False, True])
def test_one_ctrl_c_stops_workers_that_are_still_starting(trained, restarted):
    """Ctrl-C reaches the whole process group: `serve --workers 2` stopped while its workers were still
    importing torch printed a KeyboardInterrupt traceback per worker, and the supervisor restarted the dead
    ones (the server then served on for tens of seconds). Now the workers ignore SIGINT until uvicorn handles
    it: one Ctrl-C stops the server, quietly, through the supervisor. ``restarted``: also a worker the
    supervisor started in place of one that died (it did not ignore SIGINT)."""
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    argv = ["serve", str(_export(trained)), "--port", "0", "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "recscale.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,  # its own group
                            preexec_fn=ctrl_c_as_in_a_terminal)  # fmt: skip
    try:
        assert proc.stdout is not None and "serving" in proc.stdout.readline()
        deadline, workers = time.time() + 60, []
        # Each worker in the middle of its imports: fbgemm loaded (after torch), torchrec still loading.
        while len(workers) < 2 or not all(_loaded(w, b"fbgemm_gpu_py") for w in workers):
            assert proc.poll() is None and time.time() < deadline, "no 2 workers importing torch within 60 s"
            time.sleep(0.05)
            workers = _workers_of(proc.pid)
        if restarted:
            os.kill(workers[0], signal.SIGKILL)
            deadline, first = time.time() + 150, workers  # the supervisor pings the other one first
            while not [w for w in workers if w not in first and _loaded(w, b"fbgemm_gpu_py")]:
                assert proc.poll() is None and time.time() < deadline, "no worker restarted within 150 s"
                time.sleep(0.05)
                workers = _workers_of(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and err.strip().endswith("interrupted"), err[-3000:]  # as with 1 worker
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
        assert not [w for w in workers if Path(f"/proc/{w}").exists()]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_workers_starting_on_a_busy_machine_are_not_taken_for_hung(monkeypatch, tmp_path):
    """uvicorn's supervisor kills a worker that misses a 5 s ping: a worker still importing torch on a busy
    machine was restarted every few seconds and never got ready. The server gives them a minute."""
    import uvicorn.supervisors

    from recscale.serve import server

    seen = {}

    class Supervisor:
        def __init__(self, config, sockets):
            seen["timeout"], seen["workers"] = config.timeout_worker_healthcheck, config.workers

        def run(self):
            pass

    monkeypatch.setattr(uvicorn.supervisors, "Multiprocess", Supervisor)
    with socket.create_server(("127.0.0.1", 0)) as sock:
        server.serve(None, tmp_path, 16, sock, ServeOptions(workers=2))
    assert seen == {"timeout": 60, "workers": 2}


def test_int8_dense_rounds_each_row_to_half_a_step_and_needs_its_scale():
    from recscale.models.quant import quantize_rows
    from recscale.serve.export import _dequantize_dense

    w = torch.randn(8, 5, 3) * torch.logspace(-3, 2, 8)[:, None, None]
    w[3] = 0  # an all-zero row keeps a finite scale
    q, scale = quantize_rows(w)
    assert (
        q.dtype == torch.int8 and scale.shape == (8,) and q.abs().amax(dim=(1, 2)).tolist()[:3] == [127] * 3
    )
    back = _dequantize_dense({"top.w": q, "top.w.int8_scale": scale}, "here")["top.w"]
    assert ((back - w).abs() <= scale[:, None, None] / 2 + 1e-12).all() and torch.equal(back[3], w[3])
    with pytest.raises(CheckpointError, match="top.w has no fp32 scale"):
        _dequantize_dense({"top.w": q}, "here")


def test_rows_missing_a_column_are_one_data_error(scorer, trained):
    """Scorer.probabilities from Python with a record batch lacking a feature column: a KeyError from
    deep in the preprocessing before; now one line naming the column."""
    body = json.dumps({"rows": _rows(trained["valid"])[:2]}).encode()
    with pytest.raises(DataError, match=r"lack the model's columns \['tags'\]"):
        scorer.probabilities(scorer.parser.parse(body).drop_columns(["tags"]))


def _demo_scorer(tmp_path: Path) -> Scorer:
    """A Scorer of `make demo`'s kind of run (synthetic data), trained two steps and exported."""
    run, model = tmp_path / "run", tmp_path / "model"
    assert main(["train", str(CONFIGS / "demo.yaml"), "--out", str(run), "train.max_steps=2",
                 "data.synthetic.rows={train: 512, valid: 256, test: 256}", "train.progress=false"]) == 0  # fmt: skip
    assert main(["export", str(run), "--out", str(model)]) == 0
    return Scorer(model, max_rows=8)


def test_a_model_trained_on_synthetic_data_serves(tmp_path):
    """Synthetic ids are integers, so their vocabularies are int; the warm-up's row of nulls gives a
    multi-id field no ids at all, and the empty lookup used to fail on the types before it was cast:
    the server never started for `make demo`'s kind of run."""
    scorer = _demo_scorer(tmp_path)
    with TestClient(create_app(scorer, ServeOptions())) as c:  # the lifespan warms up on a row of nulls
        names = scorer.parser.arrow_schema.names
        row = {n: (0.5 if n.startswith("d") else [1, 2] if n.startswith("m") else 3) for n in names}
        r = c.post("/score", json={"rows": [row, dict.fromkeys(names)]})
    assert r.status_code == 200 and len(r.json()["scores"]) == 2


def test_a_served_history_keeps_its_most_recent_max_len_ids(tmp_path):
    """Training cuts a history to its last max_len ids (the readers); the server used to embed the whole
    list: other scores, or a 500 where the causal encoder's positions ran out."""
    run, model = tmp_path / "run", tmp_path / "model"
    assert main(["train", str(CONFIGS / "demo.yaml"), "--out", str(run), "train.max_steps=2",
                 "data.synthetic.rows={train: 512, valid: 256, test: 256}", "data.synthetic.num_history=1",
                 "data.synthetic.history_max_len=8", "model.embedding.sequence={encoder: causal}",
                 "train.progress=false"]) == 0  # fmt: skip
    assert main(["export", str(run), "--out", str(model)]) == 0
    scorer = Scorer(model, max_rows=8)
    names = scorer.parser.arrow_schema.names
    row = {n: (0.5 if n.startswith("d") else [1, 2] if n.startswith("m") else 3) for n in names}
    history = [int(v) for v in scorer.pre.vocabs["h0"].to_pylist()[:30]]
    rows = [row | {"h0": history}, row | {"h0": history[-8:]}, row | {"h0": history[:8]}]
    p = scorer.probabilities(scorer.parser.parse(json.dumps({"rows": rows}).encode()))
    assert p[0] == pytest.approx(p[1], rel=1e-5) and abs(p[0] - p[2]) > 1e-4, p


def test_a_served_empty_id_of_a_multi_id_feature_is_dropped_as_the_readers_drop_it(tmp_path):
    """Training reads `x|` (or a list ['x', '']) as ['x']; the server embedded ["1", ""] with an OOV id."""
    scorer = _demo_scorer(tmp_path)
    names = scorer.parser.arrow_schema.names
    row = {n: (0.5 if n.startswith("d") else [1, 2] if n.startswith("m") else 3) for n in names}
    multi = [n for n in names if n.startswith("m")]
    assert multi
    rows = [row, row | dict.fromkeys(multi, [1, "", 2])]
    p = scorer.probabilities(scorer.parser.parse(json.dumps({"rows": rows}).encode()))
    assert p[0] == pytest.approx(p[1], rel=1e-6), p


def test_served_ids_follow_the_readers_id_rule(tmp_path):
    """The readers read "3.0" as id 3 and a single "" as a missing id; the server kept both as written
    (another id: OOV), so a row scored otherwise served than in `recscale eval`."""
    scorer = _demo_scorer(tmp_path)
    names = scorer.parser.arrow_schema.names
    single = [n for n in names if n.startswith("s")]
    multi = [n for n in names if n.startswith("m")]
    assert single and multi
    row = {n: (0.5 if n.startswith("d") else [1, 2] if n in multi else 3) for n in names}
    rows = [
        row,
        row | dict.fromkeys(single, "3.0") | dict.fromkeys(multi, ["1.0", "2"]),
        row | dict.fromkeys(single, None),
        row | dict.fromkeys(single, ""),
    ]
    batch = scorer.parser.parse(json.dumps({"rows": rows}).encode())
    assert batch.column(single[0]).to_pylist() == ["3", "3", None, None]
    assert batch.column(multi[0]).to_pylist()[1] == ["1", "2"]
    p = scorer.probabilities(batch)
    assert p[0] == pytest.approx(p[1], rel=1e-6) and p[2] == pytest.approx(p[3], rel=1e-6), p


def test_a_served_history_with_an_empty_id_is_refused_as_the_readers_refuse_it():
    """Training data with a history 3||7 is refused as malformed; the server scored ["3", ""] with an OOV
    position (another score than ["3"]) without a word."""
    from recscale.data.schema import Schema
    from recscale.serve.rows import RequestError, RowParser

    schema = Schema.model_validate(
        {"sparse": [{"name": "m", "multi": True}, {"name": "h", "multi": True, "max_len": 4}]}
    )
    parser = RowParser(schema, 8)
    ok = [{"m": ["a", ""], "h": ["3", 7]}, {"m": None, "h": []}, {"m": [], "h": None}]
    assert parser.parse(json.dumps({"rows": ok}).encode()).column("h").to_pylist() == [["3", "7"], [], None]
    with pytest.raises(RequestError, match=r"rows\[1\]\.h: a history's ids must not be empty") as e:
        parser.parse(json.dumps({"rows": [ok[0], {"m": [], "h": ["3", ""]}]}).encode())
    assert e.value.status == 422


def test_fp16_stored_tables_export_as_the_fp32_their_manifest_names(tmp_path):
    """model.embedding.storage=fp16 exported fp16 tensors under a manifest saying 'tables: fp32'; they
    are now fp32 tensors of the same values (scores unchanged), and `--tables fp16` halves them."""
    from recscale.serve.artifact import read_artifact
    from recscale.train.runs import load_trained

    run, model = tmp_path / "run", tmp_path / "model"
    assert main(["train", str(CONFIGS / "demo.yaml"), "--out", str(run), "train.max_steps=2",
                 "data.synthetic.rows={train: 512, valid: 256, test: 256}", "model.embedding.storage=fp16",
                 "train.progress=false"]) == 0  # fmt: skip
    assert main(["export", str(run), "--out", str(model)]) == 0
    art = read_artifact(model)
    name = "embedding.ebc.embedding_bags.t_s0.weight"
    trained = load_trained(run)[2].model.state_dict()[name].local_shards()[0].tensor  # one process: one shard
    assert art.manifest.tables == "fp32" and art.config.model.embedding.storage == "fp32"
    assert trained.dtype == torch.float16 and art.tensors[name].dtype == torch.float32
    assert torch.equal(art.tensors[name], trained.float())


def test_fp16_stored_sequence_tables_export_too(tmp_path):
    """A history's table is stored fp16 as well; export turned only the pooled tables to fp32 and then
    refused its own checkpoint ('tensor embedding.ec.embeddings.t_h0.weight is torch.float16 ...; export
    it again')."""
    from recscale.serve.artifact import read_artifact

    run, model = tmp_path / "run", tmp_path / "model"
    assert main(["train", str(CONFIGS / "demo.yaml"), "--out", str(run), "train.max_steps=2",
                 "data.synthetic.rows={train: 512, valid: 256, test: 256}", "data.synthetic.num_history=1",
                 "data.synthetic.history_max_len=8", "model.embedding.sequence={encoder: causal}",
                 "model.embedding.storage=fp16", "train.progress=false"]) == 0  # fmt: skip
    assert main(["export", str(run), "--out", str(model)]) == 0
    assert read_artifact(model).tensors["embedding.ec.embeddings.t_h0.weight"].dtype == torch.float32


def test_a_bf16_sequence_run_exported_in_bf16_scores_as_its_eval(tmp_path):
    """--dense bf16 / int8 stored a history's table and the causal encoder's position embeddings as dense
    matrices: lookups that autocast never rounds, so the bf16 export of a bf16 run scored ~1e-3 off its
    eval (its fp32 export scores as eval), and --tables fp32 --dense int8 held an int8 table."""
    from recscale.serve.artifact import read_artifact

    run = tmp_path / "run"
    assert main(["train", str(CONFIGS / "demo.yaml"), "--out", str(run), "train.max_steps=2",
                 "data.synthetic.rows={train: 512, valid: 256, test: 256}", "data.synthetic.num_history=1",
                 "data.synthetic.history_max_len=8", "model.embedding.sequence={encoder: causal_din, target: s0}",
                 "train.precision=bf16", "train.dense_optimizer.lr=0.05", "train.progress=false"]) == 0  # fmt: skip
    for dense in ("fp32", "bf16", "int8"):
        assert main(["export", str(run), "--out", str(tmp_path / dense), "--dense", dense]) == 0
    fp32, bf16 = Scorer(tmp_path / "fp32", max_rows=64), Scorer(tmp_path / "bf16", max_rows=64)
    rng = random.Random(0)
    names = fp32.parser.arrow_schema.names
    rows = [
        {n: rng.random() if n.startswith("d") else [rng.randrange(40) for _ in range(rng.randrange(12))]
         if n.startswith(("m", "h")) else rng.randrange(40) for n in names}
        for _ in range(64)
    ]  # fmt: skip
    body = json.dumps({"rows": rows}).encode()
    np.testing.assert_allclose(
        bf16.logits(bf16.parser.parse(body)), fp32.logits(fp32.parser.parse(body)), atol=1e-6, rtol=0
    )
    tensors = read_artifact(tmp_path / "int8").tensors
    lookups = ["embedding.ec.embeddings.t_h0.weight", "embedding.encoders.h0.positions.weight"]
    assert all(tensors[n].dtype == torch.float32 and n + ".int8_scale" not in tensors for n in lookups)


def test_a_model_a_kill_set_aside_while_replacing_it_still_serves(trained, tmp_path):
    """A kill between atomic_dir's two renames (export into an existing --out) left no model at --out, the
    old one as .OUT.old: `serve OUT` said 'not an exported model'. It reads the set-aside copy, and the
    next export into OUT supersedes it."""
    from recscale.serve.artifact import read_artifact

    out = tmp_path / "model"
    shutil.copytree(_export(trained), tmp_path / ".model.old")
    assert read_artifact(out).manifest == read_artifact(tmp_path / ".model.old").manifest
    assert main(["export", str(trained["run"]), "--out", str(out)]) == 0
    assert out.is_dir() and not (tmp_path / ".model.old").exists()


def test_score_file_reads_a_movielens_directory_as_eval_does(tmp_path, shared_data):
    """A MovieLens model's options name the split training read (train): score_file scored those 80,000
    training ratings where eval scores the test split's."""
    from recscale.serve.scorer import Scorer
    from recscale.train.metrics import ctr_metrics
    from recscale.train.runs import eval_run

    ml = shared_data / "movielens-100k"
    config = Path(__file__).resolve().parents[1] / "configs" / "movielens.yaml"
    run, out = tmp_path / "run", tmp_path / "model"
    assert main(["train", str(config), "--out", str(run), f"data.train={ml}", "model.name=lr",
                 "train.max_steps=2", "train.progress=false"]) == 0  # fmt: skip
    assert main(["export", str(run), "--out", str(out)]) == 0
    logits, labels = Scorer(out).score_file(ml)
    m = eval_run(run, str(ml))
    assert len(logits) == m["rows"] < 80_000
    got = ctr_metrics(torch.from_numpy(logits).double(), torch.from_numpy(labels).double())
    assert got["auc"] == pytest.approx(m["auc"], abs=1e-6)


class _HeldScorer:
    """Scores a batch as its ``v`` column; the first call waits for ``release`` (the batcher's thread is
    busy while the test queues requests behind it). ``calls``: each batch's request tags, in order."""

    def __init__(self) -> None:
        self.release, self.busy = threading.Event(), threading.Event()
        self.calls: list[list[int]] = []

    def probabilities(self, batch: pa.RecordBatch) -> np.ndarray:
        self.busy.set()
        self.release.wait(30)
        v = batch.column("v").to_numpy()
        self.calls.append(sorted({int(x) // 1000 for x in v}))
        return v.astype(np.float32)


def _request(tag: int, rows: int) -> pa.RecordBatch:
    return pa.record_batch({"v": pa.array([tag * 1000 + i for i in range(rows)], pa.float32())})


def test_a_request_that_does_not_fit_the_batch_is_scored_next_and_on_shutdown():
    """A request that would overflow the batch being gathered went back to the *end* of the queue: behind
    every later request (scored last under a steady stream) and behind the stop marker, so a request queued
    at shutdown was never answered."""
    scorer = _HeldScorer()
    batcher = scoring(scorer, ServeOptions(max_batch=64))  # type: ignore[arg-type]
    first = batcher.submit(_request(0, 1))
    assert scorer.busy.wait(30)  # the thread scores request 0 while 1-5 queue
    sizes = {1: 10, 2: 60, 3: 10, 4: 10, 5: 10}
    futures = {tag: batcher.submit(_request(tag, n)) for tag, n in sizes.items()}
    stopping = threading.Thread(target=batcher.stop)
    stopping.start()  # the stop marker queues behind them
    time.sleep(0.2)
    scorer.release.set()
    stopping.join(30)
    assert not stopping.is_alive()
    assert len(first.result(timeout=1)) == 1
    for tag, fut in futures.items():  # each answered, with its own rows
        np.testing.assert_array_equal(fut.result(timeout=1), _request(tag, sizes[tag]).column("v").to_numpy())
    # Request 2 did not fit beside 1: it starts the next batch, before the requests that came after it.
    assert scorer.calls == [[0], [1], [2], [3, 4, 5]]


def test_score_file_holds_no_chunk_of_scores_until_the_end(scorer, trained, monkeypatch):
    """score_file copies each chunk's logits and labels into arrays it grows as it goes. It kept every chunk's
    output to concatenate at the end, which pinned the allocator's heap between each chunk's freed
    temporaries (Criteo-shaped 3M rows: ~1 GB more resident for 12 MB of scores), as predict once did."""
    import weakref

    expected, expected_labels = scorer.score_file(trained["valid"])
    real = scorer.logits
    outputs: list[weakref.ref] = []
    held = []  # each call's count of earlier outputs still alive

    def logits(batch: pa.RecordBatch) -> torch.Tensor:
        held.append(sum(r() is not None for r in outputs))
        out = real(batch).numpy().copy()
        outputs.append(weakref.ref(out))
        return torch.from_numpy(out)

    monkeypatch.setattr(scorer, "logits", logits)
    got, labels = scorer.score_file(trained["valid"], chunk_rows=16)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_array_equal(labels, expected_labels)
    assert len(got) == 120 and len(held) == 8 and max(held) <= 1


def test_a_large_request_is_parsed_off_the_event_loop(scorer, trained, monkeypatch):
    """A 4,096-row request spent ~110 ms parsing on the event loop, and every other request waited for it. Here
    the large request's parse blocks until a small request sent after it has been answered: on the event loop
    it would block that answer too (until the 10 s wait gives up)."""
    from recscale.serve.server import INLINE_PARSE_BYTES

    rows = _rows(trained["valid"]) * 3
    small = json.dumps({"rows": rows[:1]}).encode()
    large = json.dumps({"rows": rows[:256]}).encode()
    assert len(small) <= INLINE_PARSE_BYTES < len(large)
    parse, started, released = scorer.parser.parse, threading.Event(), threading.Event()

    def slow_parse(body: bytes) -> pa.RecordBatch:
        if body == large:
            started.set()
            released.wait(10)
        return parse(body)

    monkeypatch.setattr(scorer.parser, "parse", slow_parse)
    with TestClient(create_app(scorer, ServeOptions())) as c:
        answers: dict[str, object] = {}
        big = threading.Thread(target=lambda: answers.update(large=c.post("/score", content=large)))
        big.start()
        assert started.wait(10)
        t0 = time.perf_counter()
        r = c.post("/score", content=small)
        waited = time.perf_counter() - t0
        released.set()
        big.join(30)
        assert r.status_code == 200 and waited < 5, waited
        assert answers["large"].status_code == 200 and len(answers["large"].json()["scores"]) == 256
        # errors of a large body are the same one line and status as ever
        r = c.post("/score", content=json.dumps({"rows": rows[:255] + [GOOD | {"x": "1"}]}).encode())
        assert r.status_code == 422 and r.json()["error"].startswith("rows[255].x: must be"), r.text
