"""Which of SQLite's errors mean the job database cannot be used now (DatabaseUnavailable,
waited out) rather than a statement's own mistake.

sqlite3 raises OperationalError for both: "database is locked" and "no such table".
PostgreSQL tells them apart by class (OperationalError for the server or the
connection, ProgrammingError for a missing table or a syntax error); here the result
code does, so a handler's bad ``ctx.effect`` fails its attempt as on PostgreSQL instead
of being retried as an outage.
"""

from __future__ import annotations

import re

#: Primary result codes of a database that cannot be used now: BUSY, LOCKED (past the
#: busy timeout), NOMEM, READONLY, IOERR, CORRUPT, FULL, CANTOPEN, PROTOCOL, NOTADB.
#: SQLITE_ERROR (1: no such table, a syntax error) and the others are the statement's.
UNAVAILABLE_CODES = frozenset({5, 6, 7, 8, 10, 11, 13, 14, 15, 26})
#: The same by sqlite3's wording, for errors that carry no code (Python 3.10).
_UNAVAILABLE_TEXT = re.compile(
    r"database is locked|database table is locked|out of memory|readonly database|disk I/O error|malformed|"
    r"database or disk is full|unable to open|locking protocol|not a database"
)


def unavailable(orig: BaseException | None) -> bool:
    """Whether SQLite's error ``orig`` is the database being unusable, not the statement."""
    code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in UNAVAILABLE_CODES
    return bool(_UNAVAILABLE_TEXT.search(str(orig)))
