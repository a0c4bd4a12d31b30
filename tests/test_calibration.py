"""train.calibrate: Platt scaling of the kept model, fit on the valid split, carried by the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from recscale.config import load_config
from recscale.errors import ConfigError
from recscale.models.blocks import Calibration
from recscale.train.checkpoint import load_checkpoint
from recscale.train.loop import Trainer
from recscale.train.metrics import ctr_metrics
from recscale.train.runs import eval_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = ["data.synthetic.rows={train: 4000, valid: 2000, test: 1000}", "data.synthetic.num_sparse=6",
         "data.synthetic.vocab_sizes=200", "data.num_workers=0", "train.batch_size=256", "train.progress=false",
         "model.embedding.dim=8", "train.max_steps=8", "train.eval_every=4"]  # fmt: skip


def test_fit_recovers_the_scale_and_bias_that_generated_the_labels():
    torch.manual_seed(0)
    z = torch.randn(200_000) * 2
    y = torch.bernoulli(torch.sigmoid(0.5 * z + 0.3))
    cal = Calibration()
    a, b = cal.fit(z, y)
    assert a == pytest.approx(0.5, abs=0.02) and b == pytest.approx(0.3, abs=0.02)
    assert (cal.scale.item(), cal.bias.item()) == pytest.approx((a, b))
    before, after = ctr_metrics(z, y), ctr_metrics(cal(z), y)
    assert after["auc"] == pytest.approx(before["auc"], abs=1e-6)  # a > 0: the ranking is the same
    assert after["logloss"] < before["logloss"] - 0.05  # z was over-confident by 2x


def platt_targets(y: torch.Tensor) -> torch.Tensor:
    """Platt's smoothed targets of 0/1 labels: (N+ + 1)/(N+ + 2) for a positive, 1/(N- + 2) for a negative."""
    pos = y.double().sum()
    return torch.where(y > 0.5, (pos + 1) / (pos + 2), 1 / (y.numel() - pos + 2)).double()


def platt_logloss(ab: tuple[float, float], z: torch.Tensor, y: torch.Tensor) -> float:
    return F.binary_cross_entropy_with_logits(ab[0] * z.double() + ab[1], platt_targets(y)).item()


def newton_platt(z: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The minimiser of the LogLoss of sigmoid(a z + b) against Platt's targets of y by float64 Newton
    steps, halved while they do not help."""
    x = torch.stack([z.double(), torch.ones_like(z, dtype=torch.float64)], 1)
    y, ab = platt_targets(y), torch.tensor([1.0, 0.0], dtype=torch.float64)

    def loss(v: torch.Tensor) -> float:
        return F.binary_cross_entropy_with_logits(x @ v, y).item()

    for _ in range(100):
        p = torch.sigmoid(x @ ab)
        step = torch.linalg.solve((x * (p * (1 - p))[:, None]).T @ x, x.T @ (p - y))
        if step.abs().max() < 1e-12:
            break
        t = 1.0
        while loss(ab - t * step) > loss(ab) and t > 1e-6:
            t /= 2
        ab = ab - t * step
    return ab[0].item(), ab[1].item()


@pytest.mark.parametrize(("spread", "centre", "a", "b"), [(8.0, 0.0, 0.2, -4.0), (0.05, 3.0, 3.0, -10.0)])
def test_fit_is_the_logloss_minimiser(spread, centre, a, b):
    """Logits 5x too confident at a ~4% click rate, and logits nearly constant (a and b almost
    collinear): the fit is the float64 Newton solution, to within the LogLoss's rounding."""
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(20_000, generator=gen) * spread + centre
    y = torch.bernoulli(torch.sigmoid(a * z + b), generator=gen)
    fit, ref = Calibration().fit(z, y), newton_platt(z, y)
    assert platt_logloss(fit, z, y) == pytest.approx(platt_logloss(ref, z, y), abs=1e-12)
    assert fit == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("n", [200, 5000])
def test_separable_rows_get_a_finite_fit(n):
    """Logits that separate valid's classes perfectly: against 0/1 labels the LogLoss falls without end
    as a grows, and L-BFGS stopped at a ~ 700 (every score then 0 or 1). Platt's smoothed targets have a
    finite minimiser, the Newton solution."""
    z = torch.linspace(-3, 3, n)
    y = (z > 0.5).double()
    fit = Calibration().fit(z, y)
    assert 0 < fit[0] < 50  # grows as log N: the targets of more rows are nearer 0 and 1
    ref = newton_platt(z, y)
    assert platt_logloss(fit, z, y) == pytest.approx(platt_logloss(ref, z, y), abs=1e-10)
    assert fit == pytest.approx(ref, rel=1e-3)


def test_a_reversed_ranking_keeps_the_identity():
    z = torch.linspace(-3, 3, 1000)
    a, b = Calibration().fit(z, (z < 0).double())
    assert (a, b) == (1.0, 0.0)


def test_trainer_calibrates_the_kept_model_and_eval_applies_it(tmp_path):
    tr = Trainer(load_config(CONFIGS / "demo.yaml", [*SMALL, "train.calibrate=true"]), tmp_path / "r")
    report = tr.fit()
    cal = report["calibration"]
    assert cal["rows"] == 2000 and cal["scale"] != 1.0
    # Fit by LogLoss with a free bias: the mean probability on valid equals the click rate there.
    assert report["valid"]["calibration"] == pytest.approx(1.0, abs=2e-3)
    # best/ holds the fitted numbers, and a fresh load (recscale eval) scores the calibrated model.
    state = {"calibration.scale": torch.zeros(()), "calibration.bias": torch.zeros(())}
    load_checkpoint(tmp_path / "r" / "best", {"model": state})
    assert (state["calibration.scale"].item(), state["calibration.bias"].item()) == pytest.approx(
        (cal["scale"], cal["bias"])
    )
    again = eval_run(tmp_path / "r", None, split="valid")
    assert again["logloss"] == pytest.approx(report["valid"]["logloss"], rel=1e-6)


def test_calibrate_without_a_valid_split_is_a_config_error():
    with pytest.raises(ConfigError, match="train.calibrate fits on the valid split"):
        load_config(CONFIGS / "frappe.yaml", ["train.calibrate=true", "data.valid=null"])


def test_a_checkpoint_from_before_calibration_loads_with_the_identity(tmp_path):
    """Checkpoints written before models had calibration buffers still load (resume, eval, export): the
    buffers keep the model's identity; any other missing entry is still an error."""
    from recscale.errors import CheckpointError
    from recscale.train.checkpoint import save_checkpoint

    old = {"w": torch.arange(4.0), "calibration.scale": torch.ones(()), "calibration.bias": torch.zeros(())}
    save_checkpoint(tmp_path / "old", {"model": {"w": old["w"]}}, rank=0)
    now = {"w": torch.zeros(4), "calibration.scale": torch.ones(()), "calibration.bias": torch.zeros(())}
    load_checkpoint(tmp_path / "old", {"model": now})
    assert torch.equal(now["w"], old["w"]) and now["calibration.scale"].item() == 1.0
    with pytest.raises(CheckpointError, match="could not be read"):
        load_checkpoint(tmp_path / "old", {"model": {**now, "v": torch.zeros(2)}})


def test_a_resumed_run_without_early_stopping_calibrates_its_final_weights(tmp_path):
    """Without early stopping the report scores the last weights; best/ holds only the calibrated model an
    earlier finish wrote, so a resume that trains on must calibrate and report its own final weights."""
    run = tmp_path / "r"
    plain = [*SMALL, "train.calibrate=true", "train.early_stopping=null"]
    first = Trainer(load_config(CONFIGS / "demo.yaml", plain), run).fit()
    longer = load_config(CONFIGS / "demo.yaml", [*plain, "train.max_steps=16"])
    report = Trainer(longer, run, resume=True).fit()
    assert report["steps"] == 16
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["split"] == "valid" and last["step"] == 16
    assert report["valid"]["auc"] == pytest.approx(last["auc"], abs=1e-6)  # calibration keeps the ranking
    assert report["valid"]["auc"] != pytest.approx(first["valid"]["auc"], abs=1e-6)
    assert eval_run(run, None, split="valid")["logloss"] == pytest.approx(
        report["valid"]["logloss"], rel=1e-6
    )


def test_restoring_a_calibrated_best_trains_on_without_the_calibration(tmp_path):
    """A resumed run that goes back to best/ (restore_best) after a calibrating finish keeps training the
    uncalibrated model: the checkpoint written right after the restore has the identity scaling."""
    run = tmp_path / "r"
    es = "train.early_stopping={metric: logloss, patience: 10, min_delta: 1.0, restore_best: true}"
    plain = [*SMALL, "train.calibrate=true", es]
    assert Trainer(load_config(CONFIGS / "demo.yaml", plain), run).fit()["calibration"]["scale"] != 1.0
    longer = load_config(CONFIGS / "demo.yaml", [*plain, "train.max_steps=16", "train.keep_checkpoints=9"])
    Trainer(longer, run, resume=True).fit()  # no evaluation improves by 1.0: step 12 goes back to best/
    state = {"calibration.scale": torch.zeros(()), "calibration.bias": torch.zeros(())}
    load_checkpoint(run / "ckpt" / "step_00000012", {"model": state})
    assert (state["calibration.scale"].item(), state["calibration.bias"].item()) == (1.0, 0.0)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_labels_of_one_class_keep_the_identity(label):
    """A valid split of one class has no finite Platt fit: L-BFGS stopped somewhere along b -> +inf and
    the model then scored every row near 1 (all positive); all negative kept the identity by chance."""
    z = torch.randn(500, generator=torch.Generator().manual_seed(0))
    cal = Calibration()
    assert cal.fit(z, torch.full((500,), label)) == (1.0, 0.0)
    assert torch.equal(cal(z), z)
