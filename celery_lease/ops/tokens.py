"""Bearer tokens of the HTTP API, the dashboard and the /metrics route, from app.conf or
the environment (see :mod:`celery_lease.ops.api` for what each one may see).

A token maps to the tenant it may see (None: every tenant), or to an object saying so,
whether it may only look, and whether it may read payloads::

    {"ops-7f3a...": None, "acme-91bc...": "acme",
     "oncall-5d2e...": {"tenant": None, "read_only": true},
     "support-8a1b...": {"tenant": "acme", "payloads": true}}

The rule: a token is never revealed; the server's secret (``lease_dashboard_secret``)
keys the HMACs that name it (:class:`Keyring`), in throttles and session rows.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from celery_lease.errors import ConfigurationError

TOKENS_SETTING = "lease_api_tokens"
TOKENS_ENV = "CELERY_LEASE_API_TOKENS"
METRICS_TOKEN_SETTING = "lease_metrics_token"
METRICS_TOKEN_ENV = "CELERY_LEASE_METRICS_TOKEN"
SECRET_SETTING = "lease_dashboard_secret"
SECRET_ENV = "CELERY_LEASE_DASHBOARD_SECRET"
#: Shorter tokens are refused in the configuration and unread when offered: a token
#: is a password nobody types, and at the failed-sign-in rate (throttle.py) 20 random
#: characters are out of reach.
MIN_TOKEN_CHARS = 20


@dataclass(frozen=True)
class Grant:
    """What one token may do."""

    #: The one tenant it may see; None means every tenant.
    tenant: str | None = None
    #: True: it sees, but cannot cancel, retry, delete, pause or resume anything.
    read_only: bool = False
    #: May it read payloads (a submitter's data: names, addresses, keys)? None: the
    #: default, only when bound to no tenant and not read-only.
    payloads: bool | None = None

    @property
    def sees_payloads(self) -> bool:
        if self.payloads is not None:
            return self.payloads
        return self.tenant is None and not self.read_only


def _grant(value: Any) -> Grant | None:
    if value is None or isinstance(value, str):
        return Grant(value)
    if isinstance(value, dict) and set(value) <= {"tenant", "read_only", "payloads"}:
        tenant, read_only, payloads = value.get("tenant"), value.get("read_only", False), value.get("payloads")
        flags_ok = isinstance(read_only, bool) and (payloads is None or isinstance(payloads, bool))
        if (tenant is None or isinstance(tenant, str)) and flags_ok:
            return Grant(tenant, read_only, payloads)
    return None


def load_tokens(app_conf: Any) -> dict[str, Grant]:
    """Token -> its Grant, from app.conf or the environment."""
    tokens = app_conf.get(TOKENS_SETTING) if app_conf is not None else None
    source = f"app.conf.{TOKENS_SETTING}"
    if tokens is None and os.environ.get(TOKENS_ENV):
        source = TOKENS_ENV
        try:
            tokens = json.loads(os.environ[TOKENS_ENV])
        except ValueError:
            raise ConfigurationError(
                f'{TOKENS_ENV} is not JSON (expected e.g. {{"token": "tenant", "admin-token": null}})'
            ) from None
    if tokens is None:
        return {}
    grants = {t: _grant(v) for t, v in tokens.items()} if isinstance(tokens, dict) else None
    if grants is None or not all(isinstance(t, str) and g is not None for t, g in grants.items()):
        raise ConfigurationError(
            f'{source} must map token strings to a tenant name, None, or {{"tenant": ..., "read_only": true, "payloads": true}}'
        )
    short = sum(len(t) < MIN_TOKEN_CHARS for t in grants)
    if short:  # how many, never which: the message goes to logs
        raise ConfigurationError(f"{source}: {short} token(s) shorter than {MIN_TOKEN_CHARS} characters")
    return {t: g for t, g in grants.items() if g is not None}


def load_metrics_token(app_conf: Any) -> str | None:
    """The token /metrics requires, or None when it is open."""
    token = app_conf.get(METRICS_TOKEN_SETTING) if app_conf is not None else None
    source = f"app.conf.{METRICS_TOKEN_SETTING}"
    if token is None and os.environ.get(METRICS_TOKEN_ENV):
        token, source = os.environ[METRICS_TOKEN_ENV], METRICS_TOKEN_ENV
    if token is not None and (not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS):
        raise ConfigurationError(f"{source} must be a string of at least {MIN_TOKEN_CHARS} characters")
    return token


def load_secret(app_conf: Any) -> bytes:
    """The server's secret (see the module's docstring), or a random one for this process."""
    secret = app_conf.get(SECRET_SETTING) if app_conf is not None else None
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return secrets.token_bytes(32)
    if not isinstance(secret, str) or len(secret) < 16:
        raise ConfigurationError(f"{SECRET_SETTING} ({SECRET_ENV}) must be a string of at least 16 characters")
    return secret.encode()


def matches(offered: str, token: str) -> bool:
    """Constant-time comparison: the time taken does not tell how much was guessed right."""
    return hmac.compare_digest(offered.encode(), token.encode())


def keyed(secret: bytes, purpose: str, value: str) -> str:
    """HMAC-SHA256 of ``value`` for ``purpose`` under the server's secret (hex, 64
    characters): names a value in throttles and rows; without the secret it cannot be
    checked against a guess."""
    return hmac.new(secret, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Holder:
    """A configured token, as the code that checked it knows it."""

    #: keyed(secret, "token", token): its name in throttles and session rows.
    ident: str
    grant: Grant


class Keyring:
    """The configured tokens, looked up by what a caller offers or by ident."""

    def __init__(self, tokens: dict[str, Grant], secret: bytes) -> None:
        self._tokens = [(t, Holder(keyed(secret, "token", t), g)) for t, g in tokens.items()]
        self._by_ident = {h.ident: h for _, h in self._tokens}

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def find(self, offered: str) -> Holder | None:
        """The holder of the token ``offered``, or None (a short offer is not compared)."""
        if len(offered) < MIN_TOKEN_CHARS:
            return None
        found = None
        # compare_digest against every token: the time taken does not depend on how
        # much of a token was guessed right, nor on which one matched.
        for token, holder in self._tokens:
            if matches(offered, token):
                found = holder
        return found

    def by_ident(self, ident: str | None) -> Holder | None:
        """The holder of a token still configured (None once it was removed)."""
        return self._by_ident.get(ident) if ident else None


def scrape_tokens(tokens: dict[str, Grant], metrics_token: str | None) -> list[str] | None:
    """The tokens /metrics takes: the metrics token and every API token bound to no
    tenant (metrics span tenants); None when it is open, with no token of either kind
    configured. Configuring API tokens closes it: a deployment with tokens has clients
    that must not see other tenants' kinds and keys."""
    if metrics_token is None and not tokens:
        return None
    return [*([metrics_token] if metrics_token else []), *(t for t, grant in tokens.items() if grant.tenant is None)]
