"""CTR metrics: AUC, LogLoss, normalized entropy (NE) and calibration.

LogLoss is exact: from the logits in float64, unclipped (no epsilon), so a confident miss at logit z
costs about |z| nats (an infinite logit: 0 nats when right, infinite when wrong). NE, the metric of Meta's recommendation papers, is the LogLoss divided by the
entropy of the evaluated rows' own CTR (the LogLoss of always predicting their mean label): 1.0 means
no better than that base rate. He et al. (2014) divide by the entropy of the training CTR instead; the
two differ as far as the split's CTR differs from training's. Calibration is the mean predicted
probability over that same CTR (NaN where no row is positive). AUC is exact (threshold-free): the
Mann-Whitney statistic of the logits themselves in float64, ties counting one half. Not of
sigmoid(logits): in float64 every logit above ~37 becomes 1.0, so a confident model's top scores would
all tie.

Row weights (importance weights, ``schema.weight``), where given, weigh every metric: a row of integer weight
k counts as k copies of it (LogLoss sum(w * l) / sum(w), the CTR sum(w * y) / sum(w), a (positive, negative)
pair w_pos * w_neg in the AUC, a group by its total weight in the group AUC). Without them each row weighs 1,
which is the same computation, to the last bit.
"""

from __future__ import annotations

import math

import torch


def binary_entropy(p: float) -> float:
    """Entropy in nats of a Bernoulli(p); 0 at p in {0, 1}."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def normalized_entropy(logloss: float, ctr: float) -> float:
    """LogLoss over the entropy of the labels' CTR; NaN where the labels have one class (no entropy)."""
    base = binary_entropy(ctr)
    return logloss / base if base > 0 else float("nan")


def _pairs_ranked_right(
    tie: torch.Tensor, tie_group: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted Mann-Whitney statistic of each group: (right, positive, negative), each (groups,), where
    ``right`` sums w_pos * w_neg over its (positive, negative) pairs the scores rank right, a tie counting one
    half, and ``positive``/``negative`` sum its positives'/negatives' weights. With every weight 1 these are
    counts, exact in float64 (the rank-sum formula's numbers).

    tie: (N,) each row's tie class, numbered by (group, score) ascending (``torch.unique`` 's order);
    tie_group: (T,) each class's group; labels, weights: (N,) float64."""
    classes = len(tie_group)
    pos = torch.zeros(classes, dtype=torch.float64).index_add_(0, tie, weights * labels)
    neg = torch.zeros(classes, dtype=torch.float64).index_add_(0, tie, weights * (1 - labels))
    neg_of_group = torch.zeros(groups, dtype=torch.float64).index_add_(0, tie_group, neg)
    # Negatives' weight below each class within its group: all below it, less the earlier groups'.
    below = torch.cumsum(neg, 0) - neg - (torch.cumsum(neg_of_group, 0) - neg_of_group)[tie_group]
    right = torch.zeros(groups, dtype=torch.float64).index_add_(0, tie_group, pos * (below + neg / 2))
    pos_of_group = torch.zeros(groups, dtype=torch.float64).index_add_(0, tie_group, pos)
    return right, pos_of_group, neg_of_group


def _row_weights(labels: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """(N,) float64 row weights: ``weights``, or 1 for every row."""
    return torch.ones_like(labels) if weights is None else weights.double().flatten()


def auc(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Exact AUC of logits (N,) against 0/1 labels (N,): the fraction of (positive, negative) pairs
    ranked right, ties one half, each pair weighing w_pos * w_neg with row ``weights`` (N,) (None: 1; an
    integer weight is the AUC of the row repeated that often); NaN where either class weighs nothing or a
    logit is NaN."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    w = _row_weights(labels, weights)
    if bool(torch.isnan(logits).any()):
        return float("nan")
    _, tie = torch.unique(logits, return_inverse=True)
    one = torch.zeros(int(tie.max()) + 1 if len(tie) else 0, dtype=torch.long)
    right, positive, negative = _pairs_ranked_right(tie, one, labels, w, 1)
    if not (positive.item() > 0 and negative.item() > 0):
        return float("nan")
    return right.item() / (positive.item() * negative.item())


def ctr_metrics(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> dict[str, float]:
    """Metrics of one evaluation pass. logits, labels: (N,) -> {auc, logloss, ne, calibration, rows}; with row
    ``weights`` (N,) each row counts its weight (LogLoss sum(w * l) / sum(w), NE against the weighted CTR,
    calibration the weighted mean prediction over it, AUC as ``auc``) and weight_sum, sum(w), is added; rows that
    all weigh 0 score NaN."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    n = int(labels.numel())
    if n == 0:
        raise ValueError("no rows to evaluate")
    w = _row_weights(labels, weights)
    total = w.sum().item()
    # Rows that all weigh 0 have no weighted mean: every metric NaN (a Python float division raised instead).
    mass = total if total > 0 else float("nan")
    # log(1 + exp(-z)) for a positive, log(1 + exp(z)) for a negative: exact, and an infinite logit costs
    # 0 or inf nats (binary_cross_entropy_with_logits gives NaN for both, as it multiplies inf by 0).
    logloss = (w * torch.logaddexp(torch.zeros_like(logits), (1 - 2 * labels) * logits)).sum().item() / mass
    ctr = (w * labels).sum().item() / mass
    m = {
        "auc": auc(logits, labels, w),
        "logloss": logloss,
        "ne": normalized_entropy(logloss, ctr),
        "calibration": (w * torch.sigmoid(logits)).sum().item() / mass / ctr if ctr > 0 else float("nan"),
        "rows": n,
    }
    return m if weights is None else m | {"weight_sum": total}


def group_auc(
    logits: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor, weights: torch.Tensor | None = None
) -> dict[str, float]:
    """Group AUC (Zhou et al., DIN, KDD 2018): each group's exact AUC (as ``auc``, pairs weighted by row
    ``weights`` (N,) if given), averaged with weights the groups' total row weight (their row counts without
    ``weights``), over the groups whose two classes both weigh something (a user with only clicks or only
    non-clicks ranks nothing). logits, labels, groups (N,) -> {gauc, groups: the groups averaged, rows: their
    rows}; gauc NaN where no group holds both classes or a logit is NaN."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    w = _row_weights(labels, weights)
    _, g = torch.unique(groups.flatten(), return_inverse=True)
    # Tie classes of (group, logit), numbered in that order: a group's classes ascend by score.
    pairs, tie = torch.unique(torch.stack([g.double(), logits]), dim=1, return_inverse=True)
    n = torch.bincount(g)  # rows per group
    right, positive, negative = _pairs_ranked_right(tie, pairs[0].long(), labels, w, len(n))
    both = (positive > 0) & (negative > 0)
    rows = int(n[both].sum().item())
    if rows == 0 or bool(torch.isnan(logits).any()):
        return {"gauc": float("nan"), "groups": int(both.sum().item()), "rows": rows}
    p, m = positive[both], negative[both]
    aucs = right[both] / (p * m)
    return {
        "gauc": ((aucs * (p + m)).sum() / (p + m).sum()).item(),
        "groups": int(both.sum().item()),
        "rows": rows,
    }


def rows_are(n: int) -> str:
    """``n`` rows and their verb, for a message: '1 row is', '8 rows are'."""
    return f"{n:,} row{'s' * (n != 1)} {'is' if n == 1 else 'are'}"


def undefined_note(m: dict[str, float]) -> str | None:
    """Why ``ctr_metrics``' result ``m`` (with ``evaluate``'s gauc, if any) holds a non-finite value (JSON writes
    it as null), or None: a one-class split or a diverged model must not read as a metric merely left out."""
    notes = []
    bad = [k for k in ("auc", "logloss", "ne", "calibration") if not math.isfinite(m[k])]
    if bad:
        rows = int(m["rows"])
        weighted = "weight_sum" in m  # rows of weight 0 count as absent
        if weighted and not m["weight_sum"] > 0:
            why = f"{'all' if rows != 1 else 'its'} {rows_are(rows)} of weight 0 (data.schema.weight)"
        elif math.isnan(m["logloss"]):
            why = "the model scored NaN (a diverged model)"
        elif math.isinf(m["logloss"]):
            why = "the model scored an infinite logit on a row of the other class (a diverged model)"
        elif math.isnan(m["calibration"]):
            none = f"none of the {rows:,} rows is" if rows != 1 else "its 1 row is not"
            of = " of weight above 0" if weighted else ""
            why = f"{none} positive{of} (AUC and NE need both classes, calibration a positive)"
        else:
            of = " (or of weight 0)" if weighted else ""
            why = f"{'all' if rows != 1 else 'its'} {rows_are(rows)} positive{of} (AUC and NE need both classes)"
        notes.append(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} null: {why}")
    if "gauc" in m and not math.isfinite(m["gauc"]) and math.isfinite(m["logloss"]):
        who = f"{m['gauc_by']} id" if "gauc_by" in m else "group (train.group_by)"
        notes.append(  # a group AUC needs a group holding both classes
            f"gauc is null: no {who} the run knows holds both classes here (rows of ids it never saw belong to no group)"
        )
    return "; ".join(notes) or None
