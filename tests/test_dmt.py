"""Disaggregated Multi-Tower: semantics against the flat model, closed-form bytes, tower modules.

One launch of 4 ranks as 2 hosts x 2 runs every case (module fixture); run as a script, this file
is the workers' program (``_worker``).
"""

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.config import validate_config
from recscale.data.dataset import ArrayDataset
from recscale.distributed import comms
from recscale.distributed.dmt.assignment import resolve_assignment
from recscale.distributed.dmt.build import build_unsharded
from recscale.distributed.dmt.transform import Top
from recscale.distributed.env import init_distributed, shutdown
from recscale.distributed.launch import launch
from recscale.errors import ConfigError
from recscale.models.embedding import FeatureSet, SparseInput
from recscale.models.registry import build_model
from recscale.train.build import build
from recscale.train.regularizers import EmbeddingL2

B, D = 4, 8  # local batch, embedding dim
FEATURES = FeatureSet(
    sparse=(SparseInput("a", 20), SparseInput("b", 30), SparseInput("m", 25, "mean"),
            SparseInput("c", 10), SparseInput("e", 15)),
    num_dense=2,
)  # fmt: skip
TOWERS = {"a": 1, "b": 0, "m": 1, "c": 0, "e": 1}  # interleaved, so the flat order must be restored


def _cfg(
    tower_module: dict, sharding: str = "table_wise", model: dict | None = None, qr: bool = False
) -> dict:
    return {
        "data": {"format": "synthetic"},
        "model": model
        or {"name": "wukong", "num_layers": 1, "n_f": 2, "n_l": 2, "k": 2, "fmb_mlp": [8], "final_mlp": [8],
            "embedding": {"dim": D, "init_std": 0.1, "multi_embedding": {"b": 2},
                          **({"qr_buckets": {"a": 6, "m": 4}} if qr else {})}},
        "train": {"sparse_optimizer": {"name": "sgd", "lr": 1.0}, "dense_optimizer": {"name": "sgd", "lr": 1.0}},
        "dmt": {"assignment": TOWERS, "tower_module": tower_module, "sharding": sharding},
        "distributed": {"count_bytes": True},  # the traffic tests count the DDP all-reduce too
    }  # fmt: skip


def _batch(rows: int, seed: int, multi: bool = True) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in FEATURES.sparse:
        n = (
            torch.randint(1, 4, (rows,), generator=g)
            if f.pooling == "mean" and multi
            else torch.ones(rows, dtype=torch.long)
        )
        lengths.append(n)
        values.append(torch.randint(0, f.num_embeddings, (int(n.sum()),), generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f.name for f in FEATURES.sparse], values=torch.cat(values), lengths=torch.cat(lengths).int()
    )
    return torch.randn(rows, 2, generator=g), kjt, torch.randint(0, 2, (rows,), generator=g).float()


def _local(kjt: KeyedJaggedTensor, rank: int) -> KeyedJaggedTensor:
    """This rank's B samples of a global KJT."""
    parts = kjt.to_dict()
    return KeyedJaggedTensor.from_jt_dict(
        {
            k: type(jt).from_dense([jt.to_dense()[i] for i in range(rank * B, (rank + 1) * B)])
            for k, jt in parts.items()
        }
    )


# ---------------------------------------------------------------- worker side
def _compare(
    model, opt, reference: Callable, top: nn.Module, ebc: nn.Module, rank: int, world: int, l2: float = 0.0
) -> dict:
    """One DMT step on this rank's slice of a global batch against ``reference`` (unsharded, global
    batch, mean loss, plus the embedding L2 penalty ``l2`` on both sides): max |difference| of
    logits, top gradients and table gradients (read off the fused SGD step, lr 1) of this rank's
    shards; ``top``/``ebc``: the reference's modules."""
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    penalties = (EmbeddingL2(reference, l2), EmbeddingL2(model, l2)) if l2 else None
    dense, kjt, labels = _batch(world * B, seed=1)
    ref = reference(dense, kjt)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(ref, labels)
    (loss + penalties[0](world * B) if penalties else loss).backward()
    rows = slice(rank * B, (rank + 1) * B)
    out = model(dense[rows], _local(kjt, rank))
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(out, labels[rows])
    (loss + penalties[1](B) if penalties else loss).backward()
    diffs = {"logits": (out - ref[rows]).abs().max().item()}
    expected = {n: p.grad for n, p in top.named_parameters() if "ebc" not in n}
    got = {
        n.removeprefix("top.module.model."): p.grad
        for n, p in model.named_parameters()
        if n.startswith("top.")
    }
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    diffs["top_grads"] = max((got[n] - g).abs().max().item() for n, g in expected.items())
    grads = dict(ebc.named_parameters())
    diffs["table_grads"], diffs["shards"] = 0.0, 0
    for key, t in model.state_dict().items():
        if "embedding_bags" in key:
            table = key.split("embedding.ebc.")[1]
            for shard in t.local_shards():
                m = shard.metadata
                idx = tuple(slice(o, o + s) for o, s in zip(m.shard_offsets, m.shard_sizes, strict=True))
                diff = (shard.tensor - (before[table] - grads[table].grad)[idx]).abs().max().item()
                diffs["table_grads"], diffs["shards"] = max(diffs["table_grads"], diff), diffs["shards"] + 1
    return diffs


def _semantics(sharding: str, rank: int, world: int, l2: float = 0.0, qr: bool = False) -> dict:
    """Identity tower modules against the flat model (with ``l2``: both with the embedding L2 penalty;
    with ``qr``: two features as quotient-remainder tables)."""
    env = init_distributed()
    cfg = validate_config(_cfg({"type": "identity"}, sharding, qr=qr))
    built = build(cfg, FEATURES, env)
    model, opt = built.module, built.opt
    torch.manual_seed(cfg.seed)
    flat = build_model(cfg.model.name, FEATURES, cfg.model.embedding, cfg.model.params)
    return _compare(model, opt, flat, flat, flat.embedding.ebc, rank, world, l2)


def _compressed(kind: str, rank: int, world: int) -> dict:
    """A compressing tower module against the same DMT model unsharded, which also checks the
    tower modules' gradients (averaged over the host only, scaled by 1/H on the way back)."""
    env = init_distributed()
    cfg = validate_config(_cfg({"type": kind, "compression": 2}))
    built = build(cfg, FEATURES, env)
    model, opt = built.module, built.opt
    ref = build_unsharded(cfg, FEATURES, env.topology.num_hosts)

    def reference(dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        keys = kjt.keys()
        parts = kjt.permute([keys.index(f) for t in ref.towers for f in t]).split(
            [len(t) for t in ref.towers]
        )
        return Top(ref.top)(dense, torch.cat([m(p) for m, p in zip(ref.modules, parts, strict=True)], dim=1))

    mine = env.topology.host_of(rank)
    diffs = _compare(model, opt, reference, ref.top, ref.modules[mine].embedding.ebc, rank, world)
    got = get_unwrapped_module(model.towers[str(mine)]).module.parameters()
    expected = ref.modules[mine].module.parameters()
    diffs["tower_module_grads"] = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(got, expected, strict=True)
    )
    return diffs


def _traffic(tower_module: dict, rank: int, world: int) -> dict:
    """Bytes of one training step (single-id features), summed over ranks, and the model's sizes."""
    env = init_distributed()
    cfg = validate_config(_cfg(tower_module))
    built = build(cfg, FEATURES, env)
    model, opt = built.module, built.opt
    comms.install()
    meter = comms.CommMeter(env.topology, env.rank)
    dense, kjt, labels = _batch(world * B, seed=2, multi=False)
    rows = slice(rank * B, (rank + 1) * B)
    with meter.recording():
        out = model(dense[rows], _local(kjt, rank))
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(out, labels[rows]).backward()
        opt.step()
    total = meter.totals()
    torch.distributed.all_reduce(total)
    top = sum(p.numel() for n, p in model.named_parameters() if n.startswith("top."))
    return {"bytes": comms.summarize(total, 1), "outputs": model.outputs, "top_params": top}


def _bf16(rank: int, world: int) -> dict:
    """One training step of a compressing-tower DMT model under train.precision=bf16's autocast: how far
    its logits are from the same model's in fp32, and the dtypes its parameters and gradients keep."""
    env = init_distributed()
    built = build(validate_config(_cfg({"type": "wukong", "compression": 2})), FEATURES, env)
    dense, kjt, labels = _batch(world * B, seed=3)
    rows = slice(rank * B, (rank + 1) * B)
    with torch.no_grad():
        full = built.module(dense[rows], _local(kjt, rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = built.module(dense[rows], _local(kjt, rank))
    built.opt.zero_grad()
    torch.nn.functional.binary_cross_entropy_with_logits(low.float(), labels[rows]).backward()
    dense_grads = [p.grad for n, p in built.module.named_parameters() if n.startswith("top.")]
    return {
        "logits": (low.float() - full).abs().max().item(),
        "scale": full.abs().max().item(),
        "dtypes": sorted(
            {str(p.dtype) for p in built.module.parameters()} | {str(g.dtype) for g in dense_grads}
        ),
        "grads": len(dense_grads),
    }


CASES = {
    "bf16_compressed_wukong": _bf16,
    "semantics_table_wise": lambda r, w: _semantics("table_wise", r, w),
    "semantics_row_wise": lambda r, w: _semantics("row_wise", r, w),
    "semantics_l2_table_wise": lambda r, w: _semantics("table_wise", r, w, l2=0.5),
    "semantics_qr_row_wise": lambda r, w: _semantics("row_wise", r, w, qr=True),
    "compressed_lcb": lambda r, w: _compressed("lcb", r, w),
    "compressed_wukong": lambda r, w: _compressed("wukong", r, w),
    **{f"traffic_{kind}_{c}": (lambda r, w, kind=kind, c=c: _traffic({"type": kind, "compression": c}, r, w))
       for kind, c in (("identity", 1), ("lcb", 2), ("lcb", 4), ("projection", 2), ("wukong", 2))},
}  # fmt: skip


def _worker(out_dir: str) -> None:
    logging.disable(logging.WARNING)
    env = init_distributed()
    results = {name: case(env.rank, env.world_size) for name, case in CASES.items()}
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(results))
    shutdown()


# ---------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dmt")
    launch([__file__, "worker", str(out)], 4, 2, 0)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.dist
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "l2_table_wise", "qr_row_wise"])
def test_identity_towers_compute_the_flat_model(results, sharding):
    """2 hosts x 2 ranks: logits, dense gradients and (through one fused SGD step with lr 1) table
    gradients equal the unsharded flat model's on the global batch; also with train.embedding_l2's
    penalty, whose parts DMT computes on the towers' hosts (l2_table_wise), and with quotient-remainder
    tables (qr_row_wise)."""
    for r in results:
        d = r[f"semantics_{sharding}"]
        assert d["shards"] > 0
        assert max(d["logits"], d["top_grads"], d["table_grads"]) < 1e-6, d


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["lcb", "wukong"])
def test_compressing_towers_compute_their_unsharded_model(results, kind):
    """The same with a compressing tower module, against the DMT model run unsharded: the routing
    and the gradient scaling of tables, tower modules and top are exact."""
    for r in results:
        d = r[f"compressed_{kind}"]
        assert d["shards"] > 0
        assert max(d["logits"], d["top_grads"], d["table_grads"], d["tower_module_grads"]) < 1e-5, d


@pytest.mark.dist
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("traffic")])
def test_inter_host_bytes_match_closed_form(results, case):
    from recscale.distributed.dmt.volumes import dmt_embedding_inter, ring_all_reduce_inter
    from recscale.distributed.topology import Topology

    got = results[0][case]
    topo = Topology(4, 2)
    features = [sum(1 for f, t in TOWERS.items() if t == tower) for tower in (0, 1)]
    expected = dmt_embedding_inter(topo, B, features, got["outputs"], D)
    assert got["bytes"]["comm"]["all_to_all"]["inter"] == round(expected)
    assert got["bytes"]["comm"]["all_reduce"]["inter"] == round(
        ring_all_reduce_inter(topo, 4 * got["top_params"])
    )
    assert got["bytes"]["comm_inter_bytes"] == round(
        expected + ring_all_reduce_inter(topo, 4 * got["top_params"])
    )


@pytest.mark.dist
def test_dmt_trains_under_bf16_autocast(results):
    """train.precision=bf16 wraps DMT's forward like any other model's: the towers' collectives run inside
    autocast, the logits stay within bf16's rounding of fp32's, and every weight and gradient stays fp32."""
    for r in results:
        d = r["bf16_compressed_wukong"]
        assert d["grads"] > 0 and d["dtypes"] == ["torch.float32"], d
        assert 0 < d["logits"] < 0.05 * max(1.0, d["scale"]), d


@pytest.mark.dist
def test_compression_shrinks_what_leaves_the_host(results):
    outputs = {c: results[0][f"traffic_lcb_{c}"]["outputs"] for c in (2, 4)}
    # tower 0: b (2 vectors), c; tower 1: a, m, e
    assert results[0]["traffic_identity_1"]["outputs"] == [3, 3]
    assert outputs == {2: [2, 2], 4: [1, 1]}


def test_assignments_are_balanced_and_checked():
    names = [f"f{i}" for i in range(7)]
    for kind in ("round_robin", "random"):
        towers = resolve_assignment(kind, names, 3, seed=0)
        assert sorted(len(t) for t in towers) == [2, 2, 3] and sorted(sum(towers, [])) == names
    with pytest.raises(ConfigError, match="have no tower"):
        resolve_assignment({"f0": 0}, names, 2, 0)
    # a partition of another run's features named none missing as "features [] have no tower", and no fix
    with pytest.raises(ConfigError) as e:
        resolve_assignment({"f0": 0, "f1": 1, "x": 1}, names[:2], 2, 0)
    assert str(e.value) == (
        "dmt.assignment: ['x'] are not features of this run (['f0', 'f1']); give every feature one tower "
        "(partition this run's features: `recscale dmt partition RUN_DIR --towers 2`)"
    )
    with pytest.raises(
        ConfigError, match=r"towers \[0\], but DMT runs one tower per host and this job has 2"
    ):
        resolve_assignment({f: 0 for f in names}, names, 2, 0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "is not JSON"),
        ('{"towers": 2}', 'no "assignment" object'),
        ("[1, 2]", 'no "assignment" object'),
        ('{"assignment": {"f0": "x", "f1": 0}}', "towers must be integers >= 0; got 'f0': \"x\""),
        ('{"assignment": {"f0": -1, "f1": 0}}', "towers must be integers >= 0; got 'f0': -1"),
        ('{"assignment": {"f0": 0.5, "f1": 0}}', "towers must be integers >= 0; got 'f0': 0.5"),
    ],
)
def test_malformed_assignment_file_is_one_line(tmp_path, text, message):
    # These were internal errors (JSONDecodeError, KeyError, TypeError) on every rank.
    path = tmp_path / "towers.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"dmt.assignment {path}.*{message}"):
        resolve_assignment(str(path), ["f0", "f1"], 2, 0)


def test_assignment_file_for_another_host_count_says_so(tmp_path):
    path = tmp_path / "towers.json"
    path.write_text(json.dumps({"assignment": {"f0": 0, "f1": 1}}))
    with pytest.raises(ConfigError, match=r"this job has 1 host: .*--towers 1`, or run this one on 2 hosts"):
        resolve_assignment(str(path), ["f0", "f1"], 1, 0)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2])


def test_partitioner_recovers_planted_groups_under_balance():
    """Two cliques of interacting features, interleaved in schema order: the partitioner puts each
    in its own tower (round robin mixes them) and keeps the towers balanced."""
    from recscale.distributed.dmt.partitioner import FeatureStats, partition_report

    names = [f"f{i}" for i in range(8)]
    group = np.arange(8) % 2
    rng = np.random.default_rng(0)
    affinity = np.where(group[:, None] == group[None, :], 1.0, 0.05) + rng.uniform(0, 0.01, (8, 8))
    affinity = (affinity + affinity.T) / 2
    np.fill_diagonal(affinity, 0)
    stats = FeatureStats(names, affinity, lookup=np.full(8, 16.0), memory=np.arange(1, 9) * 100.0)
    report = partition_report(stats, towers=2, tolerance=0.25)
    towers = [set(t["features"]) for t in report["partitioner"]["towers"]]
    assert sorted(map(sorted, towers)) == [["f0", "f2", "f4", "f6"], ["f1", "f3", "f5", "f7"]]
    assert report["partitioner"]["intra_share"] > 0.9 > report["random_mean_of_20"]["intra_share"]
    assert report["partitioner"]["lookup_imbalance"] <= 1.25
    assert report["partitioner"]["memory_imbalance"] <= 1.25


def test_tower_modules_compress_to_ceil_n_over_ratio():
    from recscale.config import TowerModuleConfig
    from recscale.distributed.dmt.towers import build_tower_module, tower_outputs

    x = torch.randn(3, 5, D)
    for kind in ("lcb", "projection", "wukong"):
        for ratio, c in ((1, 5), (2, 3), (4, 2), (8, 1)):
            cfg = TowerModuleConfig(type=kind, compression=ratio)
            assert tower_outputs(5, cfg) == c
            assert build_tower_module(5, D, cfg)(x).shape == (3, c, D)
    with pytest.raises(ConfigError, match="identity tower module cannot compress"):
        validate_config({**_cfg({"type": "identity", "compression": 2})})


@pytest.mark.parametrize(
    "launch, hosts", [([], "1 host"), (["--nproc", "4", "--local-world-size", "2"], "2 hosts")]
)
def test_towers_other_than_hosts_is_one_line(tmp_path, capsys, launch, hosts):
    """Under --nproc it is checked before the launch: every rank used to print it, then 'rank N exited'."""
    from recscale.cli import main

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    small = ["data.synthetic.rows.train=256", "data.synthetic.rows.valid=64", "data.synthetic.rows.test=64",
             "data.num_workers=0", "train.batch_size=64", "train.progress=false"]  # fmt: skip
    assert main(["train", str(demo), *small, "dmt.towers=3", *launch, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: dmt.towers=3: DMT runs one tower per host and this job has {hosts}; set dmt.towers=auto "
        "or run it on 3 hosts (e.g. --nproc 6 --local-world-size 2)"
    )
    assert not (tmp_path / "run").exists()


def test_an_assignment_of_other_features_is_refused_before_the_launch(tmp_path, capsys, monkeypatch):
    """A partition file of another run's features was found by every rank after the launch ('...; the other
    ranks were stopped')."""
    from recscale.cli import main

    monkeypatch.setattr("recscale.distributed.launch.launch", lambda *a: pytest.fail("launched"))
    other = tmp_path / "towers.json"
    other.write_text(json.dumps({"assignment": {"user": 0, "item": 1}}))
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    argv = ["train", str(demo), f"dmt.assignment={other}", "--nproc", "4", "--local-world-size", "2"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"error: dmt.assignment {other}: features ['m0'," in err and "are not features of this run" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_settings_dmt_cannot_take_are_refused_by_the_config():
    """Checked only when the towers were built, by every rank after a --nproc launch: the same error
    printed by each rank, then the launcher's line. The config refuses them, once, before any launch."""
    from recscale.config import load_config

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(demo, ["dmt={}", "model.quant={format: mxfp4}", "train.compile=true"])
    assert str(e.value) == (
        "invalid config: config: dmt: not supported together with train.compile, model.quant; drop them or dmt"
    )
    # DMT builds its towers and top without qcomms' codecs and hook: a run with them sent fp32 unsaid.
    with pytest.raises(ConfigError) as e:
        load_config(demo, ["dmt={}", "distributed.qcomms={forward: fp16, backward: fp16, dense: bf16}"])
    assert str(e.value) == (
        "invalid config: config: dmt: not supported together with distributed.qcomms; drop it or dmt"
    )
    # Each host shards its tower by dmt.sharding, from the whole model: these trained as table_wise and
    # materialize: full without a word.
    with pytest.raises(ConfigError) as e:
        load_config(demo, ["dmt={}", "distributed.sharding=learned", "distributed.materialize=shards"])
    assert str(e.value) == (
        "invalid config: config: dmt: not supported together with distributed.sharding (a host's tables "
        "follow dmt.sharding), distributed.materialize=shards; drop them or dmt"
    )


# The two kinds of run a scorer loads differently: identity tower modules (the flat model, order restored)
# kept in best/; Wukong-layer tower modules with a dense EMA and no early stopping, whose model is its last
# checkpoint's averaged weights (the model's and the EMA's tensors, both under the multi-host model's names).
DMT_RUNS = {
    "identity": ["dmt={}"],
    "wukong": ["dmt={tower_module: {type: wukong, compression: 2}}", "train.ema_decay=0.5", "train.early_stopping=null"],
}  # fmt: skip


@pytest.fixture(scope="module", params=list(DMT_RUNS))
def dmt_run(tmp_path_factory, request) -> Path:
    """A 2-host x 1-rank DMT training of 3 steps (see DMT_RUNS)."""
    from recscale.cli import main

    run = tmp_path_factory.mktemp(f"dmt_{request.param}") / "run"
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    assert main(["train", str(demo), "--nproc", "2", "--local-world-size", "1", "--out", str(run),
                 "data.synthetic.rows={train: 1024, valid: 256, test: 256}", "train.batch_size=256",
                 "train.max_steps=3", "train.progress=false", *DMT_RUNS[request.param]]) == 0  # fmt: skip
    return run


@pytest.mark.dist
def test_a_dmt_run_evaluates_in_one_process_as_it_did_itself(dmt_run, capsys):
    """Every host's tower loads into one process (the tables' shards joined by DCP, the wrappers' names
    mapped): `recscale eval` used to refuse a DMT run ("towers load only at its own hosts")."""
    from recscale.cli import main

    capsys.readouterr()
    assert main(["eval", str(dmt_run)]) == 0
    got = json.loads(capsys.readouterr().out)
    expected = json.loads((dmt_run / "report.json").read_text())["test"]
    assert got["rows"] == expected["rows"] == 256
    for metric in ("auc", "logloss"):
        assert got[metric] == pytest.approx(expected[metric], abs=1e-6)
    # The precision probe's plan is a model.quant section, which DMT does not take: refused in one line.
    assert main(["precision", "probe", str(dmt_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a DMT run" in err and "`recscale eval` scores DMT runs" in err
    assert main(["eval", str(dmt_run), "--nproc", "2"]) == 2  # refused before any rank starts
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scored in one process" in err and "leave out --nproc" in err


def _run_and_flat_logits(dmt_run: Path, flat: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The DMT run's own logits on its test rows, and ``flat``'s."""
    from recscale.train.runs import load_trained

    test = ArrayDataset(dmt_run / "data" / "test")
    batch = test.gather(np.arange(len(test)))
    _, _, built = load_trained(dmt_run)
    built.module.eval()
    with torch.no_grad():
        return built.module(batch.dense, batch.sparse), flat(batch.dense, batch.sparse)


@pytest.mark.dist
def test_a_dmt_run_with_identity_towers_exports_as_the_flat_model_it_computes(dmt_run, capsys):
    """Identity tower modules: the exported flat model scores the run's test rows as the run does.
    Compressing ones have no flat form: refused in one line, nothing written."""
    from recscale.cli import main
    from recscale.serve.scorer import Scorer
    from recscale.train.runs import run_config

    out = dmt_run.parent / "model"
    capsys.readouterr()
    if run_config(dmt_run).dmt.tower_module.type != "identity":
        assert main(["export", str(dmt_run), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {dmt_run} is a DMT run with wukong tower modules, a model with no flat form to export "
            "(only identity tower modules compute the flat model); `recscale eval` scores it"
        )
        assert not out.exists()
        return
    assert main(["export", str(dmt_run), "--out", str(out)]) == 0
    expected, got = _run_and_flat_logits(dmt_run, Scorer(out).model)
    assert expected.std() > 0  # not a constant model: the check can fail
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_dmt_partition_refuses_an_out_over_the_runs_own_files(tmp_path, capsys):
    """--out RUN/config.yaml wrote the towers' JSON over the run's config (the run then loaded no more);
    --out a directory failed only after the partition's work. Both are refused before it now."""
    from recscale.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    for out, says in [(run / "config.yaml", "is the run's own config.yaml"), (tmp_path, "is a directory")]:
        assert main(["dmt", "partition", str(run), "--towers", "2", "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"error: --out {out} {says}; name " + (
            "another file to write" if out != tmp_path else "the file to write"
        )
    assert (run / "config.yaml").read_text() == "seed: 0\n"


@pytest.mark.dist
def test_dmt_partition_takes_a_run_with_identity_towers_as_its_flat_model(dmt_run, capsys):
    """`dmt partition` refused every DMT run, though one with identity tower modules is the flat model
    export writes: it partitions that flat model's embeddings now. Compressing ones are refused in one line."""
    from recscale.cli import main
    from recscale.train.runs import load_flat, run_config

    out = dmt_run.parent / "towers.json"
    capsys.readouterr()
    argv = ["dmt", "partition", str(dmt_run), "--towers", "2", "--out", str(out)]
    if run_config(dmt_run).dmt.tower_module.type != "identity":
        assert main(argv) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {dmt_run} is a DMT run with wukong tower modules, a model with no flat form to partition "
            "into DMT towers (only identity tower modules compute the flat model); partition a flat run, or "
            "one with identity tower modules"
        )
        assert not out.exists()
        return
    assert main(argv) == 0
    report = json.loads(out.read_text())
    towers = [f for t in report["partitioner"]["towers"] for f in t["features"]]
    _, pre, flat = load_flat(dmt_run, "to partition")
    assert sorted(towers) == sorted(flat.embedding.positions) == sorted(f.name for f in pre.schema.sparse)
    # the flat model it partitions is the one the run computes: the same logits on its test rows
    expected, got = _run_and_flat_logits(dmt_run, flat)
    assert expected.std() > 0
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.dist
@pytest.mark.parametrize("launch", [[], ["--nproc", "2", "--local-world-size", "2"]])
def test_a_dmt_run_resumed_on_another_topology_says_so_before_loading(dmt_run, capsys, launch):
    """Towers are hosts: on another number of hosts the model differs. The error used to come from the
    failed load and call the checkpoint damaged; now it names both topologies and changes nothing."""
    from recscale.cli import main

    before = {p: p.stat().st_mtime_ns for p in dmt_run.rglob("*")}
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(dmt_run), "train.max_steps=4", *launch]) == 2
    err = capsys.readouterr().err.strip()
    local = 2 if launch else 1
    assert err == (
        f"error: --resume: {dmt_run / 'ckpt' / 'step_00000003'} was saved by a DMT run on 2 hosts (one tower "
        f"each) and this job has 1 host of {local} rank{'s' * (local > 1)}; resume it on 2 hosts, e.g. "
        f"--nproc {2 * local} --local-world-size {local}"
    )
    assert {p: p.stat().st_mtime_ns for p in dmt_run.rglob("*")} == before
