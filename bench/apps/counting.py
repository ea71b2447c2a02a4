"""Statement counting for the celery-lease processes (worker and bench producer).

A SQLAlchemy ``before_cursor_execute`` listener on every engine of the process, and a
wrapper around celery-lease's prepared-statement execution, count statements by verb
and table (an executemany counts once: psycopg2 sends it as one
batch). Imported once per process, so the listener is installed once. With each distinct
statement parsed once, it costs about a microsecond per statement.
"""

import json
import os
from collections import Counter

import sqlalchemy as sa

STATEMENTS: Counter = Counter()
_KEYS: dict[str, str] = {}  # statement text -> key: parse each distinct statement once


def statement_key(statement: str) -> str:
    """A short name for a statement: its verb and table, e.g. 'UPDATE celery_lease_jobs';
    a statement with CTEs is named by every write it makes, e.g.
    'WITH UPDATE celery_lease_jobs + INSERT celery_lease_events'."""
    words = statement.replace("(", " ").split()
    upper = [w.upper() for w in words]
    verb = upper[0] if upper else "?"
    targets = {"UPDATE": 1, "INSERT": 2, "DELETE": 2, "SELECT": None}
    if verb == "WITH":
        writes = [f"{w} {words[i + targets[w]]}" for i, w in enumerate(upper) if targets.get(w) and i + targets[w] < len(words)]
        return "WITH " + " + ".join(writes) if writes else "WITH SELECT"
    for i, word in enumerate(upper):
        if word in ("FROM", "INTO", "UPDATE") and i + 1 < len(words):
            return f"{verb} {words[i + 1]}"
    return verb


@sa.event.listens_for(sa.engine.Engine, "before_cursor_execute")
def _count(conn, cursor, statement, parameters, context, executemany):
    key = _KEYS.get(statement)
    if key is None:
        key = _KEYS[statement] = statement_key(statement)
    STATEMENTS[key] += 1


def _count_prepared() -> None:
    """celery-lease sends its per-job statements as EXECUTEs of prepared statements on a
    raw driver connection, which SQLAlchemy's events do not see: count those by the
    statement each one runs."""
    try:
        from celery_lease.db.prepared import Prepared
    except ImportError:
        return
    execute = Prepared.execute

    def counted(self, dbapi_connection, info, params):
        sql = self.prepare_sql.split(" AS ", 1)[1]
        key = _KEYS.get(sql)
        if key is None:
            key = _KEYS[sql] = statement_key(sql)
        STATEMENTS[key] += 1
        return execute(self, dbapi_connection, info, params)

    Prepared.execute = counted


_count_prepared()


def dump() -> None:
    """Write this process's counts to BENCH_OUT/stmts-<pid>.json (worker processes)."""
    out = os.environ.get("BENCH_OUT")
    if out:
        with open(os.path.join(out, f"stmts-{os.getpid()}.json"), "w") as fh:
            json.dump(dict(STATEMENTS), fh)
