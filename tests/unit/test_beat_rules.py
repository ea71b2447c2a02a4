"""beat without services: slot keys of periodic jobs, what a beat tick must look like,
and the log filter of quiet ticks."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_lease.beat.periodic import CRON_GRACE, MAX_CLOCK_SKEW, MAX_TICK_AGE, Periodic, TickRefused

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


def test_quiet_ticks_filter_passes_a_record_whose_args_are_unhashable():
    # Beat logs "Message Error: %s\n%s" with a list when the broker is down; a logging
    # filter that raised there took beat down (seen with RabbitMQ restarted).
    import logging

    from celery_lease.beat.entries import QuietTicks

    record = logging.LogRecord("celery.beat", logging.ERROR, __file__, 1, "Message Error: %s\n%s", ("x", ["tb"]), None)
    assert QuietTicks().filter(record) is True


# --- beat ticks --------------------------------------------------------------------------


def test_a_ticks_key_is_derived_from_the_schedule_and_its_time():
    p = periodic(schedule(run_every=60))
    assert p.tick_key(T0 + 30, now=T0 + 45) == "beat:nightly:2026-11-30T12:00:00+00:00"
    # A tick that waited in the queue submits its own slot, within MAX_TICK_AGE.
    assert p.tick_key(T0 + 30, now=T0 + MAX_TICK_AGE) == "beat:nightly:2026-11-30T12:00:00+00:00"
    for tick, now in (
        (T0, T0 + MAX_TICK_AGE + 1),  # too old: its slot is long gone
        (T0 + MAX_CLOCK_SKEW + 1, T0),  # from the future: a slot not due yet
        (float("inf"), T0),
        (True, T0),
        (None, T0),
        ("beat:nightly:2026-11-30T12:00:30+00:00", T0),  # not a slot start
        ("beat:other:2026-11-30T12:00:00+00:00", T0),
        ("beat:nightly:2026-11-30T12:00:00", T0),  # naive
        ("beat:nightly:2099-01-01T00:00:00+00:00", T0),  # a slot start, but years ahead
    ):
        with pytest.raises(TickRefused):
            p.tick_key(tick, now=now)
    # An older beat sent the slot key itself: accepted when it is exactly one.
    assert p.tick_key("beat:nightly:2026-11-30T12:00:00+00:00", now=T0 + 10) == "beat:nightly:2026-11-30T12:00:00+00:00"


def test_a_crontab_tick_must_fall_when_the_crontab_fires():
    p = periodic(crontab(minute="0", hour="12", app=Celery(set_as_current=False)))
    assert p.tick_key(T0 + 5, now=T0 + 5).endswith("T12:00:00+00:00")
    assert p.tick_key(T0 + 60 * CRON_GRACE, now=T0 + 60 * CRON_GRACE)  # a late beat
    with pytest.raises(TickRefused, match="crontab does not fire"):
        p.tick_key(T0 + 60 * (CRON_GRACE + 1), now=T0 + 60 * (CRON_GRACE + 1))
    with pytest.raises(TickRefused, match="crontab does not fire"):
        p.tick_key(T0 - 3600, now=T0 - 3600)
