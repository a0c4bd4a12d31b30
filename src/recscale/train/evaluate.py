"""Scoring a model on a materialised split: logits on every rank, then the CTR metrics."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from recscale.data.dataset import ArrayDataset, iterate
from recscale.data.materialize import progress_bar
from recscale.data.preprocess import OOV
from recscale.data.synthetic import SyntheticSpec, bayes_logloss
from recscale.distributed.gather import eval_batches, gather_scores
from recscale.errors import DataError
from recscale.train.metrics import ctr_metrics, group_auc, normalized_entropy
from recscale.train.precision import Precision, autocast

# Evaluation needs no gradients, so it takes larger batches than training (fewer, cheaper steps).
EVAL_BATCH_SIZE = 8192


def eval_batch_size(train_batch_size: int) -> int:
    return max(train_batch_size, EVAL_BATCH_SIZE)


@torch.no_grad()  # not inference_mode: gloo collectives fail inside it
def predict(
    model: nn.Module,
    ds: ArrayDataset,
    batch_size: int,
    num_workers: int,
    precision: Precision = "fp32",
    progress: bool = False,
) -> torch.Tensor:
    """Logits (N,) for every row of ``ds`` in order, on every rank (each rank scores a slice), in
    float32 whatever the compute ``precision``; ``progress``: a bar of the rows scored (on this rank)."""
    was_training = model.training
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    batches = eval_batches(len(ds), batch_size, rank, world)
    # Each batch's scores are copied into one tensor allocated up front, not kept to be concatenated at the
    # end: the kept per-batch tensors, scattered among each batch's freed temporaries, pinned the allocator's
    # heap, and scoring 3M rows held ~3.5 GB for 12 MB of scores.
    out = torch.empty(sum(map(len, batches)), dtype=torch.float32, device=device)
    start = 0
    bar = progress_bar(progress, "scoring", total=len(out))
    with bar if bar is not None else nullcontext():
        for b in iterate(ds, batches, num_workers):
            with autocast(precision, device):
                n = len(b.labels)
                out[start : start + n] = model(b.dense.to(device), b.sparse.to(device))
            start += n
            if bar is not None:
                bar.update(n)
    model.train(was_training)
    return gather_scores(out, len(ds), batch_size, world).cpu()  # gathered on the device (NCCL)


def evaluate(
    model: nn.Module,
    ds: ArrayDataset,
    batch_size: int,
    num_workers: int,
    precision: Precision = "fp32",
    group_by: str | None = None,
) -> dict[str, float]:
    """``ctr_metrics`` of the model on ``ds``; with ``group_by`` (a single-id field) also its group AUC
    over that field's ids (gauc, gauc_groups, gauc_rows). Rows whose id is OOV (unseen in training, or
    missing) belong to no known group and are left out of it: gauc_rows says how many rows it covers."""
    return scored(predict(model, ds, batch_size, num_workers, precision), ds, group_by)


def scored(logits: torch.Tensor, ds: ArrayDataset, group_by: str | None = None) -> dict[str, float]:
    """``evaluate``'s metrics of the ``logits`` (N,) a model gave ``ds``'s rows, weighted by its row weights
    where it has them (``ctr_metrics``; the group AUC too)."""
    labels = torch.from_numpy(ds.labels().copy())
    bad = ~((labels == 0) | (labels == 1))  # the readers write no other: a damaged label.bin (NaN, 7)
    if bool(bad.any()):  # scored NaN ("a diverged model") or numbers from the damage
        row = int(bad.nonzero()[0, 0])
        raise DataError(
            f"{ds.dir / 'label.bin'}: the label of row {row} is {labels[row].item()}, not 0 or 1: the split is "
            f"damaged; delete {ds.dir} and rerun the command that wrote it (train, or data prepare for a "
            "data.prepared directory)"
        )
    weights = ds.weights()
    w = None if weights is None else torch.from_numpy(weights.copy())
    m = ctr_metrics(logits, labels, w)
    if group_by is not None:
        groups = torch.from_numpy(ds.ids(group_by))
        known = groups != OOV
        g = group_auc(logits[known], labels[known], groups[known], None if w is None else w[known])
        m |= {"gauc": g["gauc"], "gauc_groups": g["groups"], "gauc_rows": g["rows"]}
    return m


def bayes_floor(spec: SyntheticSpec, split: str, ds: ArrayDataset) -> dict[str, float]:
    """The synthetic teacher's LogLoss on ``split`` (no model can beat it) and its NE on ``ds``'s CTR."""
    floor = bayes_logloss(spec, split)
    return {"bayes_logloss": floor, "bayes_ne": normalized_entropy(floor, float(np.mean(ds.labels())))}
