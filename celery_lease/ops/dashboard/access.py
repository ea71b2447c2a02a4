"""Signing in to the dashboard: API tokens, server-side sessions, CSRF tokens.

The sign-in form takes a token of ``lease_api_tokens``; a session is a row of
``celery_lease_sessions`` naming the token by its keyed hash, and the cookie holds a
random session id with its HMAC under the server's secret, nothing derived from the
token. The rule: a session never grants more than its token does now. Each request
checks the cookie's HMAC, then its row, then the token among those configured now, so
signing out or removing a token ends the session in every serve process; a cookie this
server did not sign is no session (the sign-in form, never an error). Every action
POST carries ``csrf``, an HMAC of the session id. The whole model (cookie flags, the
secret, limits, cross-site forms): docs/operations.md, "Security model".
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from celery_lease.db.dashboard_store import DashboardStore
from celery_lease.ops.tokens import Grant, Holder, Keyring, keyed

COOKIE = "celery_lease_session"
#: How long a sign-in lasts (by the database's clock).
SESSION_SECONDS = 12 * 3600
#: A longer cookie is refused unread.
MAX_COOKIE_CHARS = 200
#: Sessions one token keeps open; signing in past this ends the token's oldest. A
#: token shared by a team keeps a session per person and browser.
MAX_SESSIONS_PER_TOKEN = 50


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the token they signed in with (its grant, and its ident for the
    request rate), and the CSRF token their forms must carry."""

    holder: Holder
    csrf: str

    @property
    def grant(self) -> Grant:
        return self.holder.grant

    @property
    def tenant(self) -> str | None:
        return self.grant.tenant

    @property
    def can_act(self) -> bool:
        return not self.grant.read_only

    @property
    def sees_payloads(self) -> bool:
        return self.grant.sees_payloads


class Sessions:
    def __init__(self, keyring: Keyring, store: DashboardStore, secret: bytes) -> None:
        self._keyring = keyring
        self._store = store
        self._key = secret

    def _session_id(self, cookie: str | None) -> str | None:
        """The session id of a well-formed cookie this server signed, else None."""
        # Non-ASCII text is no cookie of ours (and compare_digest refuses it).
        if not cookie or len(cookie) > MAX_COOKIE_CHARS or not cookie.isascii() or cookie.count(".") != 1:
            return None
        session, signature = cookie.split(".")
        if not hmac.compare_digest(signature, keyed(self._key, "cookie", session)):
            return None
        return session

    def holder(self, offered: str) -> Holder | None:
        """The configured token ``offered`` is, or None (nothing is written)."""
        return self._keyring.find(offered)

    def sign_in(self, offered: str) -> str | None:
        """Open a session for a configured token: its cookie value; None when it is no
        configured token (nothing is written)."""
        holder = self.holder(offered)
        return None if holder is None else self.open(holder)

    def open(self, holder: Holder) -> str:
        """Open a session for ``holder``, ending its oldest past MAX_SESSIONS_PER_TOKEN:
        its cookie value."""
        session = secrets.token_urlsafe(32)
        self._store.open_session(keyed(self._key, "session", session), holder.ident, SESSION_SECONDS, MAX_SESSIONS_PER_TOKEN)
        return f"{session}.{keyed(self._key, 'cookie', session)}"

    def viewer(self, cookie: str | None) -> Viewer | None:
        """Who a session cookie belongs to; None when it is missing, forged, signed out,
        expired or its token is no longer configured."""
        session = self._session_id(cookie)  # the HMAC first: a forged cookie costs no read
        if session is None:
            return None
        holder = self._keyring.by_ident(self._store.session_token(keyed(self._key, "session", session)))
        if holder is None:
            return None
        return Viewer(holder, keyed(self._key, "csrf", session))

    def sign_out(self, cookie: str | None) -> None:
        """End the cookie's session, wherever else the cookie is (a copy included)."""
        session = self._session_id(cookie)
        if session is not None:
            self._store.close_session(keyed(self._key, "session", session))


def csrf_ok(viewer: Viewer, offered: str | None) -> bool:
    return offered is not None and hmac.compare_digest(offered.encode(), viewer.csrf.encode())
