"""DMT's tower assignment: ``dmt.assignment`` (round_robin, random, a partition file or a mapping)
resolved into towers of features. The learned partition that writes such files is ``partitioner``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from recscale.errors import ConfigError


def round_robin(features: list[str], towers: int) -> dict[str, int]:
    return {f: i % towers for i, f in enumerate(features)}


def random_assignment(features: list[str], towers: int, seed: int) -> dict[str, int]:
    """A uniformly random assignment with tower sizes differing by at most one (the control)."""
    order = np.random.default_rng(seed).permutation(len(features))
    return {features[j]: i % towers for i, j in enumerate(order)}


def resolve_assignment(
    assignment: str | dict[str, int], features: list[str], towers: int, seed: int
) -> list[list[str]]:
    """Per tower, its features in schema order."""
    if assignment == "round_robin":
        mapping = round_robin(features, towers)
    elif assignment == "random":
        mapping = random_assignment(features, towers, seed)
    elif isinstance(assignment, str):
        mapping = read_assignment(Path(assignment))
    else:
        mapping = assignment
    where = f"dmt.assignment {assignment}" if isinstance(assignment, str) else "dmt.assignment"
    missing, unknown = sorted(set(features) - set(mapping)), sorted(set(mapping) - set(features))
    if missing or unknown:  # e.g. a partition file of another run's features: say only what is wrong
        what = [f"features {missing} have no tower"] * bool(missing) + [
            f"{unknown} are not features of this run ({features})"
        ] * bool(unknown)
        raise ConfigError(
            f"{where}: {'; '.join(what)}; give every feature one tower (partition this run's features: "
            f"`recscale dmt partition RUN_DIR --towers {towers}`)"
        )
    out = [[f for f in features if mapping[f] == t] for t in range(towers)]
    used = sorted(set(mapping.values()))
    if used != list(range(towers)):
        hosts = f"{towers} host{'s' * (towers != 1)}"
        other = f", or run this one on {len(used)} host{'s' * (len(used) != 1)} (--nproc, --local-world-size)"
        raise ConfigError(
            f"{where}: puts features in towers {used}, but DMT runs one tower per host and this job has "
            f"{hosts}: it needs towers 0..{towers - 1}, each with a feature (partition the features for "
            f"{hosts}: `recscale dmt partition RUN_DIR --towers {towers}`"
            f"{other if used == list(range(len(used))) and len(used) > 1 else ''})"
        )
    return out


def read_assignment(path: Path) -> dict[str, int]:
    """The ``assignment`` of a file ``recscale dmt partition`` wrote: feature -> tower (an int >= 0);
    ConfigError in one line for anything else."""
    where = f"dmt.assignment {path}"
    if not path.is_file():
        raise ConfigError(f"dmt.assignment: {path} is not a file (write one with `recscale dmt partition`)")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where} is not JSON ({e}); write it with `recscale dmt partition`") from None
    mapping = doc.get("assignment") if isinstance(doc, dict) else None
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(
            f'{where}: no "assignment" object of feature -> tower; write it with `recscale dmt partition`'
        )
    bad = {f: t for f, t in mapping.items() if not isinstance(t, int) or isinstance(t, bool) or t < 0}
    if bad:
        example = ", ".join(f"{f!r}: {json.dumps(t)}" for f, t in list(bad.items())[:3])
        raise ConfigError(f"{where}: towers must be integers >= 0; got {example}")
    return mapping
