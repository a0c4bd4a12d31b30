"""One PNG of a scaling study: LogLoss against training compute, and the paper's relative form."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from recscale.io import atomic_write_bytes
from recscale.scaling.fit import FamilyRuns, PowerLawFit


def plot_scaling(families: list[FamilyRuns], fits: dict[str, PowerLawFit], out: str | Path) -> Path:
    """Left: points and fitted curve per family on a log compute axis, the Bayes floor as a line when
    known. Right: LogLoss change (%) against each family's smallest model."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, fam in enumerate(families):
        color = f"C{i}"
        ax.plot(fam.compute, fam.loss, "o", color=color, label=fam.name)
        rel.plot(fam.compute, fam.relative_change(), "o-", color=color, label=fam.name)
        if fam.name in fits:
            fit = fits[fam.name]
            grid = np.geomspace(fam.compute.min(), fam.compute.max(), 200)
            ax.plot(grid, fit(grid), "-", color=color,
                    label=f"{fam.name} fit: {fit.l_inf:.4f} + a·C^-{fit.b:.2f}")  # fmt: skip
    floors = {f.bayes for f in families if f.bayes is not None}
    if len(floors) == 1:
        ax.axhline(floors.pop(), color="k", linestyle="--", linewidth=1, label="Bayes floor (teacher)")
    ax.set(xscale="log", xlabel="training compute (FLOPs)", ylabel="validation LogLoss",
           title="LogLoss vs compute")  # fmt: skip
    rel.set(xscale="log", xlabel="training compute (FLOPs)", ylabel="LogLoss change vs smallest model (%)",
            title="relative to each family's smallest model")  # fmt: skip
    rel.axhline(0.0, color="k", linewidth=0.5)
    for a in (ax, rel):
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(Path(out), buf.getvalue())
    return Path(out)
