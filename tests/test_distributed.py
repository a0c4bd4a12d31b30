"""Multi-process training: parity with one process, resharded checkpoints, byte accounting (faults:
tests/test_faults.py).

The multi-process runs are launched once per world size (module fixtures); each launch trains every
sharding type in turn. Run as a script, this file is the workers' program (see ``_worker``).
"""

import json
import logging
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import pytest
import torch

from recscale.cli import main
from recscale.config import DistributedConfig, load_config, validate_config
from recscale.distributed.env import DistEnv, exit_rank, init_distributed, lost_peer, record_error, shutdown
from recscale.distributed.launch import launch
from recscale.distributed.sharding import plan_tables
from recscale.distributed.topology import Topology
from recscale.errors import ConfigError, RecscaleError
from recscale.models.embedding import EmbeddingConfig, FeatureSet, SparseInput
from recscale.models.registry import build_model
from recscale.train.checkpoint import list_checkpoints
from recscale.train.evaluate import predict
from recscale.train.loop import Trainer
from recscale.train.runs import eval_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REPO = CONFIGS.parent
SMALL = [
    "data.synthetic.rows.train=2048",
    "data.synthetic.rows.valid=256",
    "data.synthetic.rows.test=256",
    "data.synthetic.num_sparse=4",
    "data.synthetic.num_multi=1",
    "data.synthetic.vocab_sizes=64",
    "data.num_workers=0",
    "model.embedding.dim=8",
    "model.num_layers=1",
    "model.dropout=0",
    "train.batch_size=64",
    "train.max_steps=5",
    "train.log_every=1",
    "train.progress=false",
    "train.early_stopping=null",
]
TYPES = ["data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"]
# Row-wise Adagrad keeps one accumulator per row of each *column shard*, so column sharding changes
# its updates (by design, in fbgemm); element-wise Adagrad is the same however columns are split.
ADAGRAD = ["train.sparse_optimizer.name=adagrad"]
VARIANTS = {t: [f"distributed.sharding={t}", *(ADAGRAD if "column" in t else [])] for t in TYPES} | {
    "fsdp": ["distributed.sharding=row_wise", "distributed.dense=fsdp"],
    "planner": ["distributed.sharding=planner", *ADAGRAD],
    "learned": ["distributed.sharding=learned", *ADAGRAD],  # it may split tables column-wise
}
# Single-id features only, each table on a known rank: all-to-all volumes follow from the batch.
COMM = ["data.synthetic.num_multi=0", "distributed.sharding=table_wise", "distributed.count_bytes=true",
        *(f"distributed.tables.s{i}={{type: table_wise, ranks: [{r}]}}" for i, r in enumerate([0, 1, 2, 2]))]  # fmt: skip
# The same data with every table row-wise over the ranks of one host (hosts alternate by table).
COMM_TWRW = [
    "data.synthetic.num_multi=0",
    "distributed.sharding=table_row_wise",
    "distributed.count_bytes=true",
]
# Two ranks, table-wise, single-id features: what tests/test_qcomms.py compares with and without qcomms.
QCOMMS = ["data.synthetic.num_multi=0", "model.embedding.dim=32", "train.batch_size=128", "train.max_steps=6",
          "train.log_every=3", "distributed.sharding=table_wise", "distributed.count_bytes=true"]  # fmt: skip
QCOMMS_LOW = "distributed.qcomms={forward: int8, backward: fp16, dense: fp16}"
# FSDP2 with and without its bf16 mixed-precision policy (train.precision=bf16).
FSDP = ["distributed.sharding=row_wise", "distributed.dense=fsdp", "distributed.count_bytes=true"]
dist_mark = pytest.mark.dist


def train_records(run_dir: Path) -> list[dict]:
    return [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "train"
    ]


def _sent(records: list[dict], kind: str) -> int:
    """Bytes of one collective kind this run's rank 0 sent within its host, over the logged windows."""
    return sum(r["comm"][kind]["intra"] for r in records)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(run_dir)}


# ---------------------------------------------------------------- worker side
def _worker(spec_path: str) -> None:
    """Each job of the spec in turn: train a run, or resume one and score its test split. A job's error
    is left to the launcher (``record_error``), whose line then names it rather than what followed."""
    logging.disable(logging.WARNING)  # TorchRec's planner and sharders warn on every run
    init_distributed()  # the group outlasts each Trainer's fit, which would end a group it started itself
    try:
        for job in json.loads(Path(spec_path).read_text()):
            try:
                cfg = load_config(CONFIGS / "demo.yaml", [*SMALL, *job["overrides"]])
                trainer = Trainer(cfg, Path(job["dir"]), resume=job["resume"])
                if not job["resume"]:
                    trainer.fit()
                scores = predict(trainer.module, trainer.test_ds, 100, 0)
            except Exception as e:
                line = " ".join(f"{Path(job['dir']).name}: {type(e).__name__}: {e}".split())
                record_error(line[:400], consequence=lost_peer(e) is not None)
                raise
            if trainer.main:
                np.save(job["scores"], scores.numpy())
    finally:
        shutdown()  # gloo's threads joined now: left to exit-time destructors they can abort the process


def _jobs(root: Path, world: int) -> list[dict]:
    """Train every variant at this world size, then resume the 4-rank runs and score them."""
    jobs = [{"dir": str(root / f"{name}_{world}"), "overrides": o, "resume": False,
             "scores": str(root / f"{name}_{world}.npy")} for name, o in VARIANTS.items()]  # fmt: skip
    if world == 4:
        jobs += [{"dir": str(root / name), "overrides": o, "resume": False, "scores": str(root / f"{name}.npy")}
                 for name, o in (("comm_4", COMM), ("comm_twrw_4", COMM_TWRW))]  # fmt: skip
    else:
        jobs += [{"dir": str(root / f"{name}_4"), "overrides": o, "resume": True,
                  "scores": str(root / f"{name}_4_at_{world}.npy")} for name, o in VARIANTS.items()]  # fmt: skip
    if world == 2:  # the quantized collectives (test_qcomms.py), in this launch to save one
        jobs += [{"dir": str(root / name), "overrides": o, "resume": False, "scores": str(root / f"{name}.npy")}
                 for name, o in (("qcomms_fp32", QCOMMS), ("qcomms_low", [*QCOMMS, QCOMMS_LOW]),
                                 ("qcomms_fp8", [*QCOMMS, "distributed.qcomms={forward: fp8, backward: fp8, dense: bf16}"]),
                                 ("qcomms_mxint8", [*QCOMMS, "distributed.qcomms={forward: mxint8, backward: mxint8}"]),
                                 ("fsdp_fp32", FSDP), ("fsdp_bf16", [*FSDP, "train.precision=bf16"]),
                                 ("ddp_bf16", [*VARIANTS["table_wise"], "train.precision=bf16"]))]  # fmt: skip
    return jobs


def _run_world(root: Path, world: int, local: int) -> None:
    spec = root / f"spec_{world}.json"
    spec.write_text(json.dumps(_jobs(root, world)))
    launch([__file__, "worker", str(spec)], world, local, 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """4 ranks as 2 hosts x 2, then 2 ranks on one host, then the single-process reference."""
    root = tmp_path_factory.mktemp("dist")
    _run_world(root, 4, 2)
    _run_world(root, 2, 2)
    references = [{"dir": str(root / name), "overrides": o, "resume": False, "scores": str(root / f"{name}.npy")}
                  for name, o in (("reference", []), ("reference_adagrad", ADAGRAD))]  # fmt: skip
    init_distributed()  # a group of one that outlasts each fit: predict below runs collectives
    for job in references + _jobs(root, 1)[len(VARIANTS) : 2 * len(VARIANTS)]:
        cfg = load_config(CONFIGS / "demo.yaml", [*SMALL, *job["overrides"]])
        trainer = Trainer(cfg, Path(job["dir"]), resume=job["resume"])
        if not job["resume"]:
            trainer.fit()
        np.save(job["scores"], predict(trainer.module, trainer.test_ds, 100, 0).numpy())
    shutdown()
    return root


# ---------------------------------------------------------------- tests
@dist_mark
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_one_process(runs, variant, world):
    """N ranks with global batch G train step by step like one process with batch G."""
    ref = losses(runs / ("reference_adagrad" if ADAGRAD[0] in VARIANTS[variant] else "reference"))
    got = losses(runs / f"{variant}_{world}")
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, got[step], ref[step])
    # The losses move: parity is not two untrained models agreeing.
    assert ref[5] < ref[1] - 0.05


@dist_mark
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_from_4_ranks_resumes_at_2_and_1(runs, variant):
    at4 = np.load(runs / f"{variant}_4.npy")
    for world in (2, 1):
        np.testing.assert_allclose(np.load(runs / f"{variant}_4_at_{world}.npy"), at4, rtol=0, atol=1e-5)
    ref = "reference_adagrad" if ADAGRAD[0] in VARIANTS[variant] else "reference"
    assert np.abs(at4 - np.load(runs / f"{ref}.npy")).max() < 1e-3  # and they are the trained model's
    # Every rank's data files are in the checksum list rank 0 wrote (resuming checked each one read).
    for ckpt in list_checkpoints(runs / f"{variant}_4" / "ckpt"):
        listed = {
            n for n in json.loads((ckpt / "sha256.json").read_text())["sha256"] if n.endswith(".distcp")
        }
        assert listed == {p.name for p in ckpt.glob("*.distcp")} and len(listed) > 1, ckpt


@dist_mark
def test_single_process_eval_scores_a_4_rank_run_like_its_report(runs):
    """The 4 ranks' sharded evaluation agrees with one process scoring the same checkpoint, though
    the run's explicit plan names ranks 1 and 2."""
    report = json.loads((runs / "comm_4" / "report.json").read_text())
    m = eval_run(runs / "comm_4", None, split="test")  # synthetic: its own test split
    assert m["rows"] == report["test"]["rows"] == 256
    assert m["auc"] == pytest.approx(report["test"]["auc"], abs=1e-6)
    assert m["logloss"] == pytest.approx(report["test"]["logloss"], rel=1e-5)


@dist_mark
def test_eval_on_two_ranks_scores_a_4_rank_run_like_its_report(runs, capfd):
    """`recscale eval --nproc 2`: the ranks share the tables (each loads its shards of the checkpoint) and
    rank 0 prints the one JSON line, with the scores of the run's own evaluation."""
    report = json.loads((runs / "comm_4" / "report.json").read_text())
    scores = runs / "comm_4_scores.csv"
    assert main(["eval", str(runs / "comm_4"), "--nproc", "2", "--predictions", str(scores)]) == 0
    out = [line for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    assert len(out) == 1
    m = json.loads(out[0])
    assert m["rows"] == report["test"]["rows"] == 256 == len(scores.read_text().splitlines()) - 1
    assert m["auc"] == pytest.approx(report["test"]["auc"], abs=1e-6)
    assert m["logloss"] == pytest.approx(report["test"]["logloss"], rel=1e-5)
    # predict: the same scores, without labels (a synthetic run: its own test split, no file positions)
    predicted = runs / "comm_4_predicted.csv"
    assert main(["predict", str(runs / "comm_4"), "--out", str(predicted), "--nproc", "2"]) == 0
    assert capfd.readouterr().out.strip().endswith(f"scored 256 rows: {predicted}")
    got, want = (pacsv.read_csv(f) for f in (predicted, scores))
    assert got.column_names == ["score"] and got["score"].to_pylist() == want["score"].to_pylist()


@dist_mark
def test_comm_bytes_match_hand_computed_volumes(runs):
    """Table-wise all-to-all and DDP all-reduce volumes, 4 ranks as 2 hosts x 2 (ranks 0,1 | 2,3)."""
    rec = [json.loads(line) for line in (runs / "comm_4" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rec if r["split"] == "train"]
    report = json.loads((runs / "comm_4" / "report.json").read_text())
    b, d, world = 64 // 4, 8, 4
    owner = {"s0": 0, "s1": 1, "s2": 2, "s3": 2}
    host = [0, 0, 1, 1]
    a2a = {"intra": 0, "inter": 0}
    for o in owner.values():
        for r in range(world):
            if r != o:
                where = "intra" if host[r] == host[o] else "inter"
                # ids to the owner: lengths and values (both int32), one id per row;
                # pooled embeddings back (float32), their gradients to the owner again.
                a2a[where] += b * 4 + b * 4 + 2 * b * d * 4
    for r in range(world):  # before the ids, every rank tells every other its split sizes and
        for s in range(world):  # batch size: 3 int64 (TorchRec's KJTAllToAll)
            if r != s:
                a2a["intra" if host[r] == host[s] else "inter"] += 3 * 8
    n = report["parameters"]["dense"] * 4
    ring = (
        2 * (world - 1) / world * n
    )  # each rank to its successor: 0>1 intra, 1>2 inter, 2>3 intra, 3>0 inter
    for r in train:
        assert r["comm"]["all_to_all"] == a2a
        assert r["comm"]["all_reduce"] == {"intra": round(2 * ring), "inter": round(2 * ring)}
        assert r["comm_inter_bytes"] == r["comm"]["all_to_all"]["inter"] + r["comm"]["all_reduce"]["inter"]


@dist_mark
def test_table_row_wise_inter_host_bytes_match_closed_form(runs):
    """table_row_wise on 2 hosts x 2: table_wise's inter-host volume plus each sample's lengths to the
    second rank holding the table's rows (dmt.volumes, also checked by bench/dmt.py at scale)."""
    from recscale.distributed.dmt.volumes import table_wise_embedding_inter

    topo = Topology(4, 2)
    owners = {i: topo.ranks_of_host(i % 2)[0] for i in range(4)}
    expected = table_wise_embedding_inter(topo, 64 // 4, owners, 8, row_shards=2)
    assert expected - table_wise_embedding_inter(topo, 64 // 4, owners, 8) == 4 * 2 * 16 * 4
    rec = [json.loads(line) for line in (runs / "comm_twrw_4" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rec if r["split"] == "train"]
    assert len(train) == 5
    for r in train:
        assert r["comm"]["all_to_all"]["inter"] == round(expected)


@dist_mark
def test_quantized_all_to_all_and_all_reduce_send_fewer_bytes_and_train_alike(runs):
    """Two ranks, table-wise, single-id features: the all-to-alls carry ids (not quantized) and the pooled
    embeddings and their gradients (quantized); DDP's all-reduce carries the dense gradients."""
    full, low, fp8, mx = (train_records(runs / name)
                          for name in ("qcomms_fp32", "qcomms_low", "qcomms_fp8", "qcomms_mxint8"))  # fmt: skip

    # DDP's gradient buffers in fp16: exactly half the bytes.
    assert _sent(low, "all_reduce") * 2 == _sent(full, "all_reduce")
    # Pooled embeddings in int8 (with per-row scale and bias) and their gradients in fp16, ids as they
    # were: the all-to-alls carry well under 2/3 of the fp32 bytes.
    assert _sent(low, "all_to_all") < 0.6 * _sent(full, "all_to_all")
    # The training is nearly the same: the losses follow the fp32 run's.
    # recscale's row-wise FP8 both ways: 40 bytes per 32 values (as int8's layout), so fewer bytes than
    # int8 forward + fp16 backward; DDP's gradients in bf16 (recscale's hook on gloo): half the bytes.
    assert _sent(fp8, "all_to_all") < _sent(low, "all_to_all")
    assert _sent(fp8, "all_reduce") * 2 == _sent(full, "all_reduce")
    # MXINT8 both ways: 33 bytes per 32 values where FP8 takes 40, ids as they were. The embedding bytes E
    # follow from the fp32 and FP8 runs (E - 40/128 E); the MXINT8 run must send exactly E * 33/128 + ids.
    emb = (_sent(full, "all_to_all") - _sent(fp8, "all_to_all")) * 128 // (128 - 40)
    assert _sent(mx, "all_to_all") == _sent(full, "all_to_all") - emb * (128 - 33) // 128
    assert _sent(mx, "all_reduce") == _sent(full, "all_reduce")
    # The training is nearly the same: the losses follow the fp32 run's.
    for run in (low, fp8, mx):
        assert [r["step"] for r in run] == [r["step"] for r in full] == [3, 6]
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(run, full, strict=True)) < 5e-3


@dist_mark
def test_fsdp_bf16_gathers_half_the_bytes_and_trains_alike(runs):
    """FSDP2's mixed-precision policy under train.precision=bf16: parameters all-gathered in bf16 (about
    half the bytes), gradients reduce-scattered in fp32 (the same bytes), losses close to fp32's."""
    full, low = (train_records(runs / name) for name in ("fsdp_fp32", "fsdp_bf16"))

    assert _sent(full, "all_gather") > 0
    # About half (0.537 here): the all-gathers also carry the row-wise tables' traffic, which stays fp32.
    assert 0.5 * _sent(full, "all_gather") <= _sent(low, "all_gather") < 0.6 * _sent(full, "all_gather")
    assert _sent(low, "reduce_scatter") == _sent(full, "reduce_scatter") > 0
    assert [r["step"] for r in low] == [r["step"] for r in full] == [1, 2, 3, 4, 5]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(low, full, strict=True)) < 2e-2


@dist_mark
def test_ddp_bf16_trains_alike(runs):
    """train.precision=bf16 under DDP (2 ranks, table-wise tables): the losses follow the fp32 run's."""
    full, low = (train_records(runs / name) for name in ("table_wise_2", "ddp_bf16"))
    assert [r["step"] for r in low] == [r["step"] for r in full] == [1, 2, 3, 4, 5]
    assert 0 < max(abs(a["loss"] - b["loss"]) for a, b in zip(low, full, strict=True)) < 2e-2


# ---------------------------------------------------------------- plans (no processes needed)
def _plan(sharding: str, tables: dict | None = None, world: int = 4, local: int = 2) -> dict:
    """Per-table ParameterSharding of a 10-row, dim-16 LR-like model's tables on 2 hosts x 2 ranks."""
    features = FeatureSet(sparse=tuple(SparseInput(f"f{i}", 10) for i in range(4)), num_dense=0)
    model = build_model("lr", features, EmbeddingConfig(dim=16), {})
    env = DistEnv(0, world, local, torch.device("cpu"), "gloo")
    cfg = DistributedConfig.model_validate({"sharding": sharding, "tables": tables or {}})
    return dict(plan_tables(model, env, cfg).plan["embedding.ebc"])


def _shards(ps) -> list[tuple[int, list[int], list[int]]]:
    return [(m.placement.rank(), m.shard_offsets, m.shard_sizes) for m in ps.sharding_spec.shards]


def test_explicit_plans_place_shards_by_host():
    rw = _plan("row_wise")["t_f0"]
    assert (rw.sharding_type, rw.compute_kernel) == ("row_wise", "fused")
    assert _shards(rw) == [
        (0, [0, 0], [3, 16]),
        (1, [3, 0], [3, 16]),
        (2, [6, 0], [3, 16]),
        (3, [9, 0], [1, 16]),
    ]
    twrw = _plan("table_row_wise", {"f1": {"type": "table_row_wise", "host": 1}})
    assert _shards(twrw["t_f1"]) == [(2, [0, 0], [5, 16]), (3, [5, 0], [5, 16])]
    assert [r for r, _, _ in _shards(twrw["t_f0"])] == [0, 1]  # unplaced tables alternate hosts
    twcw = _plan("table_column_wise", {"f0": {"type": "table_column_wise", "host": 1}})["t_f0"]
    assert _shards(twcw) == [(2, [0, 0], [10, 8]), (3, [0, 8], [10, 8])]
    placed = _plan("table_wise", {"f0": {"type": "table_column_wise", "ranks": [3, 2]}})[
        "t_f0"
    ]  # the learned planner's
    assert (placed.sharding_type, _shards(placed)) == (
        "table_column_wise",
        [(3, [0, 0], [10, 8]), (2, [0, 8], [10, 8])],
    )
    cw = _plan("column_wise", {"f2": {"type": "column_wise", "ranks": [3, 1, 0, 2]}})["t_f2"]
    assert _shards(cw) == [
        (3, [0, 0], [10, 4]),
        (1, [0, 4], [10, 4]),
        (0, [0, 8], [10, 4]),
        (2, [0, 12], [10, 4]),
    ]
    tw = _plan("table_wise")
    assert sorted(ps.ranks[0] for ps in tw.values()) == [0, 1, 2, 3]  # balanced: one table per rank
    dp = _plan("data_parallel")["t_f3"]
    assert (dp.compute_kernel, dp.ranks, dp.sharding_spec) == ("dense", [0, 1, 2, 3], None)


@pytest.mark.parametrize(
    "tables, words",
    [
        ({"nope": {"type": "row_wise"}}, "unknown sparse features ['nope']"),
        ({"f0": {"type": "table_wise", "ranks": [4]}}, "ranks [4] do not exist in a world of 4 ranks"),
        ({"f0": {"type": "table_row_wise", "host": 2}}, "host 2 does not exist; the job has 2"),
        ({"f0": {"type": "column_wise", "ranks": [0, 1, 2]}}, "16 columns do not split into 3 shards"),
        (
            {"f0": {"type": "table_column_wise", "ranks": [1, 2]}},
            "ranks [1, 2] are not all on host 0 (ranks [0, 1])",
        ),
    ],
)
def test_impossible_plans_are_one_clear_line(tables, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        _plan("table_wise", tables)


def test_row_blocks_that_leave_a_rank_no_rows_are_one_clear_line():
    """10 rows over 8 ranks are blocks of 2: ranks 5-7 held none of any table, and training failed in the
    first lookup with an internal error (fbgemm: 'weights[0] must be a GPU or MTIA tensor')."""
    for kind in ("row_wise", "table_row_wise"):
        with pytest.raises(
            ConfigError, match=re.escape(f"{kind} leaves rank(s) [5, 6, 7] no rows of tables")
        ):
            _plan(kind, world=8, local=8)


def test_placement_keys_are_checked_by_the_config():
    with pytest.raises(ConfigError, match="host applies to table_row_wise and table_column_wise"):
        validate_config({"data": {"format": "synthetic"}, "model": {"name": "lr"},
                         "distributed": {"tables": {"s0": {"type": "row_wise", "host": 1}}}})  # fmt: skip


def test_hosts_must_hold_equal_numbers_of_ranks(capsys):
    with pytest.raises(RecscaleError, match="LOCAL_WORLD_SIZE=2"):
        Topology(3, 2)
    assert Topology(4, 2).ranks_of_host(1) == [2, 3] and Topology(4, 2).same_host(2, 3)
    code = main(["train", str(CONFIGS / "demo.yaml"), "--nproc", "3", "--local-world-size", "2"])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "error: --nproc 3 cannot be split into hosts of --local-world-size 2 ranks each"
    ]


def _twice(run_dirs: list[str]) -> None:
    """Train a run into each directory in turn, each Trainer starting torchrun's group and ending it."""
    import os
    import time

    import torch.distributed as dist

    logging.disable(logging.WARNING)
    for i, d in enumerate(run_dirs):
        if i and os.environ["RANK"] == "1":
            time.sleep(2)  # rank 0 forms the next group first: the last group's keys are there to read
        Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL, "distributed.timeout_s=30"]), Path(d)).fit()
        assert not dist.is_initialized()


@dist_mark
def test_trainers_in_turn_each_start_and_end_the_group(tmp_path):
    """A Trainer destroys the group it started when fit() returns; the next Trainer in the same torchrun
    process forms a new one from the same store. Under the same keys (destroying the default group resets
    torch's group count, which names them) the second group once failed "Gloo connectFullMesh failed ...
    Connect timeout" in a loaded full run of this file (a rank reading the destroyed group's address);
    init_distributed now names each group's keys apart."""
    runs = [tmp_path / "a", tmp_path / "b"]
    launch([__file__, "twice", *map(str, runs)], 2, 2, 0)
    assert all(losses(r) and (r / "report.json").is_file() for r in runs)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2])
    exit_rank(0)  # as recscale's ranks end (see exit_rank)
if __name__ == "__main__" and sys.argv[1:2] == ["twice"]:
    _twice(sys.argv[2:])
    exit_rank(0)
