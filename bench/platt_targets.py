"""Platt scaling of one trained run's kept model, fit on its selection half with 0/1 targets (the rule before
smoothed targets) and with Platt's smoothed targets (``train.calibrate`` now): the report half's metrics under
each, beside the raw model's and what the run stored in best/.

    python bench/platt_targets.py RUN_DIR     # a run with data.report_fraction and train.calibrate
"""

import sys
from pathlib import Path

import torch

from recscale.data.dataset import ArrayDataset
from recscale.models.blocks.calibration import Calibration, platt_fit
from recscale.train.evaluate import eval_batch_size, predict
from recscale.train.metrics import ctr_metrics
from recscale.train.runs import load_trained

run = Path(sys.argv[1])
cfg, pre, built = load_trained(run)
layers = [m for m in built.module.modules() if isinstance(m, Calibration)]
stored = (layers[0].scale.item(), layers[0].bias.item())
for c in layers:
    c.set(1.0, 0.0)
sel, rep = ArrayDataset(run / "data" / "valid").hold_out(cfg.data.report_fraction)
bs = eval_batch_size(cfg.train.batch_size)
zs, zr = (predict(built.module, ds, bs, 0, cfg.train.precision).double() for ds in (sel, rep))
ys, yr = (torch.from_numpy(ds.labels().copy()).double() for ds in (sel, rep))


fits = {
    "raw": (1.0, 0.0),
    "0/1 targets (old)": platt_fit(zs, ys, smoothed=False),
    "smoothed (now)": platt_fit(zs, ys),
    "stored in best/": stored,
}
for name, (a, b) in fits.items():
    m = ctr_metrics(a * zr + b, yr)
    print(f"{name:20s} a={a:.5f} b={b:+.5f}  report AUC {m['auc']:.5f} LogLoss {m['logloss']:.5f}")
