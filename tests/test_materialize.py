"""distributed.materialize: shards — each rank allocates only its own table shards.

The multi-process test caps every process's address space (RLIMIT_AS, inherited by the ranks) below what
the whole set of tables needs, so it fails if any rank builds a full table.
"""

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from recscale.config import validate_config
from recscale.models.embedding import FeatureSet, SparseInput
from recscale.train.build import flat_model

FEATURES = FeatureSet(sparse=(SparseInput("a", 1000), SparseInput("b", 50, "mean")), num_dense=3)


def _cfg(materialize: str) -> dict:
    return {
        "data": {"format": "synthetic"},
        "model": {"name": "wukong", "num_layers": 1, "embedding": {"dim": 8, "qr_buckets": {"a": 10}}},
        "distributed": {"materialize": materialize},
    }


def test_shards_leave_tables_on_meta_and_build_the_dense_part_alike() -> None:
    a, b = (flat_model(validate_config(_cfg("shards")), FEATURES) for _ in range(2))
    tables = dict(a.embedding.ebc.named_parameters())
    assert tables and all(t.is_meta for t in tables.values())
    dense = {k: v for k, v in a.state_dict().items() if not k.startswith("embedding.ebc.")}
    assert dense and not any(v.is_meta for v in dense.values())
    for key, value in b.state_dict().items():  # every rank builds the same dense part
        if key in dense:
            assert torch.equal(value, dense[key]), key
    buffers = dict(a.named_buffers())  # non-persistent buffers (the QR positions) are filled in too
    assert buffers["embedding._qr_quotient"].tolist() == [0]
    full = flat_model(validate_config(_cfg("full")), FEATURES)
    assert not any(p.is_meta for p in full.parameters())


# 4 tables of 6M rows x 32 floats: 3 GiB in all, 768 MiB per rank on 4 ranks. A rank of this stack
# reserves about 2.3 GiB of address space before any table (1 GiB of it pyarrow's mimalloc arena, reserved
# but untouched). Measured VmPeak per rank (torch 2.13, 2 cores): 3.1 GiB training, 3.7-3.8 GiB resuming
# (DCP reads each saved shard whole before copying it in: 768 MiB more), and the resume passes down to a
# 3.63 GiB cap; a rank that builds all tables needs 2.3 + 3 GiB. So under a 4.75 GiB cap the 4-rank job
# fits, with about 1 GiB to spare, only if no rank ever holds more than its own shards.
ROWS, CAP = 6_000_000, int(4.75 * 2**30)


def _capped(*args: str) -> subprocess.CompletedProcess:
    """``recscale ARGS`` under the address-space cap (inherited by the ranks it launches)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    cmd = [sys.executable, "-m", "recscale.cli", *args]
    return subprocess.run(cmd, preexec_fn=cap, capture_output=True, text=True, timeout=600)


def _run(tmp: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    return _capped("train", str(tmp / "cfg.yaml"), "--out", str(tmp / name), *args)


@pytest.mark.dist
@pytest.mark.slow
def test_tables_larger_than_a_process_train_on_four_ranks(tmp_path: Path) -> None:
    data = tmp_path / "data.csv"
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10**9, (256, 4), generator=gen)
    data.write_text("label,a,b,c,d\n" + "".join(f"{i % 3 == 0:d},{','.join(map(str, r.tolist()))}\n" for i, r in enumerate(ids)))  # fmt: skip
    cfg = {
        "data": {"format": "csv", "train": str(data), "valid": str(data), "num_workers": 0,
                 "schema": {"label": "label", "sparse": [{"name": f, "hash_buckets": ROWS} for f in "abcd"]}},
        "model": {"name": "dlrm", "embedding": {"dim": 32}, "top_mlp": [16]},
        "train": {"batch_size": 64, "max_steps": 2, "progress": False, "eval_every": None, "early_stopping": None},
        "distributed": {"materialize": "shards"},
    }  # fmt: skip
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))

    ok = _run(tmp_path, "shards4", "--nproc", "4")
    assert ok.returncode == 0, ok.stderr[-3000:]
    resumed = _run(tmp_path, "shards4", "--nproc", "4", "--resume", "train.max_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # the checkpoint loads into the shards

    # Scoring it: one process would hold every table; 4 ranks each load their share of the checkpoint.
    scores = tmp_path / "scores.csv"
    scored = _capped(
        "eval", str(tmp_path / "shards4"), "--data", str(data), "--nproc", "4", "--predictions", str(scores)
    )
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert (
        json.loads(scored.stdout.strip().splitlines()[-1])["rows"]
        == 256
        == len(scores.read_text().splitlines()) - 1
    )
    alone = _capped("eval", str(tmp_path / "shards4"), "--data", str(data))
    lines = [x for x in alone.stderr.splitlines() if x.startswith("error:")]
    assert alone.returncode == 2 and len(lines) == 1, alone.stderr[-3000:]
    assert "3,072,000,512 bytes in all" in lines[0] and "over 1 rank: run on more ranks (--nproc)" in lines[0]

    full = _run(tmp_path, "full4", "--nproc", "4", "distributed.materialize=full")
    assert full.returncode != 0
    assert (
        "3,072,000,512 bytes in all" in full.stderr and "set distributed.materialize: shards" in full.stderr
    )

    one = _run(tmp_path, "shards1")
    lines = [x for x in one.stderr.splitlines() if x.startswith("error:")]
    assert one.returncode == 2 and len(lines) == 1, one.stderr[-3000:]
    assert "3,072,000,512 bytes in all" in lines[0] and "over 1 rank: run on more ranks (--nproc)" in lines[0]
