"""Signing in to the dashboard: API tokens, a signed session cookie, CSRF tokens.

The login form's one field, ``token``, takes a token of ``lease_api_tokens`` (see
:mod:`celery_lease.ops.tokens`). The session cookie then carries no token: it holds a
fingerprint of it (a SHA-256 prefix), its expiry and a random nonce, signed with
HMAC-SHA256. On every request the fingerprint is looked up among the tokens configured
now, so removing a token from the configuration ends its sessions at once, and a
session never grants more than its token does today.

The signing key is ``app.conf.lease_dashboard_secret`` (or the environment variable
``CELERY_LEASE_DASHBOARD_SECRET``); without one, each server process draws a random
key at start: its sessions end when it restarts, and several server processes behind
one address need the setting.

The cookie is HttpOnly (scripts cannot read it), SameSite=Strict (a cross-site page
cannot make the browser send it), and Secure when the request came over HTTPS. Every
action is a POST whose form carries ``csrf``, an HMAC of the session's nonce: a page
of another site can neither read it nor guess it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from celery_lease.errors import ConfigurationError
from celery_lease.ops.tokens import Grant, matches

COOKIE = "celery_lease_session"
SECRET_SETTING = "lease_dashboard_secret"
SECRET_ENV = "CELERY_LEASE_DASHBOARD_SECRET"
#: How long a sign-in lasts.
SESSION_SECONDS = 12 * 3600
#: A longer cookie is refused unread.
MAX_COOKIE_CHARS = 400


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the grant of the token they signed in with, and the CSRF token
    their forms must carry."""

    grant: Grant
    csrf: str

    @property
    def tenant(self) -> str | None:
        return self.grant.tenant

    @property
    def can_act(self) -> bool:
        return not self.grant.read_only


def load_secret(app_conf: Any) -> bytes:
    secret = app_conf.get(SECRET_SETTING) if app_conf is not None else None
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return secrets.token_bytes(32)
    if not isinstance(secret, str) or len(secret) < 16:
        raise ConfigurationError(f"{SECRET_SETTING} ({SECRET_ENV}) must be a string of at least 16 characters")
    return secret.encode()


def _fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class Sessions:
    def __init__(self, tokens: dict[str, Grant], secret: bytes) -> None:
        self._grants = {_fingerprint(t): g for t, g in tokens.items()}
        self._tokens = tokens
        self._key = secret

    def _sign(self, data: bytes) -> str:
        return base64.urlsafe_b64encode(hmac.new(self._key, data, hashlib.sha256).digest()).decode().rstrip("=")

    def sign_in(self, offered: str) -> str | None:
        """The cookie value for a token, or None when it is no configured token."""
        found = None
        # compare_digest against every token: the time does not tell which matched.
        for token in self._tokens:
            if matches(offered, token):
                found = token
        if found is None:
            return None
        body = json.dumps([_fingerprint(found), int(time.time()) + SESSION_SECONDS, secrets.token_urlsafe(16)])
        data = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
        return f"{data}.{self._sign(data.encode())}"

    def viewer(self, cookie: str | None) -> Viewer | None:
        """Who a session cookie belongs to; None when it is missing, forged, expired or
        its token is no longer configured."""
        if not cookie or len(cookie) > MAX_COOKIE_CHARS or cookie.count(".") != 1:
            return None
        data, signature = cookie.split(".")
        if not hmac.compare_digest(signature, self._sign(data.encode())):
            return None
        try:
            fingerprint, expires, nonce = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
        except (ValueError, TypeError):
            return None
        grant = self._grants.get(fingerprint)
        if grant is None or not isinstance(expires, int) or expires < time.time():
            return None
        return Viewer(grant, self._sign(f"csrf:{nonce}".encode()))


def csrf_ok(viewer: Viewer, offered: str | None) -> bool:
    return offered is not None and hmac.compare_digest(offered.encode(), viewer.csrf.encode())
