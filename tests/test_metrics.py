import math

import numpy as np
import pytest
import torch

from recscale.train.metrics import (
    auc,
    binary_entropy,
    ctr_metrics,
    group_auc,
    normalized_entropy,
    rows_are,
    undefined_note,
)


def pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Reference AUC: the fraction of (positive, negative) pairs ranked right, ties count one half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def test_metrics_match_references():
    rng = np.random.default_rng(0)
    labels = (rng.random(600) < 0.3).astype(np.float32)
    logits = rng.normal(size=600).astype(np.float32) + 1.5 * labels
    logits[:50] = np.round(logits[:50])  # ties
    m = ctr_metrics(torch.from_numpy(logits), torch.from_numpy(labels))
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    logloss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    ctr = labels.astype(np.float64).mean()
    assert m["auc"] == pytest.approx(pairwise_auc(logits, labels), abs=1e-6)
    assert m["logloss"] == pytest.approx(logloss, rel=1e-9)
    assert m["ne"] == pytest.approx(logloss / binary_entropy(ctr), rel=1e-9)
    assert m["calibration"] == pytest.approx(p.mean() / ctr, rel=1e-9)
    assert m["rows"] == 600


def test_ne_is_one_for_the_base_rate():
    labels = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 0])
    logit = math.log(0.25 / 0.75)
    m = ctr_metrics(torch.full((8,), logit), labels)
    assert m["ne"] == pytest.approx(1.0)
    assert m["calibration"] == pytest.approx(1.0)
    assert m["auc"] == pytest.approx(0.5)


def test_binary_entropy_edges():
    assert binary_entropy(0.0) == 0.0 and binary_entropy(1.0) == 0.0
    assert binary_entropy(0.5) == pytest.approx(math.log(2))


def test_normalized_entropy_of_one_class_labels_is_nan_not_an_error():
    """A synthetic valid split of one class crashed the report's Bayes-floor NE with a ZeroDivisionError
    after training; the model's NE and the floor's now share one definition."""
    assert math.isnan(normalized_entropy(0.3, 0.0)) and math.isnan(normalized_entropy(0.3, 1.0))
    assert normalized_entropy(0.3, 0.25) == pytest.approx(0.3 / binary_entropy(0.25))


def test_auc_ranks_confident_logits_that_sigmoid_rounds_to_one():
    # sigmoid(40) and sigmoid(50) are both 1.0 in float64: an AUC of probabilities ties them.
    logits = torch.tensor([40.0, 50.0, 45.0, -3.0])
    labels = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert ctr_metrics(logits, labels)["auc"] == pytest.approx(pairwise_auc(logits.numpy(), labels.numpy()))
    assert ctr_metrics(logits, labels)["auc"] == 0.5


def test_auc_is_exact_in_float64_and_nan_for_nan_logits():
    rng = np.random.default_rng(1)
    labels = (rng.random(2000) < 0.3).astype(np.float64)
    logits = rng.normal(size=2000) + labels
    m = ctr_metrics(torch.from_numpy(logits), torch.from_numpy(labels))
    assert m["auc"] == pytest.approx(pairwise_auc(logits, labels), abs=1e-12)
    assert math.isnan(ctr_metrics(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]))["auc"])


def test_one_class_splits_and_unclipped_logloss():
    """As documented: AUC and NE are NaN for one class, calibration only without a positive; LogLoss
    is not clipped (a miss at logit 100 costs 100 nats, where an epsilon of 1e-15 would cap it at 34.5)."""
    ones = ctr_metrics(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 1.0]))
    assert math.isnan(ones["auc"]) and math.isnan(ones["ne"])
    assert ones["calibration"] == pytest.approx((0.5 + 1 / (1 + math.exp(-2))) / 2)
    zeros = ctr_metrics(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 0.0]))
    assert math.isnan(zeros["auc"]) and math.isnan(zeros["ne"]) and math.isnan(zeros["calibration"])
    miss = ctr_metrics(torch.tensor([100.0, -100.0]), torch.tensor([0.0, 1.0]))
    assert miss["logloss"] == pytest.approx(100.0) and miss["ne"] == pytest.approx(100.0 / math.log(2))


def test_logloss_of_infinite_logits_is_zero_when_right_and_infinite_when_wrong():
    """An overflowed logit (a diverging model, an fp8 layer in the precision probe) gave a NaN LogLoss:
    binary_cross_entropy_with_logits multiplies inf by a zero label. Right, it costs nothing; wrong, all."""
    right = ctr_metrics(torch.tensor([math.inf, -math.inf, 0.0]), torch.tensor([1.0, 0.0, 1.0]))
    assert right["logloss"] == pytest.approx(math.log(2) / 3)
    wrong = ctr_metrics(torch.tensor([-math.inf, 0.0]), torch.tensor([1.0, 0.0]))
    assert wrong["logloss"] == math.inf and wrong["ne"] == math.inf
    rng = np.random.default_rng(2)  # and finite logits are scored as before, to the last bits
    labels, logits = (rng.random(500) < 0.4).astype(np.float64), rng.normal(scale=30, size=500)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(logits), torch.from_numpy(labels)
    )
    m = ctr_metrics(torch.from_numpy(logits), torch.from_numpy(labels))
    assert m["logloss"] == pytest.approx(bce.item(), rel=1e-12)


@pytest.mark.parametrize(
    ("logits", "labels", "note"),
    [
        ([0.0, 1.0], [0.0, 1.0], None),
        ([0.0, 1.0], [0.0, 0.0], "auc, ne, calibration are null: none of the 2 rows is positive"),
        ([0.0], [0.0], "auc, ne, calibration are null: its 1 row is not positive (AUC"),
        ([0.0, 1.0], [1.0, 1.0], "auc, ne are null: all 2 rows are positive (AUC"),
        ([float("nan"), 1.0], [0.0, 1.0], "auc, logloss, ne, calibration are null: the model scored NaN"),
        ([-math.inf, 1.0], [1.0, 0.0], "logloss, ne are null: the model scored an infinite logit"),
    ],
)
def test_undefined_note_says_why_a_metric_is_null(logits, labels, note):
    got = undefined_note(ctr_metrics(torch.tensor(logits), torch.tensor(labels)))
    assert got == note if note is None else got.startswith(note)


def test_undefined_note_covers_the_group_auc():
    """A training run's summary printed `gauc nan` without a word (eval alone had a note): the note now says
    why for both, beside the one-class note where both are null."""
    m = ctr_metrics(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) | {"gauc": math.nan, "gauc_rows": 0}
    assert undefined_note(m) == (
        "gauc is null: no group (train.group_by) the run knows holds both classes here (rows of ids it never "
        "saw belong to no group)"
    )
    one = ctr_metrics(torch.tensor([0.0]), torch.tensor([1.0])) | {"gauc": math.nan, "gauc_by": "user"}
    note = undefined_note(one)
    assert note is not None and note.startswith("auc, ne are null: its 1 row is positive")
    assert "; gauc is null: no user id the run knows" in note


def test_group_auc_by_hand():
    """Group a: logits ranked right in 2 of its 2 pairs -> 1.0 over 3 rows; group b: a tie -> 0.5 over 2
    rows; group c holds only positives and is left out: (3 x 1.0 + 2 x 0.5) / 5 = 0.8."""
    logits = torch.tensor([2.0, 1.0, 0.0, 5.0, 5.0, 1.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([10, 10, 10, 3, 3, 7])
    assert group_auc(logits, labels, groups) == {"gauc": pytest.approx(0.8), "groups": 2, "rows": 5}
    one_class = group_auc(logits[:1], labels[:1], groups[:1])
    assert math.isnan(one_class["gauc"]) and one_class["rows"] == 0


@pytest.mark.parametrize("seed", range(5))
def test_group_auc_is_the_row_weighted_mean_of_each_groups_auc(seed):
    """Against a loop over the groups with ``auc`` (ties within and across groups, groups of one class)."""
    g = torch.Generator().manual_seed(seed)
    n = 500
    groups = torch.randint(0, 40, (n,), generator=g) * 3 - 50
    labels = (torch.rand(n, generator=g) < 0.3).double()
    logits = torch.randint(-4, 5, (n,), generator=g).double() + (seed % 2) * torch.randn(n, generator=g)
    num = rows = used = 0
    for v in groups.unique():
        m = groups == v
        a = auc(logits[m], labels[m])
        if not math.isnan(a):
            num, rows, used = num + a * int(m.sum()), rows + int(m.sum()), used + 1
    got = group_auc(logits, labels, groups)
    assert got["gauc"] == pytest.approx(num / rows, abs=1e-12) and (got["groups"], got["rows"]) == (
        used,
        rows,
    )


def test_rows_are_pluralises():
    """Messages said 'whose 1 rows are of one class' (train's early-stopping warning)."""
    assert [rows_are(n) for n in (0, 1, 2, 1234)] == [
        "0 rows are",
        "1 row is",
        "2 rows are",
        "1,234 rows are",
    ]
