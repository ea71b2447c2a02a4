"""Prometheus metrics, read from the job table at scrape time.

celery-lease runs no daemon of its own, and its counters would otherwise live in many
worker and beat processes; the job table already holds the truth, so every value here
is an aggregate over the rows present when Prometheus scrapes. All are gauges: pruning
deletes terminal jobs (and their events) after ``lease_retention_seconds``, so totals
may go down; use them for rates and alerts within the retention window. What each
metric means: docs/operations.md#metrics. A scrape scans the job table, so the API
answers ``/metrics`` from :class:`CachedMetrics`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from celery_lease.status import Event

if TYPE_CHECKING:
    from celery_lease.extension import CeleryLease

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class LeaseCollector:
    """A prometheus-client collector that queries the job table on every scrape."""

    def __init__(self, leases: CeleryLease) -> None:
        self._leases = leases

    def collect(self) -> Iterator[Metric]:
        stale = self._leases.settings.sweep_stale_seconds
        data = self._leases.store.metrics(stale)

        jobs = GaugeMetricFamily("celery_lease_jobs", "Jobs in each status.", labels=["status", "kind"])
        claims = GaugeMetricFamily("celery_lease_claims", "Attempts claimed by workers.", labels=["kind"])
        losses = GaugeMetricFamily("celery_lease_lease_losses", "Leases lost to the reaper or restart recovery.", labels=["kind"])
        per_kind: dict[str, list[int]] = {}
        for status, kind, count, attempts, lost in data["jobs"]:
            jobs.add_metric([status, kind], count)
            totals = per_kind.setdefault(kind, [0, 0])
            totals[0] += int(attempts or 0)
            totals[1] += int(lost or 0)
        for kind, (attempts, lost) in sorted(per_kind.items()):
            claims.add_metric([kind], attempts)
            losses.add_metric([kind], lost)
        yield jobs
        yield claims
        yield losses

        run_events = GaugeMetricFamily("celery_lease_run_events", "Rows of the run event logs.", labels=["event"])
        by_event: dict[str, int] = {}
        restarts = 0
        for event, restart, count in data["events"]:
            by_event[event] = by_event.get(event, 0) + count
            if event == Event.REQUEUED.value and restart:
                restarts += count
        for event in Event:
            run_events.add_metric([event.value], by_event.get(event.value, 0))
        reaped = by_event.get(Event.REAPED.value, 0)
        by_cause = GaugeMetricFamily(
            "celery_lease_lease_losses_by_cause",
            "Leases lost, by cause (jobs of runs only: counted from the run event logs).",
            labels=["cause"],
        )
        by_cause.add_metric(["lease_expired"], reaped)
        by_cause.add_metric(["worker_restart"], restarts)
        yield run_events
        yield by_cause
        yield GaugeMetricFamily("celery_lease_reaped", "Reaper actions recorded in run event logs.", value=reaped)

        flow = GaugeMetricFamily(
            "celery_lease_flow_jobs", "Jobs running or held by flow control, per kind and key.", labels=["kind", "key", "state"]
        )
        paused = GaugeMetricFamily("celery_lease_paused", "Paused kinds (1).", labels=["kind"])
        rows = self._leases.limits()
        for (kind, key), counts in sorted(key_series(rows, self._leases.settings.metrics_key_labels).items()):
            for state in FLOW_STATES:
                flow.add_metric([kind, key, state], counts[state])
        for kind in sorted({row["kind"] for row in rows if row["paused"]}):
            paused.add_metric([kind], 1)
        yield flow
        yield paused

        running, age, overdue, unswept = data["leases"]
        yield GaugeMetricFamily("celery_lease_running", "Jobs running under a lease.", value=running)
        yield GaugeMetricFamily(
            "celery_lease_heartbeat_age_seconds",
            "Seconds since the stalest running lease was renewed or claimed.",
            value=max(0.0, float(age or 0.0)),
        )
        yield GaugeMetricFamily("celery_lease_leases_overdue", "Running jobs whose lease elapsed.", value=overdue)
        yield GaugeMetricFamily("celery_lease_sweep_backlog", "Due pending jobs without a fresh wakeup.", value=unswept)


FLOW_STATES = ("running", "waiting_limit", "waiting_rate", "waiting_pause")
#: The key label of a kind's keys beyond the busiest ``lease_metrics_key_labels``.
OTHER_KEYS = "other"


def key_series(rows: list[dict], labelled: int) -> dict[tuple[str, str], dict[str, int]]:
    """Flow counts per (kind, key label). A concurrency key is payload text and there may
    be millions: only the ``labelled`` busiest keys (running + waiting, over all kinds)
    keep their own label; the rest are summed per kind under "other". A kind with no
    key function is key ""."""
    keyed = [r for r in rows if r["key"] is not None]
    busiest = sorted(keyed, key=lambda r: (-sum(r[s] for s in FLOW_STATES), r["kind"], r["key"]))[: max(0, labelled)]
    named = {(r["kind"], r["key"]) for r in busiest}
    series: dict[tuple[str, str], dict[str, int]] = {}
    for row in rows:
        key = row["key"]
        label = "" if key is None else key if (row["kind"], key) in named else OTHER_KEYS
        counts = series.setdefault((row["kind"], label), dict.fromkeys(FLOW_STATES, 0))
        for state in FLOW_STATES:
            counts[state] += row[state]
    return series


def render(leases: CeleryLease) -> bytes:
    """The exposition text; raises the store's DatabaseUnavailable when it cannot read."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LeaseCollector(leases))
    return generate_latest(registry)


class CachedMetrics:
    """The exposition text, recomputed at most once every ``ttl`` seconds.

    Scrapes arriving while one computes wait for it and share its text; a failed
    computation (database down) is not cached, so the next scrape tries again."""

    def __init__(self, leases: CeleryLease, ttl: float) -> None:
        self._leases = leases
        self._ttl = ttl
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._at = 0.0

    def render(self) -> bytes:
        with self._lock:
            if self._body is not None and time.monotonic() - self._at < self._ttl:
                return self._body
            body = render(self._leases)
            self._body, self._at = body, time.monotonic()
            return body
