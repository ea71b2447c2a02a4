"""Celery's group and chord header on leased tasks, in-process against PostgreSQL and a
real Redis: a group's leased members are one submit (one INSERT, one transaction, their
wakeups published together), all of them or none (tests/e2e/test_native_workers.py runs
them on workers)."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
import sqlalchemy as sa

from celery_lease.db.schema import events, jobs

NATIVE = "tests.apps.app_native"


@pytest.fixture
def job_inserts():
    """The INSERT statements into the job table this process sends, on any engine."""
    seen: list[str] = []

    def record(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith(("INSERT INTO CELERY_LEASE_JOBS", "WITH")) and "celery_lease_jobs" in statement:
            seen.append(statement)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)


def _rows(db: str, *where) -> list[dict]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(jobs).where(*where)).mappings()]
    finally:
        engine.dispose()


def _queued(broker: str) -> list[dict]:
    """The messages waiting in the broker's queues, oldest first, taken off."""
    client = redis.Redis.from_url(broker)
    out = []
    try:
        for key in sorted(client.keys()):
            if client.type(key) == b"list":
                while (raw := client.rpop(key)) is not None:
                    out.append(json.loads(raw))
    finally:
        client.close()
    return out


def test_a_group_of_leased_members_is_one_insert_with_its_events(pg, broker, client_app, job_inserts):
    from celery import group

    mod = client_app(pg, broker, module=NATIVE)
    run_id = str(uuid.uuid4())
    members = group([mod.inc.s({"n": i}) for i in range(6)])
    members.freeze()
    result = members.apply_async(run_id=run_id)
    inserts = [s for s in job_inserts if "INSERT INTO celery_lease_jobs" in s]
    assert len(inserts) == 1, inserts
    ids = [r.id for r in result.results]
    rows = {str(r["id"]): r for r in _rows(pg)}
    assert set(rows) == set(ids)  # the frozen task ids are the job ids
    for index, job_id in enumerate(ids):
        row = rows[job_id]
        assert row["idempotency_key"] == f"celery:{job_id}" and row["payload"] == {"n": index}
        assert row["canvas"]["group_id"] == result.id and row["canvas"]["group_index"] == index
        assert str(row["run_id"]) == run_id
    engine = sa.create_engine(pg)
    with engine.connect() as conn:
        dispatched = conn.execute(sa.select(events.c.job_id).where(events.c.event == "dispatched")).scalars().all()
    engine.dispose()
    assert sorted(str(j) for j in dispatched) == sorted(ids)
    assert sorted(m["headers"]["id"] for m in _queued(broker)) == sorted(ids)  # one wakeup each

    # Applying the same frozen group again creates nothing new: the ids are the keys.
    assert [r.id for r in members.apply_async(run_id=run_id).results] == ids
    assert len(_rows(pg)) == 6


def test_a_mixed_group_publishes_the_leased_wakeups_after_its_plain_members(pg, broker, client_app, job_inserts):
    from celery import group

    mod = client_app(pg, broker, module=NATIVE)
    result = group(mod.inc.s({"n": 1}), mod.plain_add.s(1, 2), mod.inc.s({"n": 2}), mod.plain_add.s(3, 4)).apply_async()
    assert len([s for s in job_inserts if "INSERT INTO celery_lease_jobs" in s]) == 1
    leased = {result.results[0].id, result.results[2].id}
    assert {str(r["id"]) for r in _rows(pg)} == leased
    # Celery published each plain member as it came; the leased members' wakeups went
    # together once every member was applied.
    order = [(m["headers"]["task"], m["headers"]["id"]) for m in _queued(broker)]
    assert [task for task, _ in order[:2]] == ["tests.plain_add", "tests.plain_add"]
    assert {job_id for _, job_id in order[2:]} == leased and len(order) == 4


def test_a_chord_header_is_one_insert(pg, broker, client_app, job_inserts):
    from celery import chord

    mod = client_app(pg, broker, module=NATIVE)
    body = chord([mod.inc.s({"n": i}) for i in range(4)], mod.total.s()).apply_async()
    assert len([s for s in job_inserts if "INSERT INTO celery_lease_jobs" in s]) == 1
    header = _rows(pg)
    assert len(header) == 4 and {r["canvas"]["chord"] for r in header} == {body.parent.id}


def test_a_group_whose_flush_fails_stores_and_wakes_none_of_its_members(pg, broker, client_app):
    from celery import group

    from celery_lease.errors import InvalidPayload, LeaseError

    mod = client_app(pg, broker, module=NATIVE)
    closed = str(uuid.uuid4())
    mod.leases.store.ensure_run(closed)
    mod.leases.cancel_run(closed)
    _queued(broker)  # the cancel notice, if any
    # The last member's run is cancelled: the one write is refused, the first members too.
    members = [mod.inc.s({"n": 1}), mod.inc.s({"n": 2}), mod.inc.s({"n": 3}).set(run_id=closed)]
    with pytest.raises(LeaseError, match="cancelled"):
        group(members).apply_async()
    assert _rows(pg) == [] and _queued(broker) == []
    # A member refused when applied (its payload) leaves nothing of the members before it.
    with pytest.raises(InvalidPayload):
        group(mod.inc.s({"n": 1}), mod.inc.s({"n": {1, 2}})).apply_async()
    assert _rows(pg) == [] and _queued(broker) == []


def test_a_leased_task_applied_outside_a_group_submits_at_once(pg, broker, client_app):
    from celery import Celery

    mod = client_app(pg, broker, module=NATIVE)
    with mod.app.producer_or_acquire() as producer:
        alone = mod.inc.apply_async(({"n": 1},), producer=producer)
        assert [str(r["id"]) for r in _rows(pg)] == [alone.id]  # written before the block ends
    # Only apps with a CeleryLease have the wrapper.
    plain = Celery("plain", broker=broker)
    assert "producer_or_acquire" not in vars(plain) and "producer_or_acquire" in vars(mod.app)
    plain.close()
