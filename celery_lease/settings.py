"""Typed settings of one CeleryLease, read from ``app.conf`` and constructor arguments.

Each setting is ``lease_<name>`` in ``app.conf`` (so Django projects set
``CELERY_LEASE_<NAME>`` with the ``CELERY`` namespace) and ``<name>=`` as a constructor
argument, which takes precedence. They are read when first needed, not when
``CeleryLease(app)`` runs, so a later ``app.config_from_object(...)`` is honoured.

An ``app.conf`` key that starts with ``lease_`` but names no setting is a typo that
would otherwise be silently ignored (``lease_cookie_secure`` leaves the cookie without
``Secure``): :meth:`Settings.unknown_keys` names the nearest real one, which
CeleryLease logs as a warning when it first reads its settings
(:func:`warn_unknown_keys`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from celery_lease.errors import ConfigurationError
from celery_lease.payload import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_PROGRESS_BYTES,
    DEFAULT_MAX_RESULT_BYTES,
)

log = logging.getLogger("celery_lease.settings")

#: ``lease_*`` keys of app.conf read elsewhere than Settings (the database URL by
#: db/urls.py, the tokens and the dashboard's secret by ops/tokens.py): not typos.
OTHER_SETTINGS = ("database_url", "api_tokens", "metrics_token", "dashboard_secret")
#: Below this similarity a misspelt key gets no suggestion (it names nothing close).
_SUGGEST_CUTOFF = 0.6


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, text: str) -> bool:
    """An environment variable's true or false; anything else is a typo, refused."""
    if text.strip().lower() in _TRUE + _FALSE:
        return text.strip().lower() in _TRUE
    raise ConfigurationError(f"{name} must be true or false (1/0, yes/no, on/off), not {text[:40]!r}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Intervals and ages are seconds."""

    #: beat: requeue or expire jobs whose lease elapsed
    reap_interval: float = 10.0
    #: beat: publish due wakeups (delayed jobs, retries, lost messages)
    sweep_interval: float = 5.0
    #: a pending job's wakeup is re-sent after this long without a claim
    sweep_stale_seconds: float = 30.0
    #: beat: delete old terminal jobs
    prune_interval: float = 3600.0
    #: terminal jobs are kept this long (PostgreSQL: rounded up to the end of the UTC day
    #: they finished on, whose history partition is dropped whole)
    retention_seconds: float = 7 * 86400.0
    #: PostgreSQL: a terminal job without an idempotency key moves from the hot table to
    #: the day-partitioned history this long after it finished (db/schema.py)
    archive_after: float = 3600.0
    #: beat: move finished jobs into the history (PostgreSQL; a no-op on SQLite)
    archive_interval: float = 60.0
    #: rows per reap / sweep / prune statement (a call runs at most 20 of them). Each
    #: statement is one commit and one round trip: 2000 reaps a backlog ~10% faster
    #: than 500 and holds its row locks for tens of milliseconds.
    batch_size: int = 2000
    #: PostgreSQL: PREPARE the per-job statements (see db/prepared.py)
    prepare_statements: bool = True
    #: PostgreSQL + Redis broker: one wakeup on its way per kind and queue, and a kind with
    #: no limit in its code claims many jobs per delivery (broker/waking.py); False: a wakeup
    #: per job, one job per delivery (what a previous release's workers expect)
    coalesce_wakeups: bool = True
    #: beat's reap/sweep/prune ticks go here; a thread of every worker's main process consumes it
    maintenance_queue: str = "celery_lease"
    #: PostgreSQL: seconds to establish a connection
    connect_timeout: float = 10.0
    #: PostgreSQL: statement timeout of pooled connections (0: none; effects run there too)
    statement_timeout: float = 0.0
    #: PostgreSQL: statement and lock timeout of the heartbeat's own connection
    heartbeat_timeout: float = 5.0
    #: PostgreSQL: the longest a statement of the pooled connections waits for a lock (0: no limit)
    lock_timeout: float = 30.0
    #: PostgreSQL: a transaction idle this long (its client partitioned) is ended by the
    #: server, releasing its locks (0: never); above the slowest ctx.effect
    idle_in_transaction_timeout: float = 120.0
    max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    #: a handler's return value over this fails the job (without retry)
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    #: one ctx.publish() value over this is refused (UnstorableValue in the handler)
    max_progress_bytes: int = DEFAULT_MAX_PROGRESS_BYTES
    #: the API's /metrics answers from a cache this fresh (its aggregates scan the table)
    metrics_cache_seconds: float = 5.0
    #: /metrics: how many concurrency keys (the busiest) get a series of their own; the
    #: rest are summed per kind as key "other". A key is payload text (e.g. a customer
    #: name): 0, the default, exports none
    metrics_key_labels: int = 0
    #: a stored error of an exception names its type and a log reference only; True adds
    #: the exception's text, redacted (worker/incident.py) and capped
    error_detail: bool = False
    #: the API: requests a second per bearer token (bursts of twice that) before 429; 0: off
    api_rate: float = 50.0
    #: the dashboard's session cookie is always Secure (else only when the request came
    #: over HTTPS, as seen by serve: behind a TLS proxy, see serve --proxy-headers).
    #: Also CELERY_LEASE_DASHBOARD_SECURE_COOKIE (true/false, 1/0, yes/no, on/off).
    dashboard_secure_cookie: bool = False
    #: PostgreSQL: a replica (e.g. a streaming standby) for the reads that may lag: the
    #: dashboard's job list, counts and throughput, /metrics, the API's and CLI's job
    #: lists. Never a claim, an outcome, a submit, a cancel, any write, nor a read that
    #: decides one (a bulk action's selection, a job's own page). Empty: the primary
    #: serves them. Also CELERY_LEASE_READ_DATABASE_URL.
    read_database_url: str = ""

    #: Settings that the environment may give when neither an argument nor app.conf does.
    ENVIRONMENT: ClassVar[dict[str, str]] = {
        "read_database_url": "CELERY_LEASE_READ_DATABASE_URL",
        "dashboard_secure_cookie": "CELERY_LEASE_DASHBOARD_SECURE_COOKIE",
    }

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def check_overrides(cls, overrides: Mapping[str, Any]) -> None:
        """Refuse a constructor argument that names no setting (a typo is an error)."""
        for key in overrides:
            if key not in cls.names():
                raise TypeError(f"CeleryLease got an unknown setting {key!r}")

    @classmethod
    def resolve(cls, conf: Mapping[str, Any], overrides: Mapping[str, Any]) -> Settings:
        """``overrides`` (constructor arguments) over ``app.conf``'s ``lease_*`` over defaults."""
        cls.check_overrides(overrides)
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = overrides.get(field.name)
            if value is None:
                value = conf.get(f"lease_{field.name}")
            if value is None and field.name in cls.ENVIRONMENT:
                value = os.environ.get(cls.ENVIRONMENT[field.name]) or None
                if value is not None and isinstance(field.default, bool):
                    value = _flag(cls.ENVIRONMENT[field.name], value)
            if value is not None:
                kind: Any = type(field.default)
                values[field.name] = value if kind is bool else kind(value)
        return cls(**values)

    @classmethod
    def unknown_keys(cls, conf: Mapping[str, Any]) -> list[str]:
        """A warning for each ``lease_*`` key of ``conf`` (``CELERY_LEASE_*`` with
        Django's namespace) that no setting reads, naming the nearest real one."""
        known = [*cls.names(), *OTHER_SETTINGS]
        out = []
        for key in list(conf.keys()):
            if not isinstance(key, str):
                continue
            lowered = key.lower()
            # config_from_object(namespace="CELERY") keeps the key as written.
            prefix = "celery_lease_" if lowered.startswith("celery_lease_") else "lease_"
            if not lowered.startswith(prefix):
                continue
            name = lowered[len(prefix) :]
            if name in known:
                continue
            message = f"celery-lease: unknown setting {key!r} is ignored"
            nearest = _nearest(name, known)
            if nearest is not None:
                spelt = prefix + nearest
                message += f"; did you mean {spelt.upper() if key.isupper() else spelt!r}?"
            out.append(message)
        return out


def warn_unknown_keys(conf: Mapping[str, Any]) -> bool:
    """Log :meth:`Settings.unknown_keys` as warnings (a worker's or serve's log shows
    them at start); True once done."""
    for warning in Settings.unknown_keys(conf):
        log.warning("%s", warning)
    return True


def _similarity(a: str, b: str) -> float:
    """How alike two setting names are, also with their words reordered
    (``cookie_secure`` is ``dashboard_secure_cookie``, not ``dashboard_secret``)."""
    words_a, words_b = " ".join(sorted(a.split("_"))), " ".join(sorted(b.split("_")))
    return max(difflib.SequenceMatcher(None, a, b).ratio(), difflib.SequenceMatcher(None, words_a, words_b).ratio())


def _nearest(name: str, known: list[str]) -> str | None:
    best = max(known, key=lambda k: _similarity(name, k))
    return best if _similarity(name, best) >= _SUGGEST_CUTOFF else None
