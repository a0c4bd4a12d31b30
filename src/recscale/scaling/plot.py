"""One PNG of a scaling study: LogLoss against training compute, and the frontier's excess over L_inf."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from recscale.io import atomic_write_bytes
from recscale.scaling.fit import FamilyRuns, PowerLawFit

# Matplotlib's cycle has 10 colours: the 11th family took the 1st one's. Each block of 10 families gets
# its own marker, so up to 80 families are told apart by colour and marker together.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def family_style(i: int) -> tuple[str, str]:
    """The colour and marker of the ``i``-th family of a plot; distinct for the first 80."""
    return f"C{i % 10}", MARKERS[(i // 10) % len(MARKERS)]


def plot_scaling(families: list[FamilyRuns], fits: dict[str, PowerLawFit], out: str | Path) -> Path:
    """Left: every run (dots), each point's mean over seeds (circles), the compute-optimal frontier
    (filled, joined) and its fitted curve per family on a log compute axis, the Bayes floor as a line
    when known. Right: the frontier's loss above the fitted L_inf on log-log axes, where the fitted law
    is a straight line of slope −b."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    fig, (ax, excess) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, fam in enumerate(families):
        color, marker = family_style(i)
        front = fam.frontier()
        ax.plot(fam.run_compute, fam.run_loss, ".", color=color, alpha=0.3, markersize=3)
        ax.plot(fam.compute, fam.loss, marker, color=color, fillstyle="none", alpha=0.6)
        ax.plot(fam.compute[front], fam.loss[front], f"{marker}-", color=color, label=f"{fam.name} frontier")
        if fam.name in fits:
            fit = fits[fam.name]
            grid = np.geomspace(fam.compute[front].min(), fam.compute[front].max(), 200)
            label = f"{fam.name} fit: {fit.l_inf:.4f} + a·C^-{fit.b:.2f}"
            ax.plot(grid, fit(grid), "--", color=color, label=label)
            above = fam.loss[front] - fit.l_inf
            excess.plot(fam.compute[front], above, marker, color=color, label=fam.name)
            excess.plot(grid, fit(grid) - fit.l_inf, "--", color=color)
    floors = {f.bayes for f in families if f.bayes is not None}
    if len(floors) == 1:
        ax.axhline(floors.pop(), color="k", linestyle="--", linewidth=1, label="Bayes floor (teacher)")
    ax.set(xscale="log", xlabel="training compute (FLOPs)", ylabel="validation LogLoss",
           title="LogLoss vs compute: runs, points, frontier")  # fmt: skip
    excess.set(xscale="log", yscale="log", xlabel="training compute (FLOPs)",
               ylabel="frontier LogLoss − fitted L_inf", title="frontier above its asymptote")  # fmt: skip
    for a in (ax, excess):
        a.grid(True, which="both", alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # the right panel is empty when no family was fitted
            a.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(Path(out), buf.getvalue())
    return Path(out)
