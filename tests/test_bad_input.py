"""Bad input, as a careless user or a full disk gives it: every case is one ``error:`` line on stderr,
a non-zero exit code, no traceback, and the run directory (or the absence of one) left byte-identical.

Grow this table with the CLI: a new command or option gets its bad cases here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from recscale.cli import main

FRAPPE = ["user", "item", "daytime", "weekday", "isweekend", "homework", "cost", "weather", "country", "city"]
HEADER = ",".join(["label", *FRAPPE])
ROWS = [f"{i % 2},{i % 7},{i % 11},1,2,3,4,5,6,7,8" for i in range(64)]


PARQUET_BYTES = b"PAR1\x15\xf0\x8c\x01" + bytes(64)  # a Parquet file's start: its bytes are no UTF-8 text


def config_text(train: str) -> str:
    sparse = ", ".join(f"{{name: {f}}}" for f in FRAPPE)
    return (
        f"data:\n  format: csv\n  train: {train}\n  valid: {train}\n"
        f"  schema: {{label: label, sparse: [{sparse}]}}\n"
        "model: {name: lr}\ntrain: {batch_size: 16, max_steps: 2, progress: false}\n"
    )


def snapshot(path: Path) -> dict[str, str] | None:
    """Every file and directory under ``path`` with its content hash and mode; None if absent."""
    if not path.exists():
        return None
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(root, name)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            out[str(p.relative_to(path))] = f"{digest} {oct(p.stat().st_mode)}"
    return out


@dataclass
class Ctx:
    tmp: Path
    cfg: Path  # a valid config training on ``good``
    good: Path  # a valid CSV
    run: Path  # a copy of a trained run (lr, 2 steps) of ``cfg``
    syn_run: Path  # a copy of a trained run on synthetic data

    def csv(self, name: str, text: str | bytes) -> str:
        p = self.tmp / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)

    def yaml(self, text: str) -> str:
        return self.csv("c.yaml", text)

    def train(self, *args: str) -> list[str]:
        """A fresh training run of ``cfg`` into tmp/new (absent before) with extra overrides/options."""
        return ["train", str(self.cfg), "--out", str(self.tmp / "new"), *args]

    def bad_train(self, rows: list[str] | bytes, header: str = HEADER, **kw: str) -> list[str]:
        text = rows if isinstance(rows, bytes) else "\n".join([header, *rows]) + "\n"
        path = self.csv("bad.csv", text)
        return self.train(f"data.train={path}", *(f"{k}={v}" for k, v in kw.items()))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    base = tmp_path_factory.mktemp("base")
    good = base / "good.csv"
    good.write_text("\n".join([HEADER, *ROWS]) + "\n")
    cfg = base / "run.yaml"
    cfg.write_text(config_text(str(good)))
    assert main(["train", str(cfg), "--out", str(base / "run")]) == 0
    syn = [
        "data.synthetic.rows={train: 300, valid: 100, test: 100}",
        "train.max_steps=1",
        "train.progress=false",
    ]
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    assert main(["train", str(demo), "--out", str(base / "syn"), *syn, "train.batch_size=64"]) == 0
    return cfg, good, base / "run", base / "syn"


@pytest.fixture
def ctx(trained, tmp_path) -> Ctx:
    cfg, good, run, syn = trained
    shutil.copytree(run, tmp_path / "run")
    shutil.copytree(syn, tmp_path / "syn")
    return Ctx(tmp_path, cfg, good, tmp_path / "run", tmp_path / "syn")


def _ckpt(run: Path) -> Path:
    return sorted((run / "ckpt").iterdir())[-1]


def _break_rng(c: Ctx) -> None:
    """Rename the key of the saved RNG state in the last checkpoint's state.json (found by the fuzzer)."""
    path = _ckpt(c.run) / "state.json"
    state = json.loads(path.read_text())
    rng = next(v for k, v in state["__dict__"] if k == "rng")
    rng[0]["__dict__"][0][0] = "nope"
    path.write_text(json.dumps(state))


def _write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


@dataclass
class Case:
    id: str
    argv: Callable[[Ctx], list[str]]
    words: tuple[str, ...]  # each must appear in the error line (case-insensitive)
    setup: Callable[[Ctx], object] | None = None  # runs before the snapshot (e.g. tampers a run)
    watch: Callable[[Ctx], Path] = lambda c: c.tmp / "new"  # what must be left unchanged
    code: int = 2


def run_dir(c: Ctx) -> Path:
    return c.run


def tampered(id: str, words: tuple[str, ...], setup: Callable[[Ctx], object]) -> Case:
    """``recscale eval`` of the run after ``setup`` tampered with one of its files."""
    return Case(id, lambda c: ["eval", str(c.run), "--data", str(c.good)], words, setup=setup, watch=run_dir)


CASES = [
    # -------- config and command line
    Case("config file missing", lambda c: ["train", str(c.tmp / "nope.yaml")], ("nope.yaml", "not found")),
    Case(
        "config not YAML",
        lambda c: ["train", c.yaml("data:\n  format: csv\n   train: x\n")],
        ("c.yaml:3", "yaml"),
    ),
    Case("config a list", lambda c: ["train", c.yaml("- a\n- b\n")], ("c.yaml", "mapping")),
    Case("config unknown key", lambda c: c.train("train.batch_sise=3"), ("train.batch_sise", "unknown key")),
    Case("config wrong type", lambda c: c.train("train.batch_size=abc"), ("train.batch_size",)),
    Case("config impossible value", lambda c: c.train("train.batch_size=0"), ("train.batch_size", "greater")),
    Case("unknown model", lambda c: c.train("model.name=nope"), ("unknown model", "nope")),
    Case("override without =", lambda c: c.train("train.max_steps"), ("key=value",)),
    Case("override into a value", lambda c: c.train("seed.x=1"), ("seed",)),
    Case(  # was an "internal error ParserError", exit code 1
        "override value not YAML",
        lambda c: c.train("model.quant={format: mxfp4"),
        ("override 'model.quant={format: mxfp4'", "not valid YAML"),
    ),
    Case("unknown data format", lambda c: c.train("data.format=xls"), ("data.format",)),
    Case(
        "config without train file",
        lambda c: ["train", c.yaml("data: {format: csv}\nmodel: {name: lr}\n")],
        ("data.train",),
    ),
    Case(
        "base config missing",
        lambda c: ["train", c.yaml("base: gone.yaml\nmodel: {name: lr}\n")],
        ("gone.yaml", "no such file"),
    ),
    Case("train without a config", lambda c: ["train", "--out", str(c.tmp / "new")], ("give a config",)),
    Case("--resume without --out", lambda c: ["train", "--resume"], ("--resume", "--out")),
    Case(
        "--resume on no run",
        lambda c: ["train", "--resume", "--out", str(c.tmp / "new")],
        ("new does not exist", "start a new run without it"),
    ),
    Case(
        "--resume changes the model",
        lambda c: ["train", "--resume", "--out", str(c.run), "model.name=fm"],
        ("--resume", "model.name", "another run_dir (CLI: --out)"),
        watch=run_dir,
    ),
    Case(
        "--resume with a config of another shape",
        lambda c: ["train", str(c.cfg), "--resume", "--out", str(c.run), "model.embedding.dim=8"],
        ("model.embedding.dim",),
        watch=run_dir,
    ),
    Case(
        "--resume with a corrupt config.yaml",
        lambda c: ["train", "--resume", "--out", str(c.run)],
        ("config.yaml", "yaml"),
        setup=lambda c: _write(c.run / "config.yaml", "model: [\n"),
        watch=run_dir,
    ),
    Case(
        "train into an existing run",
        lambda c: ["train", str(c.cfg), "--out", str(c.run)],
        ("already holds a run", "--resume"),
        watch=run_dir,
    ),
    Case(
        "--out is a file",
        lambda c: ["train", str(c.cfg), "--out", str(c.good)],
        ("is a file",),
        watch=lambda c: c.good,
    ),
    Case("--local-world-size without --nproc", lambda c: c.train("--local-world-size", "2"), ("--nproc",)),
    Case(
        "--nproc does not split into hosts",
        lambda c: c.train("--nproc", "3", "--local-world-size", "2", "train.batch_size=48"),
        ("cannot be split",),
    ),
    Case(
        "sparse optimizer without CPU kernel",
        lambda c: c.train("train.sparse_optimizer={name: adam, lr: 0.001}"),
        ("no fused cpu kernel",),
    ),
    Case(
        "unknown small_dim feature",
        lambda c: c.train("model.embedding.small_dim_features=[nope]"),
        ("small_dim_features", "nope"),
    ),
    Case(
        "an empty list separator",
        lambda c: c.train("data.schema.sparse=[{name: user, multi: true, sep: ''}]"),
        ("sep", "at least 1"),
    ),
    Case("an infinite learning rate", lambda c: c.train("train.dense_optimizer.lr=inf"), ("lr", "finite")),
    Case("a seed past 64 bits", lambda c: c.train("seed=99999999999999999999999"), ("seed", "less than")),
    Case(
        "unknown quotient-remainder feature",
        lambda c: c.train("model.embedding.qr_buckets={nope: 10}"),
        ("qr_buckets", "nope"),
    ),
    Case(
        "a feature with two kinds of table",
        lambda c: c.train(
            "model.embedding.qr_buckets={user: 10}", "model.embedding.small_dim_features=[user]"
        ),
        ("user", "both qr_buckets and small_dim_features"),
    ),
    Case(
        "table weight decay on fused tables",
        lambda c: c.train("train.sparse_optimizer={name: rowwise_adagrad, lr: 0.1, weight_decay: 0.1}"),
        ("weight_decay", "data_parallel"),
    ),
    Case(
        "dense value not a number",
        lambda c: c.train(
            "data.schema={label: label, dense: [{name: user}], sparse: [{name: item}]}",
            f"data.train={c.csv('d.csv', HEADER + chr(10) + '1,abc,2,1,2,3,4,5,6,7,8' + chr(10))}",
        ),
        ("d.csv", "line 2", "user"),
    ),
    # -------- data files
    Case("train file missing", lambda c: c.train(f"data.train={c.tmp / 'gone.csv'}"), ("gone.csv",)),
    Case(
        "valid file missing",
        lambda c: c.train(f"data.valid={c.tmp / 'gone.csv'}"),
        ("data.valid", "gone.csv", "does not exist"),
    ),
    Case(
        "relative train path missing",
        lambda c: c.train("data.train=no/such/gone.csv"),
        (
            "data.train: no/such/gone.csv does not exist (relative paths are read from the working directory, ",
        ),
    ),
    Case("train file empty", lambda c: c.bad_train(b""), ("bad.csv", "empty")),
    Case("train file header only", lambda c: c.bad_train([]), ("bad.csv", "no data rows")),
    Case(
        "train file is binary",
        lambda c: c.bad_train(os.urandom(2000).replace(b"\n", b"") + b"\0\n"),
        ("bad.csv", "binary"),
    ),
    # The folder holds the run's directory: refused before the run writes into it.
    Case("train file is a directory", lambda c: c.train(f"data.train={c.tmp}"), ("is inside data.train",)),
    Case(
        "bad label", lambda c: c.bad_train([*ROWS, "x,1,2,3,4,5,6,7,8,9,10"]), ("bad.csv", "line 66", "label")
    ),
    Case("label 2", lambda c: c.bad_train([*ROWS, "2,1,2,3,4,5,6,7,8,9,10"]), ("bad.csv", "label '2'")),
    Case("label yes", lambda c: c.bad_train([*ROWS, "yes,1,2,3,4,5,6,7,8,9,10"]), ("bad.csv", "label 'yes'")),
    Case("short row", lambda c: c.bad_train([*ROWS, "1,1,2"]), ("bad.csv", "line 66", "columns")),
    Case(
        "missing column",
        lambda c: c.bad_train(ROWS, header=HEADER.replace("city", "town")),
        ("bad.csv", "city"),
    ),
    Case(
        "not UTF-8",
        lambda c: c.bad_train(
            ("\n".join([HEADER, *ROWS]) + "\n").encode() + b"1,\xff\xfe,2,3,4,5,6,7,8,9,10\n"
        ),
        ("bad.csv", "utf"),
    ),
    Case("CSV read as parquet", lambda c: c.train("data.format=parquet"), ("parquet",)),
    Case("CSV read as Criteo TSV", lambda c: c.train("data.format=criteo"), ("good.csv",)),
    Case("CSV read as libsvm", lambda c: c.train("data.format=libsvm"), ("good.csv",)),
    Case(
        "Parquet read as CSV",
        lambda c: c.train("data.train=" + c.csv("p.csv", PARQUET_BYTES)),
        ("p.csv", "is a Parquet file", "data.format=parquet"),
    ),
    Case("bad data.options", lambda c: c.train("data.options={delimter: ';'}"), ("delimter",)),
    # -------- eval
    Case(
        "eval: run missing",
        lambda c: ["eval", str(c.tmp / "gone"), "--data", str(c.good)],
        ("not a recscale run directory",),
    ),
    Case(
        "eval: run is a file",
        lambda c: ["eval", str(c.good), "--data", str(c.good)],
        ("not a recscale run directory",),
        watch=lambda c: c.good,
    ),
    Case(
        "eval: a file run without --data",
        lambda c: ["eval", str(c.run)],
        ("give the file to score", "--data"),
        watch=run_dir,
    ),
    Case(
        "eval: data missing",
        lambda c: ["eval", str(c.run), "--data", str(c.tmp / "gone.csv")],
        ("gone.csv", "no such file"),
        watch=run_dir,
    ),
    Case(
        "eval: a directory of folders, no data files",  # a folder of parts is read as one split, not its folders
        lambda c: ["eval", str(c.run), "--data", str(c.tmp)],
        ("holds folders (run, syn)", "give a pattern matching their files"),
        watch=run_dir,
    ),
    Case(
        "eval: --format synthetic on a run trained on a file",
        lambda c: ["eval", str(c.run), "--format", "synthetic"],
        ("trained on csv data", "--format synthetic"),
        watch=run_dir,
    ),
    Case(
        "eval: data lacks a column",
        lambda c: [
            "eval",
            str(c.run),
            "--data",
            c.csv("e.csv", HEADER.replace("user", "usr") + "\n1,1,1,1,1,1,1,1,1,1,1\n"),
        ],
        ("e.csv", "user"),
        watch=run_dir,
    ),
    Case(
        "eval: bad label in data",
        lambda c: ["eval", str(c.run), "--data", c.csv("e.csv", HEADER + "\nz,1,1,1,1,1,1,1,1,1,1\n")],
        ("e.csv", "label"),
        watch=run_dir,
    ),
    Case(
        "eval: synthetic run without --format",
        lambda c: ["eval", str(c.syn_run), "--data", str(c.good)],
        ("synthetic", "--format"),
        watch=lambda c: c.syn_run,
    ),
    Case(
        "eval: a Parquet file to a CSV run",
        lambda c: ["eval", str(c.run), "--data", c.csv("p.parquet", PARQUET_BYTES)],
        ("p.parquet", "is a Parquet file", "--format parquet"),
        watch=run_dir,
    ),
    Case(
        "eval: unknown --format",
        lambda c: ["eval", str(c.run), "--data", str(c.good), "--format", "xls"],
        ("xls",),
        watch=run_dir,
    ),
    tampered(
        "eval: corrupt config.yaml",
        ("config.yaml",),
        lambda c: _write(c.run / "config.yaml", "data: {format: csv\n"),
    ),
    tampered(
        "eval: config.yaml of another shape",
        ("config.yaml", "train.batch_size"),
        lambda c: _write(
            c.run / "config.yaml",
            (c.run / "config.yaml").read_text().replace("batch_size: 16", "batch_size: -1"),
        ),
    ),
    tampered(
        "eval: config.yaml names unknown features",
        ("config.yaml", "small_dim_features"),
        lambda c: _write(
            c.run / "config.yaml",
            (c.run / "config.yaml")
            .read_text()
            .replace("small_dim_features: []", "small_dim_features: [a, b]"),
        ),
    ),
    tampered(
        "eval: preprocess.json not an object",
        ("preprocess.json",),
        lambda c: _write(c.run / "preprocess.json", "[1, 2]"),
    ),
    tampered(
        "eval: preprocess.json truncated",
        ("preprocess.json",),
        lambda c: _write(c.run / "preprocess.json", (c.run / "preprocess.json").read_bytes()[:50]),
    ),
    tampered(
        "eval: preprocess.json missing", ("preprocess.json",), lambda c: (c.run / "preprocess.json").unlink()
    ),
    tampered(
        "eval: no checkpoint",
        ("no complete checkpoint",),
        lambda c: [shutil.rmtree(c.run / d) for d in ("ckpt", "best")],
    ),
    tampered(
        "eval: checkpoint metadata truncated",
        (".metadata",),
        lambda c: [
            _write(p / ".metadata", (p / ".metadata").read_bytes()[:40])
            for p in (c.run / "best", _ckpt(c.run))
        ],
    ),
    Case(
        "resume: checkpoint state.json not JSON",
        lambda c: ["train", "--resume", "--out", str(c.run), "train.max_steps=4"],
        ("state.json",),
        setup=lambda c: _write(_ckpt(c.run) / "state.json", "{"),
        watch=run_dir,
    ),
    Case(
        "resume: checkpoint RNG state damaged",
        lambda c: ["train", "--resume", "--out", str(c.run), "train.max_steps=4"],
        ("state.json", "damaged"),
        setup=_break_rng,
        watch=run_dir,
    ),
    # -------- data inspect, sweep, scaling, dmt
    Case(
        "inspect: missing file",
        lambda c: ["data", "inspect", str(c.tmp / "gone.csv")],
        ("gone.csv", "no such file"),
    ),
    Case("inspect: empty file", lambda c: ["data", "inspect", c.csv("e.csv", b"")], ("e.csv", "empty")),
    Case(
        "inspect: binary file",
        lambda c: ["data", "inspect", c.csv("b.csv", b"\x00\x01\x02abc\n")],
        ("b.csv",),
    ),
    Case("inspect: unknown format", lambda c: ["data", "inspect", str(c.good), "--format", "xls"], ("xls",)),
    Case(
        "prepare: a bad training file leaves no --out behind",
        lambda c: [
            "data",
            "prepare",
            str(c.cfg),
            "--out",
            str(c.tmp / "new"),
            f"data.train={c.csv('h.csv', HEADER + chr(10))}",
        ],  # fmt: skip
        ("h.csv",),
    ),
    Case("sweep: missing file", lambda c: ["sweep", str(c.tmp / "gone.yaml")], ("gone.yaml", "not found")),
    Case("sweep: not a mapping", lambda c: ["sweep", c.yaml("[1, 2]\n")], ("c.yaml", "mapping")),
    Case(
        "scaling fit: missing results", lambda c: ["scaling", "fit", str(c.tmp / "gone.csv")], ("gone.csv",)
    ),
    Case("scaling fit: not a results file", lambda c: ["scaling", "fit", str(c.good)], ("good.csv",)),
    Case(
        "dmt partition: missing run",
        lambda c: ["dmt", "partition", str(c.tmp / "gone"), "--towers", "2"],
        ("not a recscale run directory",),
    ),
    # A run without a checkpoint: the error said "to evaluate" whichever command loaded the run.
    Case(
        "dmt partition: no checkpoint",
        lambda c: ["dmt", "partition", str(c.run), "--towers", "2"],
        ("no complete checkpoint to partition into DMT towers", "train the run first"),
        setup=lambda c: [shutil.rmtree(c.run / d) for d in ("ckpt", "best")],
        watch=run_dir,
    ),
    Case(
        "export: no checkpoint",
        lambda c: ["export", str(c.run), "--out", str(c.tmp / "new")],
        ("no complete checkpoint to export",),
        setup=lambda c: [shutil.rmtree(c.run / d) for d in ("ckpt", "best")],
    ),
    Case(
        "precision probe: no checkpoint",
        lambda c: ["precision", "probe", str(c.run), "--data", str(c.good)],
        ("no complete checkpoint to probe",),
        setup=lambda c: [shutil.rmtree(c.run / d) for d in ("ckpt", "best")],
        watch=run_dir,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case: Case, ctx: Ctx, capsys) -> None:
    if case.setup is not None:
        case.setup(ctx)
    argv = case.argv(ctx)
    watched = case.watch(ctx)
    before = snapshot(watched)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == case.code, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert all(w.lower() in lines[0].lower() for w in case.words), lines[0]
    assert snapshot(watched) == before, f"{watched} changed"


# ---------------------------------------------------------------- the disk and its permissions
@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[..., Path]]:
    """Mount small tmpfs file systems (root only; skipped where mounting is not allowed)."""
    mounts: list[Path] = []

    def mount(name: str, size: str = "1m", ro: bool = False) -> Path:
        point = tmp_path / name
        point.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True
        )
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
        mounts.append(point)
        if ro:
            subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        return point

    yield mount
    for point in reversed(mounts):
        subprocess.run(["umount", "-l", str(point)], check=False)


def _fill(point: Path) -> None:
    with open(point / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass


def test_disk_full_is_one_line_and_leaves_no_run(ctx: Ctx, tmpfs, capsys) -> None:
    disk = tmpfs("disk", size="256k")
    _fill(disk)
    code = main(["train", str(ctx.cfg), "--out", str(disk / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0] and "free space" in err[0], err
    assert not (disk / "run").exists()


def test_a_disk_that_fills_mid_write_is_named(tmpfs, capsys) -> None:
    """A write that fills the disk raises an OSError naming no file: the line said only 'No space left on
    device', not where. The atomic writers name what they were writing."""
    from recscale.io import atomic_dir, atomic_write_bytes

    disk = tmpfs("disk", size="64k")
    with pytest.raises(OSError, match="No space left") as e:
        atomic_write_bytes(disk / "big.bin", b"\0" * (256 << 10))
    assert e.value.filename == str(disk / "big.bin")
    with pytest.raises(OSError, match="No space left") as e:
        with atomic_dir(disk / "split") as tmp:
            (tmp / "values.bin").write_bytes(b"\0" * (256 << 10))
    assert e.value.filename == str(disk / "split")
    assert sorted(disk.iterdir()) == []  # nothing half-written left
    from recscale.train.state import RunLog

    log = RunLog(disk, main=True)
    with pytest.raises(OSError, match="No space left") as e:
        log({"split": "train", "step": 1, "note": "x" * (256 << 10)})
    assert e.value.filename == str(disk / "metrics.jsonl")
    log.close()
    shutil.rmtree(disk / "tb")
    (disk / "metrics.jsonl").unlink()
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    rows = "data.synthetic.rows={train: 20000, valid: 100}"
    assert main(["train", str(demo), "--out", str(disk / "run"), rows, "train.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{disk / 'run' / 'data' / 'train'}: No space left on device" in err[0], err


def test_an_output_that_is_a_device_pipe_or_process_file_is_refused(tmp_path) -> None:
    """`predict --out /dev/null` (or /dev/full, /dev/stdout, a FIFO) said it had written the file: the rename
    that ends an atomic write replaced the name itself with a regular file, as root /dev/null and /dev/stdout
    of the whole machine. Such an output is refused, before the work and again by the writer; a device node
    made here stands for /dev/null (never written in a test)."""
    from recscale.errors import RecscaleError
    from recscale.io import atomic_dir, atomic_write_bytes, check_output

    fifo, stdout, fd = tmp_path / "fifo", tmp_path / "stdout", tmp_path / "fd"
    os.mkfifo(fifo)
    stdout.symlink_to("/proc/self/fd/1")  # as /dev/stdout: right whatever stdout is, a file included
    fd.symlink_to("/dev/fd/1")
    outs = [fifo, stdout, fd, Path("/proc/self/fd/1")]
    if subprocess.run(["mknod", str(tmp_path / "null"), "c", "1", "3"], capture_output=True).returncode == 0:
        outs.append(tmp_path / "null")
    for out in outs:
        before = os.readlink(out) if out.is_symlink() else None
        with pytest.raises(RecscaleError, match=r" is not a regular file \(a device, a pipe"):
            check_output(out, "--out", [])
        with pytest.raises(RecscaleError, match=r" is not a regular file \(a device, a pipe"):
            atomic_write_bytes(out, b"scores")
        if out.parent == tmp_path:
            with pytest.raises(RecscaleError, match=r" is not a regular file \(a device, a pipe"):
                with atomic_dir(out):
                    pass
            assert os.readlink(out) == before if before is not None else not out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in outs if p.parent == tmp_path)
    link = tmp_path / "link"  # a link to a file of the user's is replaced, as before
    link.symlink_to(tmp_path / "real")
    check_output(link, "--out", [])
    atomic_write_bytes(link, b"scores")
    assert link.read_bytes() == b"scores"


def test_scratch_dirs_of_killed_commands_are_removed_by_the_next(tmp_path, monkeypatch) -> None:
    """eval, predict, shard plan and precision probe copy the file they read into a temporary directory, as
    large as the file: a command killed by SIGKILL (the OOM killer) left it in /tmp for good. The next one
    removes those no live process holds, and leaves the held and the just-made alone."""
    import fcntl
    import tempfile
    import time

    from recscale.io import ABANDONED_AFTER_S, scratch_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = time.time() - 2 * ABANDONED_AFTER_S
    killed, held, young = (Path(tempfile.mkdtemp(prefix="recscale-predict-")) for _ in range(3))
    other = Path(tempfile.mkdtemp(prefix="recscale-eval-"))  # another command's: not this one's to judge
    for d in (killed, held, other):
        (d / "split").mkdir()
        os.utime(d, (old, old))
    lock = os.open(held, os.O_RDONLY | os.O_DIRECTORY)  # as a live command's scratch_dir holds it
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with scratch_dir("recscale-predict-") as tmp:
            assert tmp.is_dir() and tmp.parent == tmp_path
            assert not killed.exists() and held.exists() and young.exists() and other.exists()
        assert not tmp.exists()
    finally:
        os.close(lock)


def test_a_full_temporary_directory_is_one_line_naming_tmpdir(ctx: Ctx, tmpfs, monkeypatch, capsys) -> None:
    """eval and predict copy the file they score into a temporary directory: a full TMPDIR said 'free space or
    choose another --out', which eval has not. The line says what the directory is for and names TMPDIR."""
    import tempfile

    scratch = tmpfs("scratch", size="64k")
    _fill(scratch)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for argv in (["eval", str(ctx.run), "--data", str(ctx.good)],
                 ["predict", str(ctx.run), "--data", str(ctx.good), "--out", str(ctx.tmp / "scores.csv")]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "No space left on device" in err[0] and "--out" not in err[0], err
        assert f"a temporary directory in {scratch} first" in err[0] and "set TMPDIR" in err[0], err
    assert sorted(p.name for p in scratch.iterdir()) == ["filler"]
    assert not (ctx.tmp / "scores.csv").exists()


def test_workers_on_a_small_dev_shm_are_refused_not_hung(tmp_path) -> None:
    """DataLoader workers hand batches over in /dev/shm: on a container's small one a batch that did not fit was
    dropped (a traceback from the worker's feeder thread) and training waited for it forever. Refused with one
    line (root only: a 1 MiB /dev/shm of the command's own, in a mount namespace)."""
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    argv = ["train", str(demo), "--out", str(tmp_path / "r"), "data.num_workers=1", "train.batch_size=4096",
            "data.synthetic.rows={train: 40000, valid: 256}", "data.synthetic.num_sparse=4", "data.synthetic.num_multi=1",
            "model.embedding.dim=8", "model.num_layers=1", "train.max_steps=10"]  # fmt: skip
    # 1 MiB: the 4096-row batches take ~0.4 MiB each, so the ~6 in flight need ~2.3 MiB, far over it.
    script = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {shlex.join([sys.executable, '-m', 'recscale.cli', *argv])}"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", "/dev/shm"],
                           capture_output=True)  # fmt: skip
    if probe.returncode:
        pytest.skip(f"cannot mount a /dev/shm of its own here ({probe.stderr.decode().strip()})")
    try:
        done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("training with a worker on a 1 MiB /dev/shm hung")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert "in shared memory, /dev/shm" in err[0] and "--shm-size" in err[0], err


def test_a_full_disk_under_tensorboard_is_one_line_naming_tb(tmp_path, tmpfs, capfd) -> None:
    """TensorBoard writes from a thread of its own: a disk that filled under tb/ printed that thread's
    traceback, then a line naming no file. The line names tb/ now, and the thread's traceback is not printed."""
    from recscale.train.state import RunLog

    run = tmp_path / "run"
    tb = tmpfs("tb", size="64k")
    run.mkdir()
    (run / "tb").symlink_to(tb)
    log = RunLog(run, main=True)
    with open(tb / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError:
                break
    with pytest.raises(OSError, match="No space left") as e:
        for step in range(1, 200):
            log({"split": "train", "step": step, "loss": 0.5, "lr": 0.1})
        log.close()
    assert e.value.filename == str(run / "tb")
    with pytest.raises(OSError, match="No space left") as e:  # full before the writer starts
        RunLog(run, main=True)
    assert e.value.filename == str(run / "tb")
    assert "Traceback" not in capfd.readouterr().err


def test_read_only_out_is_one_line(ctx: Ctx, tmpfs, capsys) -> None:
    ro = tmpfs("ro", ro=True)
    code = main(["train", str(ctx.cfg), "--out", str(ro / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Read-only file system" in err[0] and "writable" in err[0], err


def test_resume_may_extend_a_run_and_says_where_it_resumed(ctx: Ctx, capsys) -> None:
    assert main(["train", "--resume", "--out", str(ctx.run), "train.max_steps=4"]) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "step_00000002" in err and "(step 2," in err
    assert "max_steps: 4" in (ctx.run / "config.yaml").read_text()


def test_a_stale_preprocess_json_is_refitted(ctx: Ctx) -> None:
    """A failed run's preprocess.json, fitted on other data, is not reused by the next run in that directory."""
    out = ctx.tmp / "r"
    other = ctx.csv("other.csv", "\n".join([HEADER, *[r.replace(",", ",9", 1) for r in ROWS]]) + "\n")
    assert main(["train", str(ctx.cfg), "--out", str(out), f"data.train={other}", "train.max_steps=1"]) == 0
    (out / "report.json").unlink()
    shutil.rmtree(out / "ckpt")  # now it looks like a run that failed after preparing its data
    stale = (out / "preprocess.json").read_text()
    assert main(["train", str(ctx.cfg), "--out", str(out), "train.max_steps=1"]) == 0
    assert (out / "preprocess.json").read_text() != stale


def test_long_cells_are_read(ctx: Ctx) -> None:
    """A 5 MB cell is longer than pyarrow's default read block; it is one id like any other."""
    path = ctx.csv(
        "long.csv", "\n".join([HEADER, "1," + "a" * 5_000_000 + ",1,1,1,1,1,1,1,1,1", *ROWS]) + "\n"
    )
    assert (
        main(["train", str(ctx.cfg), "--out", str(ctx.tmp / "r"), f"data.train={path}", "train.max_steps=1"])
        == 0
    )


def test_run_files_have_normal_permissions(ctx: Ctx) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.yaml", "preprocess.json", "report.json"):
        assert (ctx.run / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert (ctx.run / "best").stat().st_mode & 0o777 == 0o777 & ~umask


def test_the_umask_is_read_without_setting_it(monkeypatch) -> None:
    """Reading the umask by setting it (os.umask(0), then back) left, for that instant, a file another thread
    created writable by everyone; Linux shows it in /proc/self/status."""
    from recscale import io as rio

    real = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("os.umask called"))
        assert rio._umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(real)
