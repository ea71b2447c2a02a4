"""Bearer tokens of the HTTP API, the dashboard and the /metrics route, from app.conf or
the environment (see :mod:`celery_lease.ops.api` for what each one may see).

A token maps to the tenant it may see (None: every tenant), or to an object saying so
and whether it may only look::

    {"ops-7f3a...": None, "acme-91bc...": "acme",
     "oncall-5d2e...": {"tenant": None, "read_only": true}}

A read-only token sees what its tenant allows and changes nothing: the API's cancel and
every dashboard action answer it 403.
"""

from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from celery_lease.errors import ConfigurationError

TOKENS_SETTING = "lease_api_tokens"
TOKENS_ENV = "CELERY_LEASE_API_TOKENS"
METRICS_TOKEN_SETTING = "lease_metrics_token"
METRICS_TOKEN_ENV = "CELERY_LEASE_METRICS_TOKEN"


@dataclass(frozen=True)
class Grant:
    """What one token may do."""

    #: The one tenant it may see; None means every tenant.
    tenant: str | None = None
    #: True: it sees, but cannot cancel, retry, delete, pause or resume anything.
    read_only: bool = False


def _grant(value: Any) -> Grant | None:
    if value is None or isinstance(value, str):
        return Grant(value)
    if isinstance(value, dict) and set(value) <= {"tenant", "read_only"}:
        tenant, read_only = value.get("tenant"), value.get("read_only", False)
        if (tenant is None or isinstance(tenant, str)) and isinstance(read_only, bool):
            return Grant(tenant, read_only)
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
    if grants is None or not all(isinstance(t, str) and t and g is not None for t, g in grants.items()):
        raise ConfigurationError(
            f'{source} must map non-empty token strings to a tenant name, None, or {{"tenant": ..., "read_only": true}}'
        )
    return {t: g for t, g in grants.items() if g is not None}


def load_metrics_token(app_conf: Any) -> str | None:
    """The token /metrics requires, or None when it is open."""
    token = app_conf.get(METRICS_TOKEN_SETTING) if app_conf is not None else None
    source = f"app.conf.{METRICS_TOKEN_SETTING}"
    if token is None and os.environ.get(METRICS_TOKEN_ENV):
        token, source = os.environ[METRICS_TOKEN_ENV], METRICS_TOKEN_ENV
    if token is not None and (not isinstance(token, str) or not token):
        raise ConfigurationError(f"{source} must be a non-empty string")
    return token


def matches(offered: str, token: str) -> bool:
    """Constant-time comparison: the time taken does not tell how much was guessed right."""
    return hmac.compare_digest(offered.encode(), token.encode())


def scrape_tokens(tokens: dict[str, Grant], metrics_token: str | None) -> list[str] | None:
    """The tokens /metrics takes: the metrics token and every API token bound to no
    tenant (metrics span tenants); None when it is open, with no token of either kind
    configured. Configuring API tokens closes it: a deployment with tokens has clients
    that must not see other tenants' kinds and keys."""
    if metrics_token is None and not tokens:
        return None
    return [*([metrics_token] if metrics_token else []), *(t for t, grant in tokens.items() if grant.tenant is None)]
