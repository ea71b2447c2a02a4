"""The dashboard's sign-in sessions (celery_lease.ops.dashboard.access): opened by a
sign-in, read on every dashboard request, deleted by signing out.

A row holds no secret: its id is a keyed hash of the random session id the cookie
carries, and ``token`` a keyed hash of the API token signed in with (both HMACs under
the server's secret), so neither a copy of the table nor of a cookie yields a token.
Expiry is the database's clock, shared by every serve process.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_lease.db.schema import sessions
from celery_lease.db.statements.common import db_now, db_now_plus

_c = sessions.c


def open_session() -> sa.Insert:
    """open_session: a session for ``id`` (its hash) and ``token`` (its hash), ending
    ``seconds`` from now."""
    return sessions.insert().values(
        id=sa.bindparam("id"),
        token=sa.bindparam("token"),
        created_at=db_now(),
        expires_at=db_now_plus(sa.bindparam("seconds", type_=sa.Float)),
    )


def end_oldest_sessions() -> sa.Delete:
    """end_oldest_sessions: end the sessions of ``token`` but ``id`` (just opened) and
    its ``keep`` newest others. Each sign-in runs it after drop_expired_sessions, so the
    table holds at most ``keep + 1`` rows per token signed in with since SESSION_SECONDS:
    a scan of it is small, and ``token`` needs no index."""
    others = (_c.token == sa.bindparam("token")) & (_c.id != sa.bindparam("id"))
    newest = (
        sa.select(_c.id).where(others).order_by(_c.created_at.desc(), _c.id.desc()).limit(sa.bindparam("keep", type_=sa.Integer))
    )
    return sessions.delete().where(others, _c.id.not_in(newest.scalar_subquery()))


def session_token() -> sa.Select:
    """session_token: the token hash of an unexpired session (no row: none)."""
    return sa.select(_c.token).where(_c.id == sa.bindparam("id"), _c.expires_at > db_now())


def close_session() -> sa.Delete:
    """close_session: sign out (a session that was never open changes nothing)."""
    return sessions.delete().where(_c.id == sa.bindparam("id"))


def drop_expired_sessions() -> sa.Delete:
    """drop_expired_sessions: forget sessions past their end (each sign-in runs it, so
    the table holds about the sessions of the last SESSION_SECONDS)."""
    return sessions.delete().where(_c.expires_at <= db_now())
