"""The package's shape: no import cycle, packages in their layers, and no module over 400
lines (but the SQL catalogue).

Imports inside functions and under TYPE_CHECKING count: they are design dependencies too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import celery_lease

PACKAGE = Path(celery_lease.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if "migrations" in rel.parts:
            continue
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


#: The package's layers, lowest first: a module may import its own layer and lower ones
#: (worker and beat are side by side and import neither each other). The top-level
#: modules (values such as status and job, and the glue such as extension) are outside
#: the order. Imports under TYPE_CHECKING are annotations, not dependencies at run time,
#: and do not count here.
LAYERS = {"db": 0, "lifecycle": 1, "flow": 2, "worker": 3, "beat": 3, "ops": 4}


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_packages_import_only_their_own_layer_and_lower_ones():
    wrong = set()
    for path in PACKAGE.rglob("*.py"):
        here = path.relative_to(PACKAGE).parts[0]
        if here not in LAYERS or "migrations" in path.parts:
            continue
        for line, target in _runtime_imports(path):
            parts = target.split(".")
            if parts[0] != "celery_lease" or len(parts) < 2 or parts[1] not in LAYERS or parts[1] == here:
                continue
            if LAYERS[parts[1]] >= LAYERS[here]:
                wrong.add(f"{path.relative_to(PACKAGE)}:{line} imports {'.'.join(parts[:2])}")
    assert not wrong, sorted(wrong)
