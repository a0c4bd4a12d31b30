"""Scaling sweeps (restartable, one CSV row per run) and the power-law fit."""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from recscale.cli import main
from recscale.errors import RecscaleError
from recscale.scaling import sweep as sweep_mod
from recscale.scaling.fit import FamilyRuns, fit_power_law, load_results, report
from recscale.scaling.sweep import COLUMNS, load_sweep, run_sweep
from recscale.train.loop import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = [
    "data.synthetic.rows={train: 1024, valid: 256, test: 256}",
    "data.synthetic.num_sparse=4",
    "data.synthetic.num_multi=1",
    "data.synthetic.vocab_sizes=50",
    "data.num_workers=0",
    "train.batch_size=128",
    "train.progress=false",
    "model.embedding.dim=8",
]


def write_sweep(tmp_path: Path, families: dict) -> Path:
    path = tmp_path / "sweep.yaml"
    spec = {
        "base": str(CONFIGS / "demo.yaml"),
        "overrides": TINY,
        "out": str(tmp_path / "out"),
        "families": families,
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


FAMILIES = {
    "wukong": {"model": {"name": "wukong", "k": 4}, "sizes": [{"num_layers": 1, "n_f": 4, "n_l": 4}]},
    "dlrm": {"model": {"name": "dlrm"}, "grid": {"top_mlp": [[16], [64, 32]]}},
}


def write_results(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_writes_one_row_per_run_and_skips_finished_runs(tmp_path, monkeypatch):
    path = write_sweep(tmp_path, FAMILIES)
    results = run_sweep(path, log=lambda _: None)
    rows = read_csv(results)
    assert list(rows[0]) == COLUMNS
    assert [r["family"] for r in rows] == ["wukong", "dlrm", "dlrm"]
    assert len({r["run"] for r in rows}) == 3
    for r in rows:
        assert int(r["examples"]) == 1024  # exactly one pass over the training rows
        assert float(r["train_flops"]) == pytest.approx(3 * float(r["gflop_per_example"]) * 1e9 * 1024)
        assert int(r["dense_params"]) > 0 and int(r["sparse_params"]) > 0
        assert 0 < float(r["bayes_logloss"]) < float(r["valid_logloss"]) < 1.0
        assert float(r["wall_s"]) >= float(r["train_s"]) > 0
    small, large = rows[1:]
    assert float(large["gflop_per_example"]) > float(small["gflop_per_example"])
    assert json.loads(large["knobs"]) == {"top_mlp": [64, 32]}

    # A restart trains only the run whose result is missing (as if it had been killed).
    run_dirs = sorted((tmp_path / "out" / "runs").iterdir())
    killed = next(d for d in run_dirs if d.name == rows[2]["run"])
    (killed / "result.json").unlink()
    trained = []
    real_train = sweep_mod._train
    monkeypatch.setattr(sweep_mod, "_train", lambda run, *a: trained.append(run.name) or real_train(run, *a))
    log: list[str] = []
    run_sweep(path, log=log.append)
    assert trained == [killed.name]
    assert sum("skipped" in line for line in log) == 2
    again = read_csv(results)
    assert [r["run"] for r in again] == [r["run"] for r in rows]
    assert again[:2] == rows[:2]
    # The data was materialised once and shared by all runs.
    assert len(list((tmp_path / "out" / "data").iterdir())) == 1


def test_sweep_config_errors_are_one_line(tmp_path, capsys):
    bad_key = write_sweep(tmp_path, {"wukong": {"model": {"name": "wukong"}, "sizez": [{}]}})
    assert main(["sweep", str(bad_key)]) == 2
    err = capsys.readouterr().err
    assert "families.wukong.sizez" in err and len(err.strip().splitlines()) == 1
    typo = write_sweep(tmp_path, {"lr": {"model": {"name": "lr"}, "sizes": [{}]}})
    typo.write_text(typo.read_text().replace("overrides:", "overides:"))
    assert main(["sweep", str(typo)]) == 2
    assert (
        "overides: unknown key (check the spelling; see configs/ for examples); did you mean overrides?"
        in (capsys.readouterr().err)
    )
    bad_size = write_sweep(tmp_path, {"wukong": {"model": {"name": "wukong"}, "sizes": [{"n_f": 0}]}})
    assert main(["sweep", str(bad_size)]) == 2
    err = capsys.readouterr().err
    assert "family wukong" in err and "n_f" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(RecscaleError, match="sizes"):
        load_sweep(write_sweep(tmp_path, {"dlrm": {"model": {"name": "dlrm"}}}))
    # A family's overrides came after the sweep's one epoch and could undo it without a word.
    epochs = {"lr": {"model": {"name": "lr"}, "sizes": [{}], "overrides": ["train.epochs=3"]}}
    with pytest.raises(
        RecscaleError, match="family lr's overrides set 'train.epochs=3'; every sweep run trains one"
    ):
        load_sweep(write_sweep(tmp_path, epochs))


def test_size_keys_set_list_items_and_bad_ones_are_one_line(tmp_path, capsys):
    """A size key into a list (top_mlp.0) was 'internal error TypeError: list indices must be integers',
    one under a number (embedding.dim.x) 'internal error TypeError: 'int' object does not support item
    assignment'. A list item is now set by its index, on a copy: the family's list stays for its other sizes."""
    dlrm = {"model": {"name": "dlrm", "top_mlp": [64, 32]}, "sizes": [{"top_mlp.0": 128}, {"top_mlp.1": 16}]}
    _, runs = load_sweep(write_sweep(tmp_path, {"d": dlrm}))
    assert [r.config.model.params.top_mlp for r in runs] == [[128, 32], [64, 16]]
    path = write_sweep(tmp_path, {"d": {"model": {"name": "dlrm"}, "sizes": [{"embedding.dim.x": 8}]}})
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {path}: family d, size 1 {{'embedding.dim.x': 8}}: model key 'embedding.dim.x': embedding.dim "
        "is 8, which has no keys; set it whole\n"
    )


def test_a_familys_model_section_merges_key_by_key(tmp_path):
    """A family's model: {embedding: {init_std: ...}} replaced the whole model.embedding that the base and
    the sweep's overrides gave: model.embedding.dim=8 (TINY) was dropped for the default 16 without a word."""
    dlrm = {"model": {"name": "dlrm", "embedding": {"init_std": 0.01}}, "sizes": [{"top_mlp": [16]}]}
    (run,) = load_sweep(write_sweep(tmp_path, {"d": dlrm}))[1]
    assert (run.config.model.embedding.dim, run.config.model.embedding.init_std) == (8, 0.01)


def test_max_steps_with_a_familys_lengths_is_refused(tmp_path):
    """Each length sets its runs' steps: a train.max_steps of the sweep's overrides was replaced without a word."""
    path = tmp_path / "s.yaml"
    write_sweep(tmp_path, LENGTHS)
    spec = yaml.safe_load((tmp_path / "sweep.yaml").read_text())
    path.write_text(yaml.safe_dump({**spec, "overrides": [*spec["overrides"], "train.max_steps=3"]}))
    with pytest.raises(RecscaleError, match=r"length 512 sets each run's steps .* train.max_steps is 3"):
        load_sweep(path)


@pytest.mark.parametrize(
    ("family", "key"),
    [
        ({"model": {"name": "dlrm", "dropout": 0.2}, "overrides": ["model.dropout=0.1"]}, "model.dropout"),
        ({"model": {"name": "dlrm"}, "overrides": ["model.top_mlp=[8]"]}, "model.top_mlp"),
    ],
)
def test_a_family_override_its_model_section_or_sizes_replace_is_refused(tmp_path, family, key):
    """A family's overrides apply before its model section and sizes: model.dropout=0.1 beside model:
    {dropout: 0.2} trained 0.2 without a word."""
    sweep = write_sweep(tmp_path, {"d": {**family, "sizes": [{"top_mlp": [16]}]}})
    with pytest.raises(
        RecscaleError, match=rf"family d, size 1 .*override '{key}=.*' is replaced .* set {key}"
    ):
        load_sweep(sweep)
    ok = {"model": {"name": "dlrm"}, "overrides": ["model.dropout=0.1"], "sizes": [{"top_mlp": [16]}]}
    (run,) = load_sweep(write_sweep(tmp_path, {"d": ok}))[1]
    assert run.config.model.params.dropout == 0.1


def test_two_families_naming_one_run_are_refused_as_such(tmp_path):
    """Family dlrm-top_mlp64's size {} and dlrm's {top_mlp: [64]} are both run dlrm-top_mlp64: the error said
    the first family listed its size twice."""
    families = {
        "dlrm-top_mlp64": {"model": {"name": "dlrm"}, "sizes": [{}]},
        "dlrm": {"model": {"name": "dlrm"}, "sizes": [{"top_mlp": [64]}]},
    }
    with pytest.raises(
        RecscaleError, match=r"family dlrm's size .* and family dlrm-top_mlp64's size \{\} would"
    ):
        load_sweep(write_sweep(tmp_path, families))
    with pytest.raises(RecscaleError, match=r"family d lists the size \{\} twice"):
        load_sweep(write_sweep(tmp_path, {"d": {"model": {"name": "dlrm"}, "sizes": [{}, {}]}}))


def test_a_family_listed_twice_is_refused(tmp_path, capsys):
    """YAML's last key won: the first `wukong` family was dropped and its name trained the second's model."""
    path = tmp_path / "sweep.yaml"
    path.write_text(
        f"base: {CONFIGS / 'demo.yaml'}\nfamilies:\n  wukong: {{model: {{name: wukong}}, sizes: [{{}}]}}\n"
        "  wukong: {model: {name: dlrm}, sizes: [{}]}\n"
    )
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:3: not valid YAML (key 'wukong' repeats the one on line 3" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("result", "words"),
    [
        (b'{"family": "wu', "holds a result.json but cannot be read back (Unterminated string"),
        (b"\xff", "holds a result.json but cannot be read back ('utf-8' codec"),
        (b"[1, 2]", "result.json: not a sweep run's result"),  # was AttributeError: an internal error
        (b"{}", "result.json: not a sweep run's result"),  # was a blank row in results.csv
        (
            b'{"family": "lr", "run": "r", "train_flops": 1, "valid_logloss": 0.5, "x": 1}',
            "not a sweep run's",
        ),
    ],
)
def test_a_finished_run_whose_result_is_unreadable_is_one_line(tmp_path, capsys, monkeypatch, result, words):
    path = write_sweep(tmp_path, {"lr": {"model": {"name": "lr"}, "sizes": [{}]}})
    (run,) = load_sweep(path)[1]
    run_dir = tmp_path / "out" / "runs" / run.name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(run.config.to_yaml())
    (run_dir / "result.json").write_bytes(result)
    monkeypatch.setattr(sweep_mod, "_train", lambda *a: pytest.fail("a finished run was trained again"))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.rstrip().endswith("remove that directory (the sweep trains it again) or give "
                                                  "the sweep another out"), err  # fmt: skip
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out" / "results.csv").exists()


@pytest.mark.parametrize("family", ["..", ".", "+", "", "a/b", "-x"])
def test_family_names_that_would_escape_the_runs_directory_are_refused(tmp_path, capsys, family):
    """A family's name starts its runs' directory names, which a restarted sweep removes: `..` would have
    removed the sweep's whole out directory, `+` (slugged to nothing) every other run."""
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "keep.txt").write_text("a user's file")
    path = write_sweep(tmp_path, {family: {"model": {"name": "lr"}, "sizes": [{}]}})
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"family name {family!r}" in err and len(err.strip().splitlines()) == 1
    assert (out / "keep.txt").is_file() and (out / "runs").is_dir()


def test_sweep_presets_validate():
    for name in ("small", "full", "medium"):
        _, runs = load_sweep(CONFIGS / "sweeps" / f"{name}.yaml")
        families = {r.family for r in runs}
        assert families == {"wukong", "dlrm", "dcnv2"}
        assert all(r.config.train.epochs == 1 for r in runs)


def power_law_points(rng: np.random.Generator, noise: float) -> tuple[np.ndarray, np.ndarray]:
    compute = np.geomspace(1e12, 1e15, 8)
    loss = 0.40 + 0.05 * (compute / 1e12) ** -0.5 + noise * rng.standard_normal(8)
    return compute, loss


def test_fit_recovers_a_known_power_law():
    rng = np.random.default_rng(0)
    fit = fit_power_law(*power_law_points(rng, 0.0))
    assert (fit.l_inf, fit.a_c0, fit.b) == pytest.approx((0.40, 0.05, 0.5), rel=1e-5)
    assert fit.a == pytest.approx(0.05 * 1e12**0.5, rel=1e-4)
    noisy = fit_power_law(*power_law_points(rng, 2e-4))
    for value, (lo, hi), truth in ((noisy.l_inf, noisy.l_inf_ci, 0.40), (noisy.b, noisy.b_ci, 0.5)):
        assert lo < truth < hi and lo < value < hi
    assert noisy.b_ci[1] - noisy.b_ci[0] < 0.3  # the interval says something


def test_fit_keeps_the_asymptote_at_or_above_the_floor(tmp_path):
    """Flat, noisy losses: unconstrained, L_inf runs far below any achievable loss; pinned, it sits on the
    floor and the decay is fitted on the remaining two parameters."""
    compute = np.geomspace(1e11, 1e13, 5)
    loss = np.array([0.4772, 0.4805, 0.4771, 0.4711, 0.4702])  # a one-pass sweep's shape
    assert fit_power_law(compute, loss, floor=-math.inf).l_inf < 0
    fit = fit_power_law(compute, loss, floor=0.38)
    assert fit.at_floor and fit.l_inf == 0.38 and fit.l_inf_ci == (0.38, 0.38)
    assert fit.b > 0 and fit.b_ci[0] < fit.b < fit.b_ci[1]
    assert not fit_power_law(*power_law_points(np.random.default_rng(0), 0.0), floor=0.38).at_floor
    # The report says the floor held the fit, not that it was pinned (no --pin-floor was given).
    rows = [{"family": "w", "train_flops": c, "valid_logloss": y, "bayes_logloss": 0.38}
            for c, y in zip(compute, loss, strict=True)]  # fmt: skip
    text, _ = report(load_results(write_results(tmp_path / "results.csv", rows)))
    assert "L_inf 0.38 (held at the floor: the free fit went below it)" in text and "pinned" not in text


def test_fit_pins_the_asymptote_to_the_floor_when_asked():
    """A law whose true asymptote is above the floor: the free fit finds it; pinned to the floor, L_inf is
    the floor and the decay of the reducible loss is fitted on (a, b) alone, so it differs."""
    compute, loss = power_law_points(np.random.default_rng(0), 0.0)  # L_inf 0.40, a 0.05, b 0.5
    free = fit_power_law(compute, loss, floor=0.38)
    pinned = fit_power_law(compute, loss, floor=0.38, pin_floor=True)
    assert not free.at_floor and free.l_inf == pytest.approx(0.40, rel=1e-5)
    assert pinned.at_floor and pinned.l_inf == 0.38 and pinned.l_inf_ci == (0.38, 0.38)
    assert pinned.b < free.b and pinned.b_ci[0] < pinned.b < pinned.b_ci[1]
    # Exact reducible-loss data are recovered exactly when pinned at their own floor.
    exact = 0.38 + 0.07 * (compute / compute[0]) ** -0.3
    fit = fit_power_law(compute, exact, floor=0.38, pin_floor=True)
    assert (fit.a_c0, fit.b) == pytest.approx((0.07, 0.3), rel=1e-5)
    # A family without one known floor is fitted free under --pin-floor: the report says so for that family
    # (the header's "pinned" alone claimed it for every fit).
    text, fits = report(
        [FamilyRuns("w", compute, loss, None), FamilyRuns("d", compute, exact, 0.38)], pin_floor=True
    )
    note = "no one Bayes floor in its runs' bayes_logloss (blank, or differing between runs): L_inf fitted, not pinned"
    assert f"w: {note}" in text and f"d: {note}" not in text
    assert not fits["w"].at_floor and fits["d"].at_floor


def test_fit_reports_a_family_that_saturates_at_once():
    """The small sweep's DLRM: one step down after the smallest model, then flat. The best fit is a step
    (b in the tens), whose coefficient for C in FLOPs, a_C0 * C0^b, overflows a float: inf, not a crash."""
    compute = np.array([5.56e11, 2.06e12, 5.11e12, 1.40e13, 4.34e13])
    loss = np.array([0.47715, 0.47037, 0.47377, 0.47281, 0.47157])
    fit = fit_power_law(compute, loss, floor=0.38)
    assert fit.b > 10 and fit.a == math.inf
    # Its compute-optimal frontier is the first two sizes: too few points for a law, and the report says so.
    text, fits = report([FamilyRuns("dlrm", compute, loss, 0.38)])
    assert "dlrm: frontier 2 of 5 points" in text and "dlrm: not fitted" in text and not fits


def test_fit_needs_four_distinct_computes():
    with pytest.raises(RecscaleError, match="at least 4"):
        fit_power_law(np.array([1e9, 1e10, 1e11, 1e11]), np.array([0.5, 0.45, 0.44, 0.44]))


def test_scaling_fit_cli_reports_and_plots(tmp_path, capsys):
    rng = np.random.default_rng(1)
    compute, loss = power_law_points(rng, 1e-4)
    rows = [{"family": "wukong", "train_flops": c, "valid_logloss": y, "bayes_logloss": 0.39}
            for c, y in zip(compute, loss, strict=True)]  # fmt: skip
    rows += [{"family": "dlrm", "train_flops": c, "valid_logloss": y, "bayes_logloss": 0.39}
             for c, y in ((1e12, 0.46), (1e13, 0.455))]  # fmt: skip
    results = write_results(tmp_path / "results.csv", rows)
    png = tmp_path / "plot" / "scaling.png"
    assert main(["scaling", "fit", str(results), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "wukong: 8 frontier points" in out and "dlrm: not fitted" in out and "Bayes floor" in out
    assert "-1.09%" in out  # dlrm's larger model: (0.455 - 0.46) / 0.46
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, fits = report(load_results(results))
    assert fits["wukong"].b == pytest.approx(0.5, abs=0.1)
    assert main(["scaling", "fit", str(results), "--pin-floor"]) == 0
    assert "wukong: 8 frontier points  L_inf 0.39 (pinned to the floor)" in capsys.readouterr().out
    assert main(["scaling", "fit", str(tmp_path / "nope.csv")]) == 2


def test_scaling_fit_refuses_an_out_over_its_results(tmp_path, capsys):
    """--out RESULTS wrote the PNG over the results file just fitted; --out a directory failed after the fit."""
    rows = [{"family": "wukong", "train_flops": 1e9, "valid_logloss": 0.5, "bayes_logloss": 0.39}]
    results = write_results(tmp_path / "results.csv", rows)
    before = results.read_bytes()
    for out, says in [(results, "is a results file being fitted; name another file to write"),
                      (tmp_path, "is a directory; name the PNG to write")]:  # fmt: skip
        assert main(["scaling", "fit", str(results), "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"error: --out {out} {says}\n"
    assert results.read_bytes() == before


def test_every_family_of_a_plot_has_its_own_style(tmp_path, monkeypatch):
    """The plot coloured family i with C{i}, which matplotlib wraps after 10: the 11th and 12th families
    looked like the 1st and 2nd. Colour and marker together tell 12 apart, on both panels."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from recscale.scaling.fit import PowerLawFit
    from recscale.scaling.plot import plot_scaling

    compute = np.array([1e12, 1e13, 1e14])
    families = [FamilyRuns(f"f{i}", compute, np.array([0.5, 0.45, 0.44]) + i / 100, None) for i in range(12)]
    nan2 = (math.nan, math.nan)
    fits = {
        f.name: PowerLawFit(0.4 + i / 100, 0.1, 0.3, 1e12, nan2, nan2, nan2, 0.0, 3)
        for i, f in enumerate(families)
    }
    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig) or real_close(fig))
    plot_scaling(families, fits, tmp_path / "p.png")
    left, right = figures[0].axes
    for panel, suffix in ((left, " frontier"), (right, "")):
        styles = {
            line.get_label(): (to_hex(line.get_color()), line.get_marker())
            for line in panel.get_lines()
            if line.get_label() in {f.name + suffix for f in families}
        }
        assert len(styles) == 12 and len(set(styles.values())) == 12, styles


def test_frontier_is_the_envelope_over_sizes_and_lengths():
    """Hand-made points of two sizes at three lengths: the frontier keeps each point that beats every
    cheaper one, so the small model's long run (undertrained big one beats it) is dropped."""
    compute = np.array([1.0, 2.0, 4.0, 4.0, 8.0, 16.0])
    loss = np.array([0.50, 0.47, 0.46, 0.48, 0.44, 0.43])  # small: 1, 2, 4; big: 4, 8, 16
    fam = FamilyRuns("wukong", compute, loss, None)
    assert fam.frontier().tolist() == [0, 1, 2, 4, 5]
    assert FamilyRuns(
        "x", np.array([1.0, 2.0, 3.0]), np.array([0.4, 0.5, 0.4]), None
    ).frontier().tolist() == [0]


def test_results_average_the_seeds_of_a_point(tmp_path):
    results = tmp_path / "results.csv"
    rows = [
        {"family": "w", "point": p, "train_flops": c, "valid_logloss": y, "bayes_logloss": 0.3}
        for p, c, y in (
            ("a", 1e12, 0.50),
            ("a", 1e12, 0.52),
            ("b", 2e12, 0.47),
            ("b", 2e12, 0.45),
            ("b", 2e12, 0.46),
        )
    ]
    (fam,) = load_results(write_results(results, rows))
    assert fam.compute.tolist() == [1e12, 2e12] and fam.loss == pytest.approx([0.51, 0.46])
    assert fam.seeds.tolist() == [2, 3] and len(fam.run_loss) == 5


def sweep_row(family: str, knobs: str, examples: int, seed: int, flops: float, loss: float) -> dict:
    # The floor as sweeps at other thread counts compute it: equal to ~1e-10.
    floor = 0.38 if examples < 1600 else 0.38 + 5e-11
    return {"family": family, "point": f"{family}-{knobs}-n{examples}", "seed": seed, "model": "wukong",
            "knobs": knobs, "examples": examples, "train_flops": flops, "valid_logloss": loss,
            "bayes_logloss": floor}  # fmt: skip


def test_results_of_several_sweeps_merge_into_one_family(tmp_path, capsys):
    """A later sweep adds a length (family ``w_long``) and repeats one run of the first: merged, the
    repeat counts once, the same size at one length is one point whatever its family was called, and
    dropped families are left out."""
    first = write_results(tmp_path / "a.csv", [
        sweep_row("w", "s", 100, 0, 1e12, 0.50), sweep_row("w", "s", 100, 1, 1e12, 0.52),
        sweep_row("w", "s", 400, 0, 4e12, 0.46), sweep_row("w_lr", "s", 100, 0, 1e12, 0.70),
    ])  # fmt: skip
    later = write_results(tmp_path / "b.csv", [
        sweep_row("w_long", "s", 400, 0, 4e12, 0.46), sweep_row("w_long", "s", 400, 1, 4e12, 0.44),
        sweep_row("w_long", "s", 1600, 0, 16e12, 0.42),
    ])  # fmt: skip
    (fam,) = load_results([first, later], merge={"w_long": "w"}, drop=["w_l?"])
    assert fam.name == "w" and fam.compute.tolist() == [1e12, 4e12, 16e12] and fam.bayes == 0.38
    assert fam.loss == pytest.approx([0.51, 0.45, 0.42]) and fam.seeds.tolist() == [2, 2, 1]
    assert [f.name for f in load_results([first, later])] == ["w", "w_lr", "w_long"]
    assert main(["scaling", "fit", str(first), str(later), "--merge", "w=w_long", "--drop", "w_lr"]) == 0
    assert "w: frontier 3 of 3 points, 1-2 seeds per point," in capsys.readouterr().out
    off = write_results(tmp_path / "off.csv", [
        sweep_row("w", "s", 100, 0, 1e12, 0.50), sweep_row("w", "s", 100, 1, 1e12, 0.52),
        sweep_row("w", "t", 100, 0, 2e12, 0.60),  # beaten by a cheaper point: off the frontier
    ])  # fmt: skip
    assert main(["scaling", "fit", str(off)]) == 0
    assert "w: frontier 1 of 2 points, 1-2 seeds per point (2-2 on the frontier)" in capsys.readouterr().out
    assert main(["scaling", "fit", str(first), "--merge", "w_long"]) == 2
    assert "--merge w_long: write NEW=OLD" in capsys.readouterr().err
    assert main(["scaling", "fit", str(first), "--drop", "*"]) == 2
    # a misspelled family to merge is named, not silently fitted apart
    assert main(["scaling", "fit", str(first), str(later), "--merge", "w=w_lnog"]) == 2
    err = capsys.readouterr().err
    assert "--merge: family 'w_lnog' is in none of the results" in err and "w, w_lr, w_long" in err, err
    # one family merged into two: the last --merge won without a word
    assert (
        main(["scaling", "fit", str(first), str(later), "--merge", "w=w_long", "--merge", "x=w_lr,w_long"])
        == 2
    )
    err = capsys.readouterr().err
    assert "--merge: family 'w_long' is merged into both 'w' and 'x'; merge it into one" in err, err
    clash = write_results(tmp_path / "c.csv", [sweep_row("w", "s", 100, 0, 1e12, 0.49)])
    with pytest.raises(
        RecscaleError, match="c.csv: run w-s-n100 is also in .*a.csv with another valid_logloss"
    ):
        load_results([first, clash])


HEADER = "family,run,train_flops,valid_logloss,bayes_logloss\n"
GOOD = "w,w-0,1e12,0.5,0.38\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEADER + GOOD + "w,w-1,2e12,abc,0.38\n", ":3: column valid_logloss is not a number >= 0 ('abc')"),
        (HEADER + GOOD + "w,w-1,2e12\n", ":3: 3 cells where the header has 5"),
        (HEADER + GOOD + "w,w-1,2e12,0.4,0.38,x\n", ":3: 6 cells where the header has 5"),
        (HEADER + GOOD + "w,w-\xe9,2e12,0.4,0.38\n", ":3: not UTF-8 text (byte 0xe9"),  # written as Latin-1
        (HEADER + "w,w-1,,0.4,0.38\n", ":2: column train_flops is not a finite number > 0 ('')"),
        (HEADER + "w,w-1,inf,0.4,0.38\n", ":2: column train_flops is not a finite number > 0 ('inf')"),
        # Compute 0 was a numpy warning and "nan orders of magnitude"; below 0, a frontier at -5 FLOPs.
        (HEADER + GOOD + "w,w-2,0,0.4,0.38\n", ":3: column train_flops is not a finite number > 0 ('0')"),
        (HEADER + "w,w-1,-5,0.4,0.38\n", ":2: column train_flops is not a finite number > 0 ('-5')"),
        (HEADER + "w,w-1,1e12,-0.4,0.38\n", ":2: column valid_logloss is not a number >= 0 ('-0.4')"),
        (HEADER + "w,w-1,1e12,0.4,n/a\n", ":2: column bayes_logloss is not a number >= 0 ('n/a')"),
        (HEADER + ",w-1,1e12,0.4,0.38\n", ":2: column family is empty"),
        ("", ": not a sweep results CSV (needs the columns"),
        (HEADER, ": no runs, only a header"),
        ("family,run,valid_logloss\nw,w-1,0.4\n", ": not a sweep results CSV (needs the columns"),
    ],
    ids=[
        "not-a-number",
        "short-row",
        "long-row",
        "not-utf8",
        "blank-flops",
        "inf-flops",
        "zero-flops",
        "negative-flops",
        "negative-logloss",
        "bad-floor",
        "no-family",
        "empty-file",
        "header-only",
        "missing-column",
    ],
)
def test_malformed_results_are_one_line_errors(tmp_path, capsys, text, message):
    """A bad cell, a short or long row, a file that is not UTF-8: one line naming the file and line."""
    path = tmp_path / "results.csv"
    path.write_bytes(text.encode("latin-1"))
    assert main(["scaling", "fit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert f"{path}{message}" in err


def test_a_drop_pattern_that_matches_nothing_is_a_warning(tmp_path):
    """A misspelled --drop fitted the family meant to be left out, without a word."""
    path = tmp_path / "results.csv"
    path.write_text(HEADER + GOOD + "d,d-0,1e12,0.5,0.38\n")
    with pytest.warns(
        UserWarning, match=r"^--drop wukng\*: matches none of the results' families \(w, d\); nothing"
    ):
        families = load_results(path, drop=["wukng*", "d"])
    assert [f.name for f in families] == ["w"]


def test_a_results_file_given_twice_is_refused(tmp_path, capsys, monkeypatch):
    """Its rows, without knobs, examples and seed, counted twice: "2-2 seeds per point" of one run each."""
    path = tmp_path / "results.csv"
    path.write_text(HEADER + GOOD)
    monkeypatch.chdir(tmp_path)
    assert main(["scaling", "fit", str(path), "results.csv"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: results.csv: the same results file as {path}, given twice; give it once\n"


def test_diverged_runs_are_left_out_of_the_fit(tmp_path, capsys):
    """A run with a nan or inf LogLoss diverged: the fit leaves it out and says so, instead of a nan mean
    (or a crash) for its point and family; a family left with no runs is dropped, with a note."""
    compute, loss = power_law_points(np.random.default_rng(0), 0.0)
    rows = [sweep_row("w", f"s{i}", 100, 0, c, y) for i, (c, y) in enumerate(zip(compute, loss, strict=True))]
    rows += [sweep_row("w", "s0", 100, 1, compute[0], math.nan)]  # the smallest model's second seed
    rows += [sweep_row("d", "s0", 100, 0, 1e12, math.inf)]  # a family whose only run diverged
    results = write_results(tmp_path / "results.csv", rows)
    assert main(["scaling", "fit", str(results)]) == 0
    out = capsys.readouterr().out
    assert "w: left out 1 run with a non-finite valid_logloss (diverged): w-s0-n100\n" in out
    assert "d: dropped, every run has a non-finite valid_logloss (diverged): d-s0-n100\n" in out
    assert "w: 8 frontier points" in out and "w: 1.00e+12: +0.00%" in out and "nan" not in out
    again = write_results(tmp_path / "again.csv", rows)
    (fam,) = load_results([results, again])  # the same diverged run in two files is one run
    assert fam.seeds.tolist() == [1] * 8 and fam.loss[0] == pytest.approx(loss[0])
    diverged = write_results(tmp_path / "diverged.csv", rows[-2:])
    assert main(["scaling", "fit", str(diverged)]) == 2
    err = capsys.readouterr().err
    assert "every run has a non-finite valid_logloss" in err and len(err.strip().splitlines()) == 1


LENGTHS = {
    "wukong": {
        "model": {"name": "wukong", "k": 4, "n_l": 4},
        "sizes": [{"num_layers": 1, "n_f": 4}, {"num_layers": 2, "n_f": 8}],
        "lengths": [512, 1024],
    }
}


def test_sweep_lengths_and_seeds(tmp_path):
    """2 sizes x 2 lengths x 1 seed: one pass of `length` fresh rows per run, one shared data set."""
    path = write_sweep(tmp_path, LENGTHS)
    spec = yaml.safe_load(path.read_text())
    spec["seeds"] = [3]
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    rows = read_csv(run_sweep(path, log=lambda _: None))
    assert [(int(r["examples"]), r["seed"]) for r in rows] == [(512, "3"), (1024, "3")] * 2
    assert [r["run"] for r in rows][:2] == [
        "wukong-num_layers1-n_f4-n512-seed3",
        "wukong-num_layers1-n_f4-n1024-seed3",
    ]
    assert [r["point"] for r in rows][:2] == ["wukong-num_layers1-n_f4-n512", "wukong-num_layers1-n_f4-n1024"]
    assert len(list((tmp_path / "out" / "data").iterdir())) == 1
    (fam,) = load_results(tmp_path / "out" / "results.csv")
    assert len(fam.compute) == 4 and fam.seeds.tolist() == [1] * 4


def test_lengths_of_one_seed_nest(tmp_path):
    """A shorter run's rows are the first rows a longer run of the same seed reads."""
    _, runs = load_sweep(write_sweep(tmp_path, LENGTHS))
    short, long = runs[:2]
    assert (short.length, long.length) == (512, 1024)
    assert (short.config.train.max_steps, long.config.train.max_steps) == (4, 8)

    def labels(run, steps):
        trainer = Trainer(run.config, tmp_path / run.name)
        return [b.labels for (b, _), _ in zip(trainer._epoch(), range(steps), strict=False)]

    first, longer = labels(short, 4), labels(long, 8)
    assert len(longer) == 8
    for a, b in zip(first, longer[:4], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([500], "length 500 is not a multiple of train.batch_size 128"),
        ([2048], "length 2048 exceeds the 1024 training rows; raise data.synthetic.rows.train"),
        ([512, 512], "repeat a length"),
        ([0], "greater than 0"),
    ],
)
def test_bad_lengths_are_one_line_errors(tmp_path, capsys, lengths, message):
    path = write_sweep(tmp_path, {"wukong": {**LENGTHS["wukong"], "lengths": lengths}})
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "wukong" in err and len(err.strip().splitlines()) == 1


def test_boolean_seeds_are_refused(tmp_path, capsys):
    """The sweep file was a plain pydantic model: seeds: [true] trained seed 1 without a word."""
    path = write_sweep(tmp_path, LENGTHS)
    spec = yaml.safe_load(path.read_text())
    spec["seeds"] = [True]
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert "seeds: expected numbers, got true" in err and len(err.strip().splitlines()) == 1


def test_runs_are_seed_major(tmp_path):
    """All runs of the first seed come before any of the second, so a study cut short covers every point."""
    path = write_sweep(tmp_path, LENGTHS)
    spec = yaml.safe_load(path.read_text())
    spec["seeds"] = [5, 1]
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    _, runs = load_sweep(path)
    assert [r.config.seed for r in runs] == [5] * (len(runs) // 2) + [1] * (len(runs) // 2)
    assert [r.point for r in runs[: len(runs) // 2]] == [r.point for r in runs[len(runs) // 2 :]]


def test_family_overrides_apply_to_that_family_alone(tmp_path):
    """Two families of one model, fp32 and bf16, in one study over one data set."""
    wukong = FAMILIES["wukong"]
    path = write_sweep(
        tmp_path,
        {
            "wukong_fp32": {**wukong, "overrides": ["train.precision=fp32"]},
            "wukong_bf16": {**wukong, "overrides": ["train.precision=bf16", "train.grad_clip=1.0"]},
        },
    )
    _, runs = load_sweep(path)
    by_family = {r.family: r.config for r in runs}
    assert by_family["wukong_fp32"].train.precision == "fp32"
    assert by_family["wukong_fp32"].train.grad_clip is None
    bf16 = by_family["wukong_bf16"].train
    assert (bf16.precision, bf16.grad_clip) == ("bf16", 1.0)
    assert by_family["wukong_fp32"].model == by_family["wukong_bf16"].model


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.synthetic.vocab_sizes=20"], "every run of a sweep must read the same data"),
        (["train.precision=fp8"], "family dlrm"),
        (["train"], "write overrides as key=value"),
    ],
)
def test_bad_family_overrides_are_one_line_errors(tmp_path, capsys, overrides, message):
    path = write_sweep(tmp_path, {**FAMILIES, "dlrm": {**FAMILIES["dlrm"], "overrides": overrides}})
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_precision_preset_trains_twin_families():
    """configs/sweeps/medium_precision.yaml: each fp32 run has a bf16 twin that differs in precision alone."""
    _, runs = load_sweep(CONFIGS / "sweeps" / "medium_precision.yaml")
    by_name = {r.name: r.config for r in runs}
    twins = [(n, n.replace("_fp32-", "_bf16-")) for n in by_name if "_fp32-" in n]
    assert len(twins) == 6 and len(by_name) == 12
    for fp32, bf16 in twins:
        a, b = by_name[fp32], by_name[bf16]
        assert (a.train.precision, b.train.precision) == ("fp32", "bf16")
        assert a.model_copy(update={"train": b.train}) == b
