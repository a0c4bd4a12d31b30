"""FreeScale-style balancing: the LPT partition, and a 2-rank gloo run whose losses equal the contiguous
split's (every sample trained once per step, the loss rescaled for unequal parts)."""

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from recscale.config import load_config
from recscale.distributed.balance import (
    CostModel,
    balanced_parts,
    imbalance,
    part_cost,
    partition,
    sample_costs,
)
from recscale.distributed.env import shutdown
from recscale.distributed.launch import launch
from recscale.errors import ConfigError
from recscale.models.flops import module_flops
from recscale.train.loop import Trainer, cost_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _zipf_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pmf = np.arange(1, 258, dtype=np.float64) ** -1.2
    return rng.choice(257, size=(n, 1), p=pmf / pmf.sum())


COSTS = {
    "tokens": CostModel.tokens("tokens", 1),
    "tokens2": CostModel.tokens("tokens2", 1),
    "flops": CostModel.flops(5000.0, [(3072, 64)]),  # a causal block of width 16
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("balance", sorted(COSTS))
def test_lpt_trains_every_sample_once_and_evens_the_cost(world, balance):
    costs = sample_costs(_zipf_lengths(1024), COSTS[balance])
    parts = partition(costs, world)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1024))
    assert all(np.all(np.diff(p) > 0) for p in parts)
    balanced = imbalance(np.array([costs[p].sum() for p in parts]))
    contiguous = imbalance(np.array([c.sum() for c in np.array_split(costs, world)]))
    assert balanced <= 1.1 < contiguous or balanced < contiguous
    assert balanced <= 1.1
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition(costs, world), strict=True))


def test_costs_count_tokens_or_their_squares_over_every_sequence():
    lengths = np.array([[0, 0], [3, 1], [2, 2]])
    assert sample_costs(lengths, CostModel.tokens("tokens", 2)).tolist() == [1, 5, 5]
    assert sample_costs(lengths, CostModel.tokens("tokens2", 2)).tolist() == [1, 11, 9]
    flops = CostModel.flops(100, [(10, 1), (20, 2)])
    assert sample_costs(lengths, flops).tolist() == [100, 100 + 30 + 9 + 20 + 2, 100 + 20 + 4 + 40 + 8]


@pytest.mark.parametrize("padding", ["pow2", "batch"])
@pytest.mark.parametrize("world", [4, 8])
def test_padding_aware_lpt_evens_the_padded_cost(padding, world):
    """Balancing the jagged cost leaves the padded work uneven; the padding-aware partition evens it."""
    lengths = _zipf_lengths(256, seed=1)
    padded = CostModel.flops(5e5, [(98304, 512)], padding)
    jagged = CostModel.flops(5e5, [(98304, 512)])
    parts = balanced_parts(lengths, padded, world)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(256))
    assert all(
        np.array_equal(a, b) for a, b in zip(parts, balanced_parts(lengths, padded, world), strict=True)
    )

    def padded_imbalance(parts):
        return imbalance(np.array([part_cost(lengths[p], padded) for p in parts]))

    assert padded_imbalance(parts) <= 1.05 < padded_imbalance(balanced_parts(lengths, jagged, world))


def test_part_cost_pads_each_bucket_to_its_longest_history():
    lengths = np.array([[0], [3], [4], [9]])  # pow2 classes 0, 2, 2, 4
    model = CostModel(1.0, (10.0,), (1.0,), "pow2")
    assert part_cost(lengths, model) == 4 + 0 + 2 * (40 + 16) + (90 + 81)
    assert part_cost(lengths, CostModel(1.0, (10.0,), (1.0,), "batch")) == 4 + 4 * (90 + 81)
    jagged = CostModel(1.0, (10.0,), (1.0,))
    assert part_cost(lengths, jagged) == sample_costs(lengths, jagged).sum() == 4 + 39 + 56 + 171


def test_flops_costs_come_from_the_model(tmp_path):
    """The fixed part is the model's FLOPs per example less its encoders' at full histories."""
    cfg = load_config(CONFIGS / "demo.yaml", [*SMALL, "distributed.balance=flops"])
    with pytest.warns(
        UserWarning, match="distributed.balance=flops splits each global batch across ranks, and this"
    ):
        trainer = Trainer(cfg, tmp_path / "run")  # one process: balancing changes nothing, said once
    model, flops = trainer.built.model, trainer.built.flops_per_example
    cost = cost_model("flops", model, flops, ["h0"])
    encoder = model.embedding.encoders["h0"]
    assert (cost.linear[0], cost.quadratic[0]) == encoder.length_flops()
    assert cost.fixed == flops - module_flops(encoder) > 0
    trainer.log.close()


@pytest.mark.parametrize("balance", ["tokens", "tokens2", "flops"])
def test_balance_without_a_sequence_feature_is_refused(balance):
    """Every sample costs the same without histories: the "balanced" split was the even one, without a word."""
    with pytest.raises(ConfigError, match=f"distributed.balance={balance} .* no sequence feature") as e:
        load_config(CONFIGS / "frappe.yaml", [f"distributed.balance={balance}"])
    assert "\n" not in str(e.value)
    # synthetic data's schema, without histories
    with pytest.raises(ConfigError, match="no sequence feature"):
        load_config(CONFIGS / "demo.yaml", [f"distributed.balance={balance}"])
    load_config(CONFIGS / "demo.yaml", [*SMALL, f"distributed.balance={balance}"])
    load_config(CONFIGS / "movielens" / "sequences.yaml", [f"distributed.balance={balance}"])


SMALL = [
    "data.synthetic.rows={train: 4096, valid: 512, test: 512}", "data.synthetic.num_sparse=3",
    "data.synthetic.num_multi=1", "data.synthetic.num_history=1", "data.synthetic.history_max_len=32",
    "data.synthetic.vocab_sizes=64", "data.num_workers=0", "model.embedding.dim=8", "model.num_layers=1",
    "model.embedding.sequence={encoder: causal_din, target: s0, buckets: 2}", "train.batch_size=128",
    "train.max_steps=6", "train.log_every=1", "train.progress=false", "train.early_stopping=null",
    "train.embedding_l2=0.01",
]  # fmt: skip


def _losses(run: Path) -> list[float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["split"] == "train"]


def _worker(spec_path: str) -> None:
    """Both runs in one launch (one start-up of the ranks): contiguous, then balanced."""
    logging.disable(logging.WARNING)
    for out, overrides in json.loads(Path(spec_path).read_text()):
        Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL, *overrides]), Path(out)).fit()
    shutdown()


@pytest.mark.dist
def test_balanced_two_rank_run_has_the_losses_of_contiguous_slices(tmp_path):
    runs = [
        (str(tmp_path / "none"), ["distributed.sharding=table_wise"]),
        (str(tmp_path / "tokens2"), ["distributed.sharding=row_wise", "distributed.balance=tokens2"]),
        (str(tmp_path / "flops"), ["distributed.sharding=table_wise", "distributed.balance=flops"]),
    ]
    (tmp_path / "spec.json").write_text(json.dumps(runs))
    launch([__file__, "worker", str(tmp_path / "spec.json")], 2, 2, 0)
    reference = _losses(tmp_path / "none")
    assert len(reference) == 6
    for balance in ("tokens2", "flops"):
        np.testing.assert_allclose(_losses(tmp_path / balance), reference, rtol=0, atol=1e-5)
        report = json.loads((tmp_path / balance / "report.json").read_text())
        assert report["examples"] == 6 * 128


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2])


def test_a_resume_may_change_the_balance(tmp_path):
    """Balancing only decides which rank trains which sample of a step (each still once), as resuming on
    another number of ranks does, which was allowed; changing distributed.balance was refused."""
    run = tmp_path / "r"
    Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL, "train.max_steps=2"]), run).fit()
    longer = [*SMALL, "train.max_steps=4", "distributed.balance=tokens2"]
    report = Trainer(load_config(CONFIGS / "demo.yaml", longer), run, resume=True).fit()
    assert report["steps"] == 4
    with pytest.raises(ConfigError, match="changes model.num_layers"):  # what shapes the model still may not
        Trainer(load_config(CONFIGS / "demo.yaml", [*longer, "model.num_layers=2"]), run, resume=True)


def test_balance_with_batch_norm_is_refused():
    """Batch norm normalises over each rank's rows, which balancing picks by history length: the losses then
    depend on the split (not those of the even one) and a rank can hold a single row (torch's error)."""
    lengths = np.array([[200]] + [[1]] * 7)
    assert [len(p) for p in balanced_parts(lengths, COSTS["tokens2"], 2)] == [1, 7]  # one row on rank 0
    with pytest.raises(ConfigError, match=r"model.norm=batch normalises over each rank's rows, which "
                                          r"distributed.balance=tokens picks by history length"):  # fmt: skip
        load_config(CONFIGS / "demo.yaml", [*SMALL, "distributed.balance=tokens", "model.norm=batch"])
    load_config(CONFIGS / "demo.yaml", [*SMALL, "distributed.balance=tokens", "model.norm=layer"])
