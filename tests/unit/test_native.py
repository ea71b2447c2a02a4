"""Pure rules of the Celery-native layer, and the canvas statements on SQLite."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from celery_lease.worker.task import check_options, one_payload


def test_options_are_kept_ignored_or_refused_with_what_to_use_instead():
    kept = check_options("t", {"countdown": 5, "priority": 3, "expires": 10, "retry": True, "queue": None})
    assert kept == {"countdown": 5, "priority": 3}
    with pytest.raises(TypeError, match="lease_seconds"):
        check_options("t", {"time_limit": 3})
    with pytest.raises(TypeError, match="queue="):
        check_options("t", {"routing_key": "x"})
    with pytest.raises(TypeError, match="unsupported option 'bogus'"):
        check_options("t", {"bogus": 1})
    for bad in (256, -1, "5", True):
        with pytest.raises(TypeError, match="priority"):
            check_options("t", {"priority": bad})


def test_one_payload():
    assert one_payload("t", ({"a": 1},), None) == {"a": 1}
    assert one_payload("t", (), {"payload": 3}) == 3
    for args, kwargs in (((), {}), ((1, 2), {}), ((1,), {"x": 2})):
        with pytest.raises(TypeError, match="exactly one payload"):
            one_payload("t", args, kwargs)


def test_celery_states_of_job_rows(store, add_job):
    from celery_lease.errors import JobFailed
    from celery_lease.results import meta_of

    def meta(**columns):
        return meta_of("x", store.get(add_job(**columns)))

    assert meta(status="pending")["status"] == "PENDING"
    assert meta(status="pending", attempt=2)["status"] == "RETRY"
    started = meta(status="running", attempt=1, progress={"p": 1})
    assert started["status"] == "STARTED" and started["result"] == {"p": 1} and started["retries"] == 0
    assert meta(status="succeeded", attempt=3, result=[1])["result"] == [1]
    failed = meta(status="failed", attempt=1, error="no rows")
    assert failed["status"] == "FAILURE" and isinstance(failed["result"], JobFailed) and str(failed["result"]) == "no rows"
    assert meta(status="cancelled")["status"] == "REVOKED"
    assert meta_of("x", None)["status"] == "PENDING"


def test_a_chord_counts_down_to_zero_once(store):
    group, members = str(uuid.uuid4()), [str(uuid.uuid4()) for _ in range(2)]
    store.create_chord(group, members, {"task": "body"})
    store.create_chord(group, members, {"task": "other"})  # re-applied: unchanged

    def count_down():
        return store.transaction(store.durable, lambda conn: store.count_down_chord(conn, group))

    assert count_down()["remaining"] == 1
    last = count_down()
    assert last["remaining"] == 0 and last["members"] == members and last["body"] == {"task": "body"}
    assert count_down() is None  # a member counted twice cannot fire the body again
    assert store.transaction(store.durable, lambda conn: store.delete_chord(conn, group)) == {"task": "body"}
    assert store.transaction(store.durable, lambda conn: store.delete_chord(conn, group)) is None


def test_the_pruner_removes_old_chord_counters_with_no_live_header_job(store, add_job):
    """SQLite spells the members' UUIDs otherwise than its id column: prune_chords copes."""
    import sqlalchemy as sa

    from celery_lease.db.schema import chords

    live, done = add_job(status="running", expires_in=60), add_job(status="cancelled", finished_ago=10)
    cases = {"old_orphan": [done, str(uuid.uuid4())], "old_live": [done, live], "young": [str(uuid.uuid4())]}
    ids = {name: str(uuid.uuid4()) for name in cases}
    for name, members in cases.items():
        store.create_chord(ids[name], members, {"task": "body"})
    old = datetime.now(timezone.utc) - timedelta(hours=2)
    aged = sa.update(chords).where(chords.c.id.in_([ids["old_orphan"], ids["old_live"]])).values(created_at=old)
    store.transaction(store.durable, lambda c: c.execute(aged))
    assert store.prune_chords(3600, 10) == 1
    left = store.transaction(store.durable, lambda c: {str(r[0]) for r in c.execute(sa.select(chords.c.id))})
    assert left == {ids["old_live"], ids["young"]}
    assert store.prune_chords(3600, 10) == 0
