"""Why a connection to the job database failed, in celery-lease's own words.

A wrong port, a wrong database name and a wrong password all reach the caller as
DatabaseUnavailable; its message says which, so the fix is clear. The driver's message
is read here only to tell them apart (libpq's wording: psycopg2 gives a failed connect
no SQLSTATE) and is never passed on: it can carry server text, and the caller's message
may end up in a job's stored error. What the message names (host, port, database,
user) comes from the URL, never the password; the server's address libpq reports for
a failed connect (the host it tried) is taken only when it has the form of one.
"""

from __future__ import annotations

import re

import sqlalchemy as sa

#: libpq: 'connection to server at "h" (1.2.3.4), port 5432 failed: ...'
_SERVER_AT = re.compile(
    r'connection to server at "([A-Za-z0-9_.:%\[\]-]{1,255})"(?: \([0-9A-Fa-f.:%]{1,64}\))?, port (\d{1,5}) failed'
)
#: libpq: 'connection to server on socket "/run/postgresql/.s.PGSQL.5432" failed: ...'
_SOCKET = re.compile(r'connection to server on socket "([^"\x00-\x1f]{1,255})" failed')

#: (pattern of libpq's or the server's text, what it means), first match wins: a
#: server that answered says why it refused; only then is it "cannot connect".
_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r'database "[^"]*" does not exist'), "no_database"),
    (
        re.compile(
            r'password authentication failed|role "[^"]*" does not exist|no pg_hba\.conf entry|authentication failed|'
            r"no password supplied|password is required"
        ),
        "credentials",
    ),
    (re.compile(r"too many clients|remaining connection slots are reserved|too many connections"), "full"),
    (re.compile(r"the database system is (starting up|shutting down|in recovery mode|not yet accepting)"), "starting"),
    (re.compile(r"could not translate host name|Name or service not known|nodename nor servname"), "no_host"),
    (
        re.compile(
            r"Connection refused|timeout expired|No route to host|Network is unreachable|could not connect|"
            r"Connection timed out|No such file or directory"
        ),
        "no_server",
    ),
)


def reason(orig: BaseException | None, url: sa.URL) -> str:
    """What went wrong connecting to ``url`` (for DatabaseUnavailable's message): the
    driver's exception type when it is none of the failures recognised here."""
    fallback = type(orig).__name__
    if orig is None or url.get_backend_name() != "postgresql":
        return fallback
    text = str(orig)
    cause = next((name for pattern, name in _CAUSES if pattern.search(text)), None)
    if cause is None:
        return fallback
    server = _server(text, url)
    database = repr(url.database or url.username or "")
    if cause == "no_database":
        return f"the server at {server} has no database {database}"
    if cause == "credentials":
        user = repr(url.username or "(default)")
        return f"the server at {server} refused the credentials of user {user} (the role, its password, or pg_hba.conf)"
    if cause == "full":
        return f"the server at {server} has no connection slot left (max_connections)"
    if cause == "starting":
        return f"the server at {server} is starting up, shutting down or in recovery"
    if cause == "no_host":
        return f"cannot resolve the host name of the server at {server}"
    return f"cannot connect to the server at {server}"


def _server(text: str, url: sa.URL) -> str:
    """host:port of the server that failed: as libpq names it (each one it tried, of a
    multi-host URL), else as the URL does."""
    tried = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in _SERVER_AT.findall(text)]
    if tried:
        return " and ".join(dict.fromkeys(tried))
    socket = _SOCKET.search(text)
    if socket:
        return socket.group(1)
    if url.host is None and url.query.get("host"):  # libpq's multi-host form (db/urls.py)
        hosts = url.query["host"]
        return ",".join(hosts) if isinstance(hosts, tuple) else hosts
    return f"{url.host or 'localhost'}:{url.port or 5432}"
