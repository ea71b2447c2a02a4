"""One database boundary (#27): ``celery_lease/db/`` alone knows which database it is
(PostgreSQL or SQLite) and whether statements run prepared. Above it, code names a
statement and forwards the dialect to its builder, and where it must choose a way it
asks ``Store.capabilities``; it never compares a dialect, nor prepares a statement, nor
decides how long a write is retried while the database is away (``OUTAGE_WAITS``: above
``db/``, writes retry through ``db.outage.retry_within_lease`` and ``retry_briefly``)."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_lease

PACKAGE = Path(celery_lease.__file__).parent
DIALECTS = {"postgresql", "sqlite"}


def _crossings(source: str) -> list[tuple[int, str]]:
    """Where ``source`` decides on the database itself: a comparison with a dialect (or a
    dialect's name), an import of db.prepared, a statement sent prepared by hand, a
    retry loop's own waits."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = [getattr(side, "attr", getattr(side, "id", None)) for side in [node.left, *node.comparators]]
            values = [getattr(side, "value", None) for side in [node.left, *node.comparators]]
            if "dialect" in names or DIALECTS.intersection(v for v in values if isinstance(v, str)):
                out.append((node.lineno, f"compares a dialect: {ast.unparse(node)}"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if "celery_lease.db.prepared" in names:
                out.append((node.lineno, "imports celery_lease.db.prepared"))
        elif isinstance(node, ast.Import) and any(a.name == "celery_lease.db.prepared" for a in node.names):
            out.append((node.lineno, "imports celery_lease.db.prepared"))
        elif isinstance(node, ast.Attribute) and node.attr == "execute_prepared":
            out.append((node.lineno, "sends a prepared statement (Store.alone decides)"))
        if isinstance(node, ast.ImportFrom) and any(a.name == "OUTAGE_WAITS" for a in node.names):
            out.append((node.lineno, "retries with its own waits (db.outage.retry_within_lease decides)"))
    return out


def test_the_scan_finds_each_crossing():
    source = """
from celery_lease.db.prepared import Prepared
from celery_lease.db import prepared
import celery_lease.db.prepared
a = store.dialect == "postgresql"
b = "sqlite" != url.dialect
c = claim(logged=dialect == other)
d = vendor != "postgresql"
store.execute_prepared(stmt, {})
from celery_lease.db.outage import OUTAGE_WAITS
"""
    assert sorted(line for line, _ in _crossings(source)) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert not _crossings("x = store.capabilities.many_job_claims and build(store.dialect)")


def test_nothing_above_db_decides_on_the_database():
    crossings = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "db"
        for line, what in _crossings(path.read_text())
    ]
    assert not crossings, "\n".join(crossings)
