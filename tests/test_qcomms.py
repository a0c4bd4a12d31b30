"""Quantized collectives (``distributed.qcomms``): fewer bytes on the wire, nearly the same training.

Two ranks, table-wise tables, single-id features: the all-to-alls carry ids (not quantized) and the
pooled embeddings and their gradients (quantized); DDP's all-reduce carries the dense gradients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recscale.config import load_config
from recscale.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
JOB = [
    "data.synthetic.rows={train: 2048, valid: 256, test: 256}", "data.synthetic.num_sparse=4",
    "data.synthetic.num_multi=0", "data.synthetic.vocab_sizes=64", "data.num_workers=0",
    "model.embedding.dim=32", "model.num_layers=1", "model.dropout=0", "train.batch_size=128",
    "train.max_steps=6", "train.log_every=3", "train.progress=false", "train.early_stopping=null",
    "distributed.sharding=table_wise", "distributed.count_bytes=true",
]  # fmt: skip


def _job(tmp: Path, name: str, *qcomms: str) -> list[dict]:
    out = tmp / name
    cmd = [sys.executable, "-m", "recscale.cli", "train", str(CONFIGS / "demo.yaml"), *JOB, *qcomms,
           "--out", str(out), "--nproc", "2"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [rec for rec in map(json.loads, lines) if rec["split"] == "train"]


@pytest.mark.dist
def test_quantized_all_to_all_and_all_reduce_send_fewer_bytes_and_train_alike(tmp_path):
    full = _job(tmp_path, "fp32")
    low = _job(tmp_path, "low", "distributed.qcomms={forward: int8, backward: fp16, dense: fp16}")

    def sent(recs: list[dict], kind: str) -> int:
        return sum(r["comm"][kind]["intra"] for r in recs)

    # DDP's gradient buffers in fp16: exactly half the bytes.
    assert sent(low, "all_reduce") * 2 == sent(full, "all_reduce")
    # Pooled embeddings in int8 (with per-row scale and bias) and their gradients in fp16, ids as they
    # were: the all-to-alls carry well under 2/3 of the fp32 bytes.
    assert sent(low, "all_to_all") < 0.6 * sent(full, "all_to_all")
    # The training is nearly the same: the losses follow the fp32 run's.
    assert [r["step"] for r in low] == [r["step"] for r in full]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(low, full, strict=True)) < 5e-3


def test_fp8_on_cpu_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="fp8 has no CPU codec"):
        load_config(CONFIGS / "demo.yaml", ["distributed.qcomms.forward=fp8"])
