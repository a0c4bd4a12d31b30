"""The package's layering, read from the source: each part imports only from the parts below it, and
no modules import each other in a circle (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Top to bottom; a part may import from parts below it (and from itself), never from one above.
LAYERS: list[set[str]] = [
    {"__main__"},  # python -m recscale
    {"cli"},
    {"scaling", "serve"},  # siblings: studies of training runs; exported models of them
    {"train"},
    {"distributed"},
    {"config"},
    {"config_files"},
    {"retrieval"},  # two-tower models and in-model item indexes, built from models' blocks
    {"data", "models"},  # siblings: data knows nothing of models, models nothing of data
    {"io", "quiet", "settings"},  # the base of config sections
    {"errors"},  # what every part raises (io's checks of a command's paths too)
]


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "recscale").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the recscale modules it imports anywhere in its body."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                for alias in node.names:
                    sub = f"{base}.{alias.name}".strip(".")
                    found.add(sub if sub in modules else base.strip("."))
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "recscale"


def _rank(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


MODULES = _modules()
EDGES = _imports(MODULES)


def test_every_part_has_a_layer() -> None:
    parts = {_part(m) for m in MODULES} - {"recscale"}
    assert parts <= set().union(*LAYERS), f"parts with no layer: {sorted(parts - set().union(*LAYERS))}"


@pytest.mark.parametrize("module", sorted(EDGES))
def test_imports_point_down(module: str) -> None:
    if _part(module) == "recscale":
        return
    up = [
        t
        for t in EDGES[module]
        if _part(t) != _part(module) and _part(t) != "recscale" and _rank(_part(t)) <= _rank(_part(module))
    ]
    assert not up, f"{module} imports from its own layer or above: {sorted(up)}"


def test_no_import_circle() -> None:
    # Tarjan's strongly connected components; any component of two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    """The two checks above must be able to fail: fed a known circle and a known upward import."""
    global EDGES
    saved = EDGES
    try:
        EDGES = {**saved, "recscale.data.schema": saved["recscale.data.schema"] | {"recscale.train.loop"}}
        with pytest.raises(AssertionError, match="own layer or above"):
            test_imports_point_down("recscale.data.schema")
        with pytest.raises(AssertionError, match="import circles"):
            test_no_import_circle()
    finally:
        EDGES = saved
