"""Concurrency keys as a token that may not read payloads sees them.

A concurrency key is computed from the payload (``key=lambda p: p["customer"]``): it is
payload text. A token that may not read payloads (tokens.Grant.sees_payloads) sees, in
its place, a label: ``key-`` and 12 hex digits of an HMAC of the key under the server's
secret (tokens.keyed). The same key has the same label on every page and route of a
server (of every server sharing ``lease_dashboard_secret``), different keys different
labels, and without the secret a label cannot be checked against a guessed key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery_lease.ops.tokens import keyed

#: What a label starts with: never a key's own text to a reader who knows the format.
LABEL_PREFIX = "key-"


class KeyLabels:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def label(self, key: str) -> str:
        return LABEL_PREFIX + keyed(self._secret, "concurrency-key", key)[:12]

    def shown(self, key: str | None, *, payloads: bool) -> str | None:
        """``key`` for a viewer who may read payloads, else its label (None stays None:
        a kind without concurrency keys)."""
        return key if key is None or payloads else self.label(key)

    def rows(self, rows: Iterable[dict[str, Any]], field: str, *, payloads: bool) -> list[dict[str, Any]]:
        """``rows`` with ``field`` shown as :meth:`shown` (copies; the rows are untouched)."""
        return [{**r, field: self.shown(r[field], payloads=payloads)} for r in rows]
