"""Saturating power laws in compute: loss(C) = L_inf + a·C^(−b), fitted per model family.

Compute is normalised by the family's smallest run, x = C / C0, so the fit is well conditioned and
``a_c0`` reads as the loss above ``L_inf`` at the smallest run's compute; ``a`` (for C in FLOPs) is
``a_c0 · C0^b``. The fit is least squares: for b on a grid, L_inf and a are linear and solved exactly;
the best (L_inf, a, b) is then refined by Levenberg-Marquardt. 95% confidence intervals are
θ ± t(n−3)·se with se from the covariance s²(JᵀJ)⁻¹ at the optimum, s² = RSS / (n − 3): three
parameters need at least four runs of distinct compute to leave a residual degree of freedom.

L_inf is kept at or above ``floor`` (the synthetic teacher's Bayes LogLoss when known, else 0): with
few or flat points the unconstrained optimum runs to b → 0 and L_inf → −∞, a straight line in log C
that says nothing about saturation. When the floor binds, L_inf is fixed there and only (a, b) are
fitted, with their intervals on n − 2 degrees of freedom. ``pin_floor`` fixes L_inf at the floor
whatever the free fit finds: with a known Bayes floor, a power law in the reducible loss (loss − floor),
whose exponent is then determined by fewer points than a free L_inf needs.

A family's runs are grouped into points (a size trained for a length; the mean LogLoss over its seeds)
and the law is fitted to its compute-optimal frontier: the points that no cheaper point beats (the
envelope over sizes and lengths), as in Hoffmann et al. (2022). Points off the frontier are
undertrained or too small for their compute; fitting them would bend the law toward the wrong runs.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recscale.errors import RecscaleError

MIN_POINTS = 4
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; 1.96 beyond.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]  # fmt: skip


@dataclass(frozen=True)
class PowerLawFit:
    """loss(C) = l_inf + a_c0 · (C / c0)^(−b); each ``*_ci`` is a 95% interval (nan when undetermined)."""

    l_inf: float
    a_c0: float
    b: float
    c0: float
    l_inf_ci: tuple[float, float]
    a_c0_ci: tuple[float, float]
    b_ci: tuple[float, float]
    rmse: float
    points: int
    at_floor: bool = False  # L_inf was pinned to the floor (its interval is that point)

    @property
    def a(self) -> float:
        """The coefficient for compute in FLOPs: loss = l_inf + a · C^(−b); inf when it overflows a float,
        as it does for a family that saturates within its first step (b in the tens, C0 ~ 1e11 FLOPs)."""
        try:
            return self.a_c0 * self.c0**self.b
        except OverflowError:
            return math.inf

    def __call__(self, compute: np.ndarray) -> np.ndarray:
        return self.l_inf + self.a_c0 * (np.asarray(compute, dtype=np.float64) / self.c0) ** -self.b


def _model(theta: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predictions and the Jacobian (n, 3) with respect to (l_inf, a, b)."""
    l_inf, a, b = theta
    p = x**-b
    return l_inf + a * p, np.stack([np.ones_like(x), p, -a * p * np.log(x)], axis=1)


def _grid_start(x: np.ndarray, y: np.ndarray, l_inf: float | None) -> np.ndarray:
    """Best (L_inf, a, b) over a grid of b; L_inf solved for, or fixed when given."""
    best, start = math.inf, np.zeros(3)
    for b in np.geomspace(1e-3, 4.0, 400):
        if l_inf is None:
            design = np.stack([np.ones_like(x), x**-b], axis=1)
            coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        else:
            design = (x**-b)[:, None]
            coef = np.array([l_inf, np.linalg.lstsq(design, y - l_inf, rcond=None)[0][0]])
            design = np.stack([np.ones_like(x), x**-b], axis=1)
        rss = float(np.sum((design @ coef - y) ** 2))
        if rss < best:
            best, start = rss, np.array([coef[0], coef[1], b])
    return start


def _levenberg_marquardt(
    theta: np.ndarray, x: np.ndarray, y: np.ndarray, free: list[int], iters: int = 200
) -> np.ndarray:
    """Refine the ``free`` entries of theta; the others stay as given."""
    damping = 1e-3
    pred, jac = _model(theta, x)
    rss = float(np.sum((y - pred) ** 2))
    for _ in range(iters):
        j = jac[:, free]
        jtj, grad = j.T @ j, j.T @ (y - pred)
        step = np.linalg.lstsq(jtj + damping * np.diag(np.diag(jtj) + 1e-12), grad, rcond=None)[0]
        trial = theta.copy()
        trial[free] += step
        if trial[2] <= 0:  # b stays positive: a "power law" that grows with compute is not this model
            damping *= 10
            continue
        t_pred, t_jac = _model(trial, x)
        t_rss = float(np.sum((y - t_pred) ** 2))
        if t_rss < rss:
            converged = rss - t_rss <= 1e-15 * max(rss, 1e-300)
            theta, pred, jac, rss, damping = trial, t_pred, t_jac, t_rss, damping / 10
            if converged:
                break
        else:
            damping *= 10
            if damping > 1e12:
                break
    return theta


def fit_power_law(
    compute: np.ndarray, loss: np.ndarray, floor: float = 0.0, pin_floor: bool = False
) -> PowerLawFit:
    """Least-squares fit of loss = l_inf + a·C^(−b) with l_inf >= floor (l_inf = floor with ``pin_floor``);
    RecscaleError if fewer than 4 distinct computes."""
    c, y = np.asarray(compute, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if len(np.unique(c)) < MIN_POINTS:
        raise RecscaleError(
            f"{len(np.unique(c))} distinct compute values; a saturating power law (3 parameters) needs at "
            f"least {MIN_POINTS} to be fitted with confidence intervals"
        )
    if np.any(c <= 0):
        raise RecscaleError("compute must be positive for a power law")
    c0 = float(c.min())
    x = c / c0
    free = [0, 1, 2]
    theta = None if pin_floor else _levenberg_marquardt(_grid_start(x, y, None), x, y, free)
    if theta is None or theta[0] < floor:
        free = [1, 2]
        theta = _levenberg_marquardt(_grid_start(x, y, floor), x, y, free)
    pred, jac = _model(theta, x)
    n, dof = len(y), len(y) - len(free)
    rss = float(np.sum((y - pred) ** 2))
    se = np.zeros(3)
    with np.errstate(all="ignore"):
        cov = np.linalg.pinv(jac[:, free].T @ jac[:, free]) * rss / dof
        se[free] = np.sqrt(np.diag(cov))
    t = _T975[dof - 1] if dof <= len(_T975) else 1.96
    ci = [(float(v - t * s), float(v + t * s)) for v, s in zip(theta, se, strict=True)]
    return PowerLawFit(
        l_inf=float(theta[0]), a_c0=float(theta[1]), b=float(theta[2]), c0=c0,
        l_inf_ci=ci[0], a_c0_ci=ci[1], b_ci=ci[2], rmse=math.sqrt(rss / n), points=n, at_floor=len(free) == 2,
    )  # fmt: skip


@dataclass(frozen=True)
class FamilyRuns:
    """One family's points (a size at a length, over its seeds), sorted by compute."""

    name: str
    compute: np.ndarray  # training FLOPs
    loss: np.ndarray  # validation LogLoss, mean over the point's seeds
    bayes: float | None  # the synthetic teacher's LogLoss floor, when known
    seeds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # runs per point
    run_compute: np.ndarray = field(default_factory=lambda: np.zeros(0))  # every run, for plots
    run_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def relative_change(self) -> np.ndarray:
        """The paper's form: LogLoss change (%) against the family's smallest model."""
        return 100.0 * (self.loss - self.loss[0]) / self.loss[0]

    def frontier(self) -> np.ndarray:
        """Indices of the compute-optimal points: each beats every point of less or equal compute."""
        order = np.lexsort((self.loss, self.compute))
        keep, best = [], math.inf
        for i in order:
            if self.loss[i] < best:
                keep.append(int(i))
                best = float(self.loss[i])
        return np.array(keep, dtype=np.int64)


_NEED = ("family", "train_flops", "valid_logloss", "bayes_logloss")


def _read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a results CSV, each with ``_where`` (FILE:LINE); RecscaleError naming the file and line
    for a file that is not UTF-8 or not CSV, a row with the wrong number of cells, or a cell the fit reads
    as a number that is not one (so ``float`` of those cells is safe afterwards)."""
    if not path.is_file():
        raise RecscaleError(f"{path}: no such results file (a sweep writes OUT/results.csv)")
    data = path.read_bytes()
    try:  # decoded whole, so the error's offset is the file's (an incremental decoder counts per chunk)
        text = data.decode("utf-8").removeprefix("\ufeff")  # a spreadsheet's byte-order mark is no column
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise RecscaleError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        # Blank lines are no rows, as for DictReader; line_num is the line a row ends on.
        cells = [(reader.line_num, row) for row in reader if row]
    except csv.Error as e:
        raise RecscaleError(f"{path}:{reader.line_num}: not CSV ({e}); fix that line") from None
    if header is None or not set(_NEED) <= set(header):
        raise RecscaleError(f"{path}: not a sweep results CSV (needs the columns {', '.join(sorted(_NEED))})")
    if not cells:
        raise RecscaleError(f"{path}: no runs, only a header; fit it once its sweep has finished a run")
    rows = []
    for line, row in cells:
        where = f"{path}:{line}"
        if len(row) != len(header):  # a cut-off write, or an unquoted comma: the cells would shift columns
            raise RecscaleError(
                f"{where}: {len(row)} cells where the header has {len(header)}; fix or remove that row"
            )
        r = dict(zip(header, row, strict=True), _where=where)
        if not r["family"]:
            raise RecscaleError(f"{where}: column family is empty; fix or remove that row")
        # Compute 0 or below has no logarithm (the fit's axis); a LogLoss below 0 is no LogLoss.
        _number(r, "train_flops", "finite number > 0", lambda x: math.isfinite(x) and x > 0)
        # nan or inf: a run that diverged, which load_results leaves out
        _number(r, "valid_logloss", "number >= 0", lambda x: not x < 0)
        if r["bayes_logloss"]:  # blank: the teacher's floor is not known
            _number(r, "bayes_logloss", "number >= 0", lambda x: not x < 0)
        rows.append(r)
    return rows


def _number(r: dict[str, str], column: str, what: str, ok: Callable[[float], bool]) -> None:
    """RecscaleError naming the row unless the cell is a number for which ``ok`` holds (``what`` says so)."""
    value = r[column]
    try:
        good = ok(float(value))
    except ValueError:
        good = False
    if not good:
        raise RecscaleError(
            f"{r['_where']}: column {column} is not a {what} ({value!r}); fix or remove that row"
        )


def _point_key(r: dict[str, str], row: str) -> str:
    """A size trained for a length: (model, knobs, examples) where the CSV has them, so that the same
    point from sweeps whose families are merged is one point; else its ``point`` (``run`` in CSVs from
    before seeds and lengths), else the row itself (``row``: its file and line)."""
    if r.get("knobs") and r.get("examples"):
        return f"{r.get('model')} {r['knobs']} {r['examples']}"
    return r.get("point") or r.get("run") or row


class Families(list[FamilyRuns]):
    """``load_results``' families, and ``left_out``: the runs of each family (by name, in order of first
    appearance) left out for a non-finite LogLoss, including families dropped for having no run left."""

    def __init__(self, families: list[FamilyRuns], left_out: dict[str, list[str]]) -> None:
        super().__init__(families)
        self.left_out = left_out


def _check_merge(families: list[str], merge: dict[str, str]) -> None:
    """A --merge family that is in none of the results is an error: a misspelled one would fit the family
    meant apart, without a word. (A --drop pattern may match nothing, with a warning: commands drop by
    pattern across sets of files.)"""
    absent = [old for old in merge if old not in families]
    if absent:
        raise RecscaleError(
            f"--merge: family {absent[0]!r} is in none of the results (their families: {', '.join(families)}); "
            "check the spelling"
        )


def load_results(
    paths: str | Path | list[str | Path], merge: dict[str, str] | None = None, drop: list[str] | None = None
) -> Families:
    """Families (in order of first appearance) from one or more sweeps' results CSVs; the runs of a
    point are averaged over their seeds.

    ``merge`` renames families (old -> new) so sweeps of one study (say, a later sweep that adds a
    longer length) fit as one family; ``drop`` leaves out the families matching these shell patterns.
    A run found in several files (same family, model, knobs, examples and seed) counts once, and
    must have the same LogLoss in each. Runs whose LogLoss is not finite (they diverged) are left out,
    and listed in ``left_out``: one would make its point's mean, and the family's fit, nan."""
    merge, drop = merge or {}, drop or []
    rows: list[dict[str, str]] = []
    seen: dict[tuple[str, ...], tuple[Path, str]] = {}
    found: dict[str, None] = {}  # every family in the files, in order, before --drop and --merge
    read: dict[Path, Path] = {}  # resolved -> as given
    for path in map(Path, paths if isinstance(paths, list) else [paths]):
        # Rows without knobs, examples and seed (hand-made, or from before seeds) are not recognised as
        # repeats: a file given twice counted its runs twice, as two seeds of every point.
        if (first := read.setdefault(path.resolve(), path)) is not path:
            raise RecscaleError(f"{path}: the same results file as {first}, given twice; give it once")
        for r in _read_rows(path):
            found[r["family"]] = None
            if any(fnmatch.fnmatchcase(r["family"], pattern) for pattern in drop):
                continue
            r = dict(r, family=merge.get(r["family"], r["family"]))
            if r.get("knobs") and r.get("examples") and r.get("seed"):
                key = (r["family"], r.get("model", ""), r["knobs"], r["examples"], r["seed"])
                if key in seen:
                    first, loss = seen[key]
                    a, b = float(loss), float(r["valid_logloss"])
                    if a != b and not (math.isnan(a) and math.isnan(b)):  # one run that diverged in both
                        raise RecscaleError(
                            f"{path}: run {r.get('run') or r.get('point')} is also in {first} with another valid_logloss "
                            f"({r['valid_logloss']} against {loss}): not the same run; merge only sweeps of one study"
                        )
                    continue
                seen[key] = (path, r["valid_logloss"])
            rows.append(dict(r, _key=_point_key(r, r["_where"])))
    _check_merge(list(found), merge)
    for pattern in drop:  # not an error (one command may drop across sets of files), but not silent either
        if not any(fnmatch.fnmatchcase(name, pattern) for name in found):
            warnings.warn(
                f"--drop {pattern}: matches none of the results' families ({', '.join(found)}); nothing dropped",
                stacklevel=2,
            )
    if not rows:
        raise RecscaleError("no runs left to fit: --drop left out every family")
    left_out: dict[str, list[str]] = {}
    for r in rows:
        if not math.isfinite(float(r["valid_logloss"])):
            left_out.setdefault(r["family"], []).append(r.get("run") or r.get("point") or r["_where"])
    finite = [r for r in rows if math.isfinite(float(r["valid_logloss"]))]
    if not finite:
        raise RecscaleError(
            f"no runs left to fit: every run has a non-finite valid_logloss (diverged): "
            f"{_names([run for runs in left_out.values() for run in runs])}; rerun them (say, at a lower learning rate)"
        )
    families = []
    for name in dict.fromkeys(r["family"] for r in finite):
        mine = sorted((r for r in finite if r["family"] == name), key=lambda r: float(r["train_flops"]))
        points: dict[str, list[dict[str, str]]] = {}
        for r in mine:
            points.setdefault(r["_key"], []).append(r)
        # One teacher's floor, computed by sweeps at other thread counts, differs in the last digits.
        floors = [float(r["bayes_logloss"]) for r in mine if r["bayes_logloss"]]
        one_floor = bool(floors) and max(floors) - min(floors) <= 1e-6
        families.append(
            FamilyRuns(
                name=name,
                compute=np.array([np.mean([float(r["train_flops"]) for r in p]) for p in points.values()]),
                loss=np.array([np.mean([float(r["valid_logloss"]) for r in p]) for p in points.values()]),
                bayes=min(floors) if one_floor else None,
                seeds=np.array([len(p) for p in points.values()]),
                run_compute=np.array([float(r["train_flops"]) for r in mine]),
                run_loss=np.array([float(r["valid_logloss"]) for r in mine]),
            )
        )
    return Families(families, left_out)


def _names(runs: list[str], most: int = 5) -> str:
    """A list of runs for one line: the first ``most``, and how many more."""
    return ", ".join(runs[:most]) + (f" and {len(runs) - most} more" if len(runs) > most else "")


def _fmt_ci(v: float, ci: tuple[float, float]) -> str:
    return f"{v:.4g} [{ci[0]:.4g}, {ci[1]:.4g}]"


def report(
    families: list[FamilyRuns], pin_floor: bool = False, left_out: dict[str, list[str]] | None = None
) -> tuple[str, dict[str, PowerLawFit]]:
    """A text report (frontier fits with 95% intervals, relative LogLoss changes) and the fits that
    succeeded; ``pin_floor``: L_inf fixed at each family's Bayes floor (see ``fit_power_law``);
    ``left_out``: the diverged runs ``load_results`` left out (``Families.left_out``), named first."""
    lines = ["loss(C) = L_inf + a_C0 * (C / C0)^(-b), C = training FLOPs, fitted to each family's "
             "compute-optimal frontier; 95% confidence intervals"
             + ("; L_inf pinned to the Bayes floor" if pin_floor else "")]  # fmt: skip
    kept = {f.name for f in families}
    for name, runs in (left_out or {}).items():
        what = (
            f"left out {len(runs)} run{'s' * (len(runs) > 1)} with"
            if name in kept
            else "dropped, every run has"
        )
        lines.append(f"{name}: {what} a non-finite valid_logloss (diverged): {_names(runs)}")
    fits = {}
    for fam in families:
        front = fam.frontier()
        c = fam.compute[front]
        seeds = ""
        if len(fam.seeds):
            on_front = fam.seeds[front]
            seeds = f", {fam.seeds.min()}-{fam.seeds.max()} seeds per point"
            if (on_front.min(), on_front.max()) != (fam.seeds.min(), fam.seeds.max()):
                seeds += f" ({on_front.min()}-{on_front.max()} on the frontier)"
        lines.append(
            f"{fam.name}: frontier {len(front)} of {len(fam.compute)} points{seeds}, compute "
            f"{c.min():.3g}-{c.max():.3g} ({math.log10(c.max() / c.min()):.2f} orders of magnitude): "
            + "  ".join(f"{x:.2e}: {y:.4f}" for x, y in zip(c, fam.loss[front], strict=True))
        )
        try:
            fit = fit_power_law(c, fam.loss[front], fam.bayes or 0.0, pin_floor and fam.bayes is not None)
        except RecscaleError as e:
            lines.append(f"{fam.name}: not fitted: {e}")
            continue
        if pin_floor and fam.bayes is None:  # else the header's "pinned" would claim it for this fit too
            lines.append(
                f"{fam.name}: no one Bayes floor in its runs' bayes_logloss (blank, or differing between runs): "
                "L_inf fitted, not pinned"
            )
        fits[fam.name] = fit
        # Without --pin-floor a free fit whose L_inf fell below the floor is held there: say which it was.
        at_floor = "pinned to the floor" if pin_floor else "held at the floor: the free fit went below it"
        lines.append(
            f"{fam.name}: {fit.points} frontier points  L_inf "
            f"{f'{fit.l_inf:.4g} ({at_floor})' if fit.at_floor else _fmt_ci(fit.l_inf, fit.l_inf_ci)}  "
            f"a_C0 {_fmt_ci(fit.a_c0, fit.a_c0_ci)}  b {_fmt_ci(fit.b, fit.b_ci)}  "
            f"C0 {fit.c0:.3g}  (a = {fit.a:.4g} for C in FLOPs)  rmse {fit.rmse:.2g}"
        )
    lines.append("relative LogLoss change vs the family's smallest model (compute: change):")
    for fam in families:
        pairs = "  ".join(
            f"{c:.2e}: {r:+.2f}%" for c, r in zip(fam.compute, fam.relative_change(), strict=True)
        )
        lines.append(f"{fam.name}: {pairs}")
    floors = {f.bayes for f in families if f.bayes is not None}
    if len(floors) == 1:
        lines.append(f"Bayes floor (synthetic teacher): {floors.pop():.4f}")
    return "\n".join(lines), fits
