"""A LoKA-style precision probe of a trained run: which linear layers can compute in a low-precision format.

On a calibration sample (rows of the run's materialised valid split, or of a file), for every
``nn.Linear`` layer and every format, with only that layer lowered (``recscale.models.quant``):

    rel_err, sqnr_db   the layer's own output error on the same inputs: a forward hook compares the
                       lowered output with the plain layer's computed from the very inputs it was given,
                       ||y_q - y|| / ||y|| and 10 log10(||y||^2 / ||y_q - y||^2)
    auc, logloss       the whole model's metrics (d_auc, d_logloss: minus the plain model's)

then a plan for one target format: layers added greedily in order of increasing individual AUC loss,
each kept only if the model with every kept layer lowered stays within ``tolerance`` AUC of the plain
model. Everything is computed in the run's own ``train.precision`` (``"precision"`` in the plan): a
bf16 run's baseline and lowered models run under bf16 autocast, as it trained and as ``recscale eval``
scores it. The plan file's ``"model.quant"`` is a ``model.quant`` config section; train with it as
``model.quant.layers="$(jq -c '."model.quant".layers' PLAN.json)"`` (JSON is YAML).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recscale.config import RunConfig
from recscale.data.batch import Batch
from recscale.data.dataset import ArrayDataset
from recscale.data.preprocess import Preprocessor
from recscale.data.readers.base import names_data
from recscale.distributed.env import own_group
from recscale.errors import DataError, RecscaleError
from recscale.io import scratch_dir
from recscale.models.base import RecModel
from recscale.models.quant import (
    FORMATS,
    QuantConfig,
    QuantLinear,
    dequantize_model,
    linear_names,
    quantize_model,
)
from recscale.train.data import prepare_split
from recscale.train.metrics import ctr_metrics
from recscale.train.precision import Precision, autocast
from recscale.train.runs import load_trained, run_config, splits_dir

DEFAULT_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8")
CHUNK = 8192  # rows per forward pass


def calibration_sample(
    run_dir: Path, cfg: RunConfig, pre: Preprocessor, data_path: str | None, rows: int
) -> list[Batch]:
    """``rows`` rows (a seeded random subset, in file order) of the run's valid split (only its selection
    rows when the run holds some out with ``data.report_fraction``: the plan is a selection decision),
    else its test split (in ``data.prepared`` for a run trained on one), or of ``data_path`` prepared as
    ``recscale eval`` prepares it; batches of ``CHUNK`` rows."""
    if data_path is None:
        root = splits_dir(run_dir, cfg, pre, "calibrate on a file with --data")
        for split in ("valid", "test"):
            if (root / split / "meta.json").is_file():
                ds = ArrayDataset(root / split)
                if split == "valid" and cfg.data.report_fraction is not None:
                    ds, _ = ds.hold_out(cfg.data.report_fraction)
                return _sample(ds, rows)
        # Synthetic data has no file to give --data (refused below): only a run with valid rows has some.
        fix = (
            "train a run with valid rows in data.synthetic.rows"
            if cfg.data.format == "synthetic"
            else "calibrate on a file with --data"
        )
        raise RecscaleError(f"{root.parent}: the run has no materialised valid split (data/valid); {fix}")
    # A file, a folder of files or a glob pattern matching some, as ``recscale eval`` takes it.
    if not names_data(data_path):
        raise DataError(f"--data {data_path}: no such file; give the file to calibrate on")
    if cfg.data.format == "synthetic":
        raise RecscaleError(f"{run_dir} was trained on synthetic data, which has no file format to read --data {data_path} with; "
                            "leave --data out to use the run's own valid split")  # fmt: skip
    with scratch_dir("recscale-probe-") as tmp:
        # The probe's metrics are unweighted: a file needs no row-weight column.
        ds, _ = prepare_split(
            cfg.data, pre, "test", data_path, Path(tmp) / "probe", progress=False, weighted=False
        )
        return _sample(ds, rows)  # gathered into memory before the files go


def _sample(ds: ArrayDataset, rows: int) -> list[Batch]:
    n = len(ds)
    idx = np.arange(n) if rows >= n else np.sort(np.random.default_rng(0).choice(n, rows, replace=False))
    return [ds.gather(idx[i : i + CHUNK]) for i in range(0, len(idx), CHUNK)]


@torch.no_grad()
def logits(module: nn.Module, batches: Sequence[Batch], precision: Precision = "fp32") -> Tensor:
    """The model's logits (N,) on the sample, in eval mode, computed in ``precision`` (float32 out)."""
    was_training = module.training
    module.eval()
    with autocast(precision, next(module.parameters()).device):
        out = torch.cat([module(b.dense, b.sparse).float() for b in batches])
    module.train(was_training)
    return out


@contextmanager
def lowered(model: nn.Module, layers: dict[str, str]) -> Iterator[dict[str, QuantLinear]]:
    """``model`` with ``layers`` ({name: format}) swapped for QuantLinear, restored on exit; yields them."""
    quantize_model(model, QuantConfig.model_validate({"layers": layers}))
    try:
        yield {n: model.get_submodule(n) for n in layers}  # type: ignore[misc]
    finally:
        dequantize_model(model)


class _OutputError:
    """Forward hook on a lowered layer: sums ||y_q - y||^2 and ||y||^2, y from the same inputs as the
    plain layer computes them (under the caller's autocast, so in the run's precision)."""

    def __init__(self) -> None:
        self.err = self.ref = 0.0

    def __call__(self, mod: nn.Linear, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        y = F.linear(inputs[0], mod.weight, mod.bias)
        self.err += (out.double() - y.double()).pow(2).sum().item()  # a bf16 difference would round
        self.ref += y.double().pow(2).sum().item()

    def result(self) -> dict[str, float | None]:
        rel = math.sqrt(self.err / self.ref) if self.ref > 0 else 0.0
        # JSON has no Infinity: an exact layer has no SQNR (None)
        sqnr = 10 * math.log10(self.ref / self.err) if self.err > 0 and self.ref > 0 else None
        return {"rel_err": rel, "sqnr_db": sqnr}


def _metrics(z: Tensor, labels: Tensor, base: dict[str, Any] | None = None) -> dict[str, Any]:
    m = ctr_metrics(z, labels)
    out: dict[str, Any] = {"auc": m["auc"], "logloss": m["logloss"]}
    if base is not None:
        out |= {"d_auc": m["auc"] - base["auc"], "d_logloss": m["logloss"] - base["logloss"]}
    return out


@own_group()
def probe(
    run_dir: Path,
    data_path: str | None = None,
    rows: int = 16384,
    formats: Sequence[str] = DEFAULT_FORMATS,
    target: str = "mxfp8_e4m3",
    tolerance: float = 5e-4,
) -> dict[str, Any]:
    """Probe a trained flat run; returns the plan (see the module docstring), ready to write as JSON."""
    run_dir = Path(run_dir)
    bad = [f for f in [*formats, target] if f not in FORMATS]
    if bad:
        raise RecscaleError(f"precision probe: unknown format {', '.join(bad)}; use {', '.join(FORMATS)}")
    if rows < 2:
        raise RecscaleError(f"precision probe: --rows {rows}; give at least a few thousand rows")
    if not tolerance >= 0:
        raise RecscaleError(f"precision probe: --tolerance {tolerance}; give an AUC drop >= 0, e.g. 0.0005")
    formats = list(dict.fromkeys([*formats, target]))
    run_config(run_dir)  # a directory that is not a run is named first
    cfg, pre, built = load_trained(run_dir, "to probe", flat_only=True)
    model = cast(RecModel, built.model)  # flat: flat_only
    # A run trained with model.quant is measured against its plain computation, in the precision it
    # trained in: a bf16 run's baseline and lowered layers are scored under bf16 autocast, as eval does.
    dequantize_model(model)
    precision = cfg.train.precision
    names = linear_names(model)
    if not names:
        raise RecscaleError(f"{run_dir}: model {cfg.model.name} has no linear layer to lower")
    batches = calibration_sample(run_dir, cfg, pre, data_path, rows)
    labels = torch.cat([b.labels for b in batches])
    if not 0 < labels.mean().item() < 1:
        # Fewer rows than asked for: the sample is the whole split or file, and more --rows add none.
        fix = "give more --rows" if len(labels) == rows else "calibrate on a --data file holding both classes"
        raise RecscaleError(f"precision probe: the {len(labels)} calibration rows hold one class only; {fix}")
    z0 = logits(built.module, batches, precision)
    baseline = _metrics(z0, labels)

    def trial(layers: dict[str, str], hook_on: str | None = None) -> tuple[Tensor, dict[str, Any]]:
        with lowered(model, layers) as q:
            hook = _OutputError()
            handle = q[hook_on].register_forward_hook(hook) if hook_on else None
            z = logits(built.module, batches, precision)
            if handle is not None:
                handle.remove()
        return z, (hook.result() if hook_on else {}) | _metrics(z, labels, baseline)

    per_layer = []
    for name in names:
        layer = model.get_submodule(name)
        for fmt in formats:
            row = {"layer": name, "shape": [layer.in_features, layer.out_features], "format": fmt}
            per_layer.append(row | trial({name: fmt}, hook_on=name)[1])
    all_layers = {}
    for fmt in formats:
        z, m = trial(dict.fromkeys(names, fmt))
        all_layers[fmt] = m | {"logit_rel_change": ((z - z0).norm() / z0.norm()).item()}

    # Greedy plan: cheapest layers first; one that breaks the tolerance with the others is left out.
    loss = {r["layer"]: baseline["auc"] - r["auc"] for r in per_layer if r["format"] == target}
    chosen: dict[str, str] = {}
    with_plan = baseline | {"d_auc": 0.0, "d_logloss": 0.0}
    for name in sorted(names, key=lambda n: (loss[n], names.index(n))):
        if loss[name] > tolerance:
            break  # alone it already costs too much, and so does every layer after it
        m = trial({**chosen, name: target})[1]
        if -m["d_auc"] <= tolerance:
            chosen[name], with_plan = target, m
    return {
        "model.quant": {"layers": {n: chosen[n] for n in names if n in chosen}},
        "target": target,
        "tolerance": tolerance,
        "precision": precision,
        "rows": len(labels),
        "baseline": baseline,
        "with_plan": with_plan,
        "all_layers": all_layers,
        "per_layer": per_layer,
    }


def table(plan: dict[str, Any]) -> str:
    """The probe as text: per layer and format, SQNR (dB) and the AUC change with that layer alone lowered."""
    formats = list(plan["all_layers"])
    precision = plan["precision"]
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for r in plan["per_layer"]:
        rows.setdefault(r["layer"], {})[r["format"]] = r
    width = max(len("layer"), *(len(n) for n in rows)) + 2
    lines = [
        f"SQNR dB / AUC change with one layer lowered ({precision} elsewhere, the run's train.precision)",
        f"{'layer':{width}s}{'in->out':>12s}  " + "".join(f"{f:>20s}" for f in formats) + "  plan",
    ]
    plan_layers = plan["model.quant"]["layers"]
    for name, per in rows.items():
        shape = "->".join(map(str, next(iter(per.values()))["shape"]))
        cells = "".join(f"{_db(per[f]['sqnr_db']):>8s} {per[f]['d_auc']:+.5f}".rjust(20) for f in formats)
        lines.append(f"{name:{width}s}{shape:>12s}  {cells}  {plan_layers.get(name, '-')}")
    every = "".join(f"{'':>8s} {plan['all_layers'][f]['d_auc']:+.5f}".rjust(20) for f in formats)
    lines.append(f"{'all layers':{width}s}{'':>12s}  {every}")
    b, w = plan["baseline"], plan["with_plan"]
    lines.append(
        f"{precision}: AUC {b['auc']:.5f}  LogLoss {b['logloss']:.5f} on {plan['rows']} rows  ·  plan: "
        f"{len(plan_layers)}/{len(rows)} layers in {plan['target']}, AUC {w['auc']:.5f} ({w['d_auc']:+.5f}), "
        f"LogLoss {w['logloss']:.5f} ({w['d_logloss']:+.5f}), tolerance {plan['tolerance']}"
    )
    return "\n".join(lines)


def _db(x: float | None) -> str:
    return "exact" if x is None else f"{x:.1f}"
