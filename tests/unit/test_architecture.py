"""The package's shape: no import cycle, every module in its layer, and no module over 400
lines (but the SQL catalogue).

Imports inside functions and under TYPE_CHECKING count: they are design dependencies too
(a lower layer names what it needs of an upper one as a Protocol of its own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import celery_lease

PACKAGE = Path(celery_lease.__file__).parent


def _modules(*, migrations: bool = False) -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if "migrations" in rel.parts and not migrations:
            continue
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # "from pkg import mod" depends on pkg.mod; "from mod import name" on mod
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s for s in subs if s in known]
            if len(targets) < len(subs):
                targets.append(base)
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    # The package's __init__ re-exports the public names: it may import anything, and
    # nothing below it imports it (checked here too, as a cycle through it).
    assert _cycles(graph) == []


def test_no_module_is_over_400_lines():
    # The statement catalogue (db/statements) may be long: one subject's statements
    # belong together, and splitting them only made catalogues that import each other.
    catalogue = PACKAGE / "db" / "statements"
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if catalogue not in p.parents and (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


#: The package's layers, lowest first, each of one or more parts, each part some top-level
#: modules and packages (``__init__``: the package's own). A module may import its own
#: part and the parts of lower layers; parts side by side in one layer (worker and beat;
#: ops and django) import neither each other. The values are what every layer passes
#: around; the submit side builds on flow (kinds declare its limits); the glue wires the
#: layers into one CeleryLease, which ops and django take. Imports under TYPE_CHECKING
#: count as well.
LAYERS: list[dict[str, set[str]]] = [
    {"values": {"status", "errors", "job", "payload", "settings", "shared", "tracing"}},
    {"db": {"db"}},
    {"broker": {"broker"}},
    {"lifecycle": {"lifecycle"}},
    {"flow": {"flow"}},
    {"submit": {"kinds", "producer", "canvas", "grouping", "results"}},
    {"worker": {"worker"}, "beat": {"beat"}},
    {"glue": {"extension", "testing", "__init__"}},
    {"ops": {"ops"}, "django": {"django"}},
]
PART = {unit: part for layer in LAYERS for part, units in layer.items() for unit in units}
RANK = {part: rank for rank, layer in enumerate(LAYERS) for part in layer}


def _unit(module: str) -> str:
    """The top-level module or package that ``module`` is or lies in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_is_in_a_layer():
    units = {_unit(name) for name in _modules(migrations=True)}
    assert sorted(units - PART.keys()) == [], "in no layer: place them in LAYERS"
    assert sorted(PART.keys() - units) == [], "in LAYERS but not in the package"
    assert len(PART) == sum(len(units) for layer in LAYERS for units in layer.values()), "in two parts"


def test_modules_import_only_their_own_part_and_lower_layers():
    modules = _modules(migrations=True)
    wrong = set()
    for name, path in modules.items():
        here = PART.get(_unit(name))
        for target in _imports(name, path, set(modules)):
            there = PART.get(_unit(target))
            if here and there and there != here and RANK[there] >= RANK[here]:
                wrong.add(f"{name} imports {target} ({here} may not import {there})")
    assert not wrong, sorted(wrong)
