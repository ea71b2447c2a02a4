"""Slot keys of periodic jobs, listing cursors, retry backoff, settings resolution."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_lease.beat.periodic import Periodic
from celery_lease.job import parse_job_id
from celery_lease.ops import listing
from celery_lease.settings import Settings
from celery_lease.worker.outcome import backoff

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()


def periodic(every) -> Periodic:
    return Periodic("nightly", kind=None, schedule=every, payload={})  # type: ignore[arg-type]


def test_interval_slots_are_aligned_to_the_epoch_so_beats_agree():
    p = periodic(schedule(run_every=timedelta(seconds=10)))
    assert p.slot_key(T0 + 3) == p.slot_key(T0 + 9.99) == "beat:nightly:2026-11-30T12:00:00+00:00"
    assert p.slot_key(T0 + 10) == "beat:nightly:2026-11-30T12:00:10+00:00"


def test_crontab_slots_are_the_minute_of_the_tick():
    p = periodic(crontab(minute="*"))
    assert p.slot_key(T0 + 59) == "beat:nightly:2026-11-30T12:00:00+00:00"
    assert p.slot_key(T0 + 61) == "beat:nightly:2026-11-30T12:01:00+00:00"


def test_cursor_round_trip_and_malformed_cursors():
    job = SimpleNamespace(
        created_at=datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc), id="6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"
    )
    token = listing.encode_cursor(job)  # type: ignore[arg-type]
    assert listing.decode_cursor(token) == (job.created_at, job.id)
    assert listing.decode_cursor(None) is None
    for bad in ("!!!", "e30", "bm90IGpzb24"):
        with pytest.raises(ValueError):
            listing.decode_cursor(bad)


@pytest.mark.parametrize("attempt", [1, 2, 5, 30])
def test_backoff_grows_is_capped_and_jittered(attempt):
    random.seed(attempt)
    base, cap = 1.0, 60.0
    delays = [backoff(attempt, base, cap) for _ in range(200)]
    nominal = min(cap, base * 2 ** (attempt - 1))
    assert all(0.5 * nominal <= d <= 1.5 * nominal for d in delays)
    assert len(set(delays)) > 1


def test_settings_precedence_and_typos():
    conf = {"lease_batch_size": "50", "lease_reap_interval": 2}
    s = Settings.resolve(conf, {"reap_interval": 7.5})
    assert (s.batch_size, s.reap_interval, s.sweep_interval) == (50, 7.5, Settings().sweep_interval)
    with pytest.raises(TypeError, match="unknown setting 'batch'"):
        Settings.resolve({}, {"batch": 1})


def test_settings_are_read_after_a_later_config_from_object():
    from celery_lease import CeleryLease

    app = Celery("late", broker="memory://")
    leases = CeleryLease(app, "sqlite://")

    class Config:
        lease_sweep_stale_seconds = 3.0

    app.config_from_object(Config)
    assert leases.settings.sweep_stale_seconds == 3.0


def test_a_misspelt_lease_setting_is_warned_about_with_the_nearest_real_one(caplog):
    import sys
    import types

    from celery_lease import CeleryLease
    from celery_lease.ops import tokens
    from celery_lease.settings import OTHER_SETTINGS

    # Every lease_* key read outside Settings is known, so never warned about.
    assert {f"lease_{n}" for n in OTHER_SETTINGS} == {
        tokens.TOKENS_SETTING,
        tokens.METRICS_TOKEN_SETTING,
        tokens.SECRET_SETTING,
        "lease_database_url",
    }
    app = Celery("typo", broker="memory://")
    app.conf.update(lease_cookie_secure=True, lease_reap_intervall=3, lease_batch_size=10, lease_api_tokens={}, lease_zz=1)
    leases = CeleryLease(app, "sqlite://")
    with caplog.at_level("WARNING", logger="celery_lease"):
        assert leases.settings.dashboard_secure_cookie is False and leases.settings.batch_size == 10
        assert leases.settings.batch_size == 10  # read again: warned once
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sorted(warned) == [
        "celery-lease: unknown setting 'lease_cookie_secure' is ignored; did you mean 'lease_dashboard_secure_cookie'?",
        "celery-lease: unknown setting 'lease_reap_intervall' is ignored; did you mean 'lease_reap_interval'?",
        "celery-lease: unknown setting 'lease_zz' is ignored",
    ]

    # Django's CELERY namespace keeps the key as written, and so does the suggestion.
    module = types.ModuleType("typo_settings")
    module.CELERY_LEASE_SECURE_COOKIE = True  # type: ignore[attr-defined]
    module.CELERY_LEASE_BATCH_SIZE = 20  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        django_app = Celery("typo_django", broker="memory://")
        django_app.config_from_object(module.__name__, namespace="CELERY")
        caplog.clear()
        with caplog.at_level("WARNING", logger="celery_lease"):
            assert CeleryLease(django_app, "sqlite://").settings.batch_size == 20
    finally:
        del sys.modules[module.__name__]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "celery-lease: unknown setting 'CELERY_LEASE_SECURE_COOKIE' is ignored; "
        "did you mean 'CELERY_LEASE_DASHBOARD_SECURE_COOKIE'?"
    ]


def test_job_ids_are_checked_at_the_boundary():
    assert parse_job_id("6F1C2C9E-0B0E-4A53-9D6A-3B1F7D2B8C11") == "6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"
    with pytest.raises(ValueError, match="not a job id"):
        parse_job_id("x" * 500)


def test_quiet_ticks_filter_passes_a_record_whose_args_are_unhashable():
    # Beat logs "Message Error: %s\n%s" with a list when the broker is down; a logging
    # filter that raised there took beat down (seen with RabbitMQ restarted).
    import logging

    from celery_lease.beat.entries import QuietTicks

    record = logging.LogRecord("celery.beat", logging.ERROR, __file__, 1, "Message Error: %s\n%s", ("x", ["tb"]), None)
    assert QuietTicks().filter(record) is True
