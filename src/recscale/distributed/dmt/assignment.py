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
        path = Path(assignment)
        if not path.is_file():
            raise ConfigError(
                f"dmt.assignment: {path} is not a file (write one with `recscale dmt partition`)"
            )
        mapping = json.loads(path.read_text())["assignment"]
    else:
        mapping = assignment
    where = f"dmt.assignment {assignment}" if isinstance(assignment, str) else "dmt.assignment"
    missing, unknown = sorted(set(features) - set(mapping)), sorted(set(mapping) - set(features))
    if missing or unknown:
        raise ConfigError(f"{where}: features {missing} have no tower; {unknown} are not features")
    out = [[f for f in features if mapping[f] == t] for t in range(towers)]
    if any(not t for t in out) or max(mapping.values()) >= towers:
        raise ConfigError(f"{where}: needs towers 0..{towers - 1} (one per host), each with a feature")
    return out
