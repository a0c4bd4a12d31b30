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


def auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact AUC of logits (N,) against 0/1 labels (N,): the fraction of (positive, negative) pairs
    ranked right, ties one half; NaN where the labels have one class or a logit is NaN."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    positives = labels.sum().item()
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0 or bool(torch.isnan(logits).any()):
        return float("nan")
    _, group, counts = torch.unique(logits, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = (ends - (counts.double() - 1) / 2)[group]  # 1-based, ties share their mean rank
    return ((ranks * labels).sum().item() - positives * (positives + 1) / 2) / (positives * negatives)


def ctr_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics of one evaluation pass. logits, labels: (N,) -> {auc, logloss, ne, calibration, rows}."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    n = int(labels.numel())
    if n == 0:
        raise ValueError("no rows to evaluate")
    # log(1 + exp(-z)) for a positive, log(1 + exp(z)) for a negative: exact, and an infinite logit costs
    # 0 or inf nats (binary_cross_entropy_with_logits gives NaN for both, as it multiplies inf by 0).
    logloss = torch.logaddexp(torch.zeros_like(logits), (1 - 2 * labels) * logits).mean().item()
    ctr = labels.mean().item()
    return {
        "auc": auc(logits, labels),
        "logloss": logloss,
        "ne": normalized_entropy(logloss, ctr),
        "calibration": torch.sigmoid(logits).mean().item() / ctr if ctr > 0 else float("nan"),
        "rows": n,
    }


def group_auc(logits: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """Group AUC (Zhou et al., DIN, KDD 2018): each group's exact AUC (as ``auc``), averaged with weights
    the groups' row counts, over the groups that hold both classes (a user with only clicks or only
    non-clicks ranks nothing). logits, labels, groups (N,) -> {gauc, groups: the groups averaged,
    rows: their rows}; gauc NaN where no group holds both classes or a logit is NaN."""
    logits, labels = logits.double().flatten(), labels.double().flatten()
    # Rows sorted by (group, logit): a row's rank within its group is its position after the rows of
    # earlier groups, ties sharing their mean rank.
    _, g = torch.unique(groups.flatten(), return_inverse=True)
    pairs, pair_of, counts = torch.unique(
        torch.stack([g.double(), logits]), dim=1, return_inverse=True, return_counts=True
    )
    ends = torch.cumsum(counts, 0).double()
    n = torch.bincount(g).double()  # rows per group
    before = (torch.cumsum(n, 0) - n)[pairs[0].long()]  # rows of earlier groups, per (group, logit) pair
    ranks = (ends - (counts.double() - 1) / 2 - before)[pair_of]
    pos = torch.zeros_like(n).index_add_(0, g, labels)
    rank_sum = torch.zeros_like(n).index_add_(0, g, ranks * labels)
    both = (pos > 0) & (pos < n)
    rows = int(n[both].sum().item())
    if rows == 0 or bool(torch.isnan(logits).any()):
        return {"gauc": float("nan"), "groups": int(both.sum().item()), "rows": rows}
    p, m = pos[both], n[both] - pos[both]
    aucs = (rank_sum[both] - p * (p + 1) / 2) / (p * m)
    return {"gauc": ((aucs * n[both]).sum() / rows).item(), "groups": int(both.sum().item()), "rows": rows}


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
        if math.isnan(m["logloss"]):
            why = "the model scored NaN (a diverged model)"
        elif math.isinf(m["logloss"]):
            why = "the model scored an infinite logit on a row of the other class (a diverged model)"
        elif math.isnan(m["calibration"]):
            none = f"none of the {rows:,} rows is" if rows != 1 else "its 1 row is not"
            why = f"{none} positive (AUC and NE need both classes, calibration a positive)"
        else:
            why = f"{'all' if rows != 1 else 'its'} {rows_are(rows)} positive (AUC and NE need both classes)"
        notes.append(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} null: {why}")
    if "gauc" in m and not math.isfinite(m["gauc"]) and math.isfinite(m["logloss"]):
        who = f"{m['gauc_by']} id" if "gauc_by" in m else "group (train.group_by)"
        notes.append(  # a group AUC needs a group holding both classes
            f"gauc is null: no {who} the run knows holds both classes here (rows of ids it never saw belong to no group)"
        )
    return "; ".join(notes) or None
