"""The large-vocabulary regime against FuxiCTR: training speed and peak memory as the tables grow.

    python bench/large_vocab.py                                   # 1e4 1e5 1e6 rows per table, DLRM and Wukong
    python bench/large_vocab.py --sizes 10000 1000000 --models dlrm --ranks 1 2

Criteo-shaped synthetic data (a CSV written once to a scratch folder): a label, 13 count fields I1..I13
(Poisson, categorical with their small vocabularies, as FuxiCTR's own Criteo recipes bucketise them: its
loader stacks every column into one float64 array, which its models' fp32 layers reject as numeric input)
and 26 categorical fields C1..C26 whose ids are Zipf-distributed (numpy's ``zipf(1.1)``, an unbounded id
space). Each C table has N rows (N = 1e4 ... 1e6) whatever ids the sample holds: recscale hashes each field
into N buckets (``hash_buckets``); FuxiCTR's vocabulary is expanded to N keys (see ``fuxictr_configs``).
Both train the same model (d = 16):

- DLRM: dot interaction over the 39 embeddings, top MLP [256, 128];
- Wukong: 2 layers, n_F = n_L = k = 8, FMB MLP [64], final MLP [128].

recscale trains its tables with fbgemm's fused row-wise Adagrad (sharded table-wise over 1, 2 or 4 local
ranks), FuxiCTR with ``nn.Embedding`` and Adam (dense gradients for every row, two moments per weight):
the design difference this benchmark is about. One epoch each, batch 4096, at the machine's default thread
count; examples/s as in bench/vs_fuxictr.py (the epoch's steps after the first, loading included) and peak
resident memory of the largest process (GNU time's %M: the biggest rank, for recscale). A trainer that
fails (out of memory) or runs past ``--timeout`` is reported as such at that size, and larger sizes are
skipped for it.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from vs_fuxictr import PEER, fuxictr_rate, recscale_rate  # bench/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
DENSE, SPARSE, DIM, BATCH = 13, 26, 16, 4096
MODELS = {
    "dlrm": (
        {"name": "dlrm", "top_mlp": [256, 128], "embedding": {"dim": DIM}},
        {"model": "DLRM", "bottom_mlp_units": [], "top_mlp_units": [256, 128], "interaction_op": "dot",
         "top_mlp_activations": "ReLU", "bottom_mlp_activations": "ReLU", "top_mlp_dropout": 0,
         "bottom_mlp_dropout": 0, "batch_norm": False},
    ),
    "wukong": (
        {"name": "wukong", "num_layers": 2, "n_f": 8, "n_l": 8, "k": 8, "fmb_mlp": [64], "final_mlp": [128],
         "embedding": {"dim": DIM}},
        {"model": "WuKong", "num_wukong_layers": 2, "lcb_features": 8, "fmb_features": 8, "fmb_mlp_units": [64],
         "fmb_mlp_activations": "relu", "fmp_rank_k": 8, "mlp_hidden_units": [128],
         "mlp_hidden_activations": "relu", "mlp_batch_norm": False, "layer_norm": True, "net_dropout": 0},
    ),
}  # fmt: skip


def write_data(path: Path, rows: int, seed: int) -> None:
    """Criteo-shaped CSV: label, I1..I13 (Poisson counts), C1..C26 (Zipf ids)."""
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["label", *(f"I{i}" for i in range(1, DENSE + 1)), *(f"C{i}" for i in range(1, SPARSE + 1))]
        )
        labels = (rng.random(rows) < 0.25).astype(int)
        dense = rng.poisson(3.0, (rows, DENSE))
        ids = np.minimum(rng.zipf(1.1, (rows, SPARSE)), 2**62)
        for i in range(rows):
            w.writerow([labels[i], *dense[i], *ids[i]])


def recscale_config(model: dict, data: Path, buckets: int) -> dict:
    return {
        "seed": 0,
        "data": {
            "format": "csv", "train": str(data / "train.csv"), "valid": str(data / "valid.csv"),
            "schema": {
                "label": "label",
                "sparse": [{"name": f"I{i}"} for i in range(1, DENSE + 1)]
                + [{"name": f"C{i}", "hash_buckets": buckets} for i in range(1, SPARSE + 1)],
            },
        },
        "model": model,
        "train": {"batch_size": BATCH, "epochs": 1, "log_every": 1, "progress": False, "eval_every": None,
                  "early_stopping": None, "dense_optimizer": {"name": "adam", "lr": 0.001},
                  "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.05}},
        "distributed": {"sharding": "table_wise"},
    }  # fmt: skip


def fuxictr_configs(model: dict, data: Path, root: Path, buckets: int) -> Path:
    """FuxiCTR's configs. Its ``hash_bucket`` processor fails in this snapshot (KeyError 'oov_idx' in
    FeatureProcessor.fit), so its tables get N rows another way it offers: a "pretrained" embedding file
    whose N keys '0'..'N-1' expand each field's vocabulary, used as the trainable table's initial values
    (``pretrain_usage: init``, not frozen; values N(0, 1e-4) like its own initialiser)."""
    cfg = root / "config"
    cfg.mkdir(parents=True, exist_ok=True)
    keys = root / f"keys{buckets}.npz"
    init = np.random.default_rng(0).normal(0, 1e-4, (buckets, DIM)).astype(np.float32)
    np.savez(keys, key=np.arange(buckets).astype(str), value=init)
    sparse = {"name": [f"C{i}" for i in range(1, SPARSE + 1)], "active": True, "dtype": "str",
              "type": "categorical", "pretrained_emb": str(keys), "pretrain_dim": DIM, "pretrain_usage": "init",
              "freeze_emb": False}  # fmt: skip
    counts = {
        "name": [f"I{i}" for i in range(1, DENSE + 1)],
        "active": True,
        "dtype": "str",
        "type": "categorical",
    }
    dataset = {
        "large_vocab": {
            "data_root": str(root / "data"),
            "data_format": "csv",
            "train_data": str(data / "train.csv"),
            "valid_data": str(data / "valid.csv"),
            "test_data": str(data / "valid.csv"),
            "min_categr_count": 1,
            "feature_cols": [counts, sparse],
            "label_col": {"name": "label", "dtype": "float"},
        }
    }
    base = {
        "model_root": str(root / "checkpoints"),
        "num_workers": 3,
        "verbose": 1,
        "early_stop_patience": 2,
        "pickle_feature_encoder": True,
        "save_best_only": True,
        "eval_steps": None,
        "debug_mode": False,
        "group_id": None,
        "use_features": None,
        "feature_specs": None,
        "feature_config": None,
    }
    exp = {**model, "dataset_id": "large_vocab", "loss": "binary_crossentropy", "metrics": ["logloss", "AUC"],
           "task": "binary_classification", "optimizer": "adam", "learning_rate": 1e-3, "embedding_regularizer": 0,
           "net_regularizer": 0, "batch_size": BATCH, "embedding_dim": DIM, "epochs": 1, "shuffle": True,
           "seed": 2024, "monitor": "AUC", "monitor_mode": "max"}  # fmt: skip
    (cfg / "dataset_config.yaml").write_text(yaml.safe_dump(dataset))
    (cfg / "model_config.yaml").write_text(yaml.safe_dump({"Base": base, "large_vocab_exp": exp}))
    return cfg


def timed(cmd: list[str], timeout: float, cwd: Path) -> tuple[str, float | None, str]:
    """(status, peak resident MiB of the largest process, output) of ``cmd`` under GNU time."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        try:
            p = subprocess.run(
                ["/usr/bin/time", "-f", "%M", "-o", t.name, *cmd], cwd=cwd, text=True, timeout=timeout,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            return f"over {timeout:.0f} s", None, str(e.stdout or "")
        lines = [x for x in t.read().split() if x.isdigit()]
        peak = int(lines[-1]) / 1024 if lines else None
        status = "ok" if p.returncode == 0 else ("killed (out of memory?)" if p.returncode < 0 or p.returncode == 137 else f"exit {p.returncode}")  # fmt: skip
        return status, peak, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rows", type=int, default=131_072, help="training rows (valid: 1/8 of it)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per training run")
    ap.add_argument("--fuxictr-venv", default="/tmp/fuxictr-venv")
    args = ap.parse_args()
    if args.rows < 2 * BATCH:  # examples/s is taken over the epoch's steps after the first
        ap.error(f"--rows must be at least {2 * BATCH} (two steps of {BATCH}): the rate skips the first step")
    venv = Path(args.fuxictr_venv)
    if not (venv / "bin" / "python").exists():
        subprocess.run(["bash", str(PEER / "setup.sh"), str(venv)], check=True)
    exe = str(Path(sys.executable).with_name("recscale"))
    rows: list[tuple[str, int, str, str, float | None, float | None]] = []
    with tempfile.TemporaryDirectory(prefix="recscale-large-vocab-") as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        write_data(data / "train.csv", args.rows, seed=0)
        write_data(data / "valid.csv", args.rows // 8, seed=1)
        for name in args.models:
            ours, theirs = MODELS[name]
            failed: set[str] = set()
            for n in args.sizes:
                trainers = [(f"recscale {r} rank{'s' * (r > 1)}", r) for r in args.ranks] + [("FuxiCTR", 0)]
                for trainer, ranks in trainers:
                    if trainer in failed:
                        rows.append((name, n, trainer, "skipped (failed at a smaller size)", None, None))
                        continue
                    out = Path(tmp) / f"{name}-{n}-{ranks}"
                    start = time.perf_counter()
                    if ranks:
                        cfg = out.with_suffix(".yaml")
                        cfg.write_text(yaml.safe_dump(recscale_config(ours, data, n)))
                        cmd = [
                            exe,
                            "train",
                            str(cfg),
                            "--out",
                            str(out),
                            *(["--nproc", str(ranks)] * (ranks > 1)),
                        ]
                        status, peak, log = timed(cmd, args.timeout, REPO)
                        rate = recscale_rate(out, epoch=0) if status == "ok" else None
                    else:
                        cfg = fuxictr_configs(theirs, data, out, n)
                        cmd = ["bash", str(PEER / "run.sh"), str(venv), str(cfg), "large_vocab_exp"]
                        status, peak, log = timed(cmd, args.timeout, REPO)
                        rate = fuxictr_rate(log, epoch=1) if status == "ok" else None
                    if status != "ok":
                        failed.add(trainer)
                        print(log[-1500:], file=sys.stderr)
                    rows.append((name, n, trainer, status, rate, peak))
                    print(f"{name} {n:>9,} {trainer:<17} {status:<8} "
                          f"{'' if rate is None else f'{rate:9,.0f} ex/s'} "
                          f"{'' if peak is None else f'{peak:8,.0f} MiB'} ({time.perf_counter() - start:.0f} s)",
                          flush=True)  # fmt: skip
    print(
        "\n| model | rows per table | trainer | examples/s | vs FuxiCTR | peak RSS MiB (largest process) | status |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, n, trainer, status, rate, peak in rows:
        peer = next((r[4] for r in rows if r[:2] == (name, n) and r[2] == "FuxiCTR"), None)
        ratio = f"{rate / peer:.2f}x" if rate and peer else ""
        print(f"| {name} | {n:,} | {trainer} | {'' if rate is None else f'{rate:,.0f}'} | {ratio} | "
              f"{'' if peak is None else f'{peak:,.0f}'} | {status} |")  # fmt: skip


if __name__ == "__main__":
    main()
