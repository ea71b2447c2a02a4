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

from celery_lease.db.schema import events, jobs, runs

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
    # One wakeup for the six (coalesced, waking.py), named by the first member: its claim takes them all.
    assert [m["headers"]["id"] for m in _queued(broker)] == ids[:1]

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
    # Celery published each plain member as it came; the leased members' wakeup (one for
    # both: coalesced, waking.py) went once every member was applied.
    order = [(m["headers"]["task"], m["headers"]["id"]) for m in _queued(broker)]
    assert [task for task, _ in order[:2]] == ["tests.plain_add", "tests.plain_add"]
    assert [job_id for _, job_id in order[2:]] == [result.results[0].id]


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


# --- link_error for jobs that end outside their attempts ---------------------------------------


def _plain_errbacks(broker: str) -> list[list]:
    """The args of each plain errback message waiting in the broker (taken off)."""
    import base64

    out = []
    for message in _queued(broker):
        if message["headers"]["task"] == "tests.plain_errback":
            out.append(json.loads(base64.b64decode(message["body"]))[0])
    return out


def _left_running(db: str, job_id: str, owner: str, *, last_attempt: bool = True, expires: str = "0 seconds") -> None:
    """Make a job look like worker ``owner`` was running it when it died: running, on its
    last attempt (or its first), its lease ending ``expires`` from now."""
    engine = sa.create_engine(db)
    with engine.begin() as conn:
        conn.execute(
            sa.update(jobs)
            .where(jobs.c.id == job_id)
            .values(
                status="running",
                attempt=jobs.c.max_attempts if last_attempt else 1,
                lease_owner=owner,
                lease_expires_at=sa.func.now() + sa.text(f"interval '{expires}'"),
            )
        )
    engine.dispose()


def _expire(db: str, job_id: str) -> None:
    """Make a job look like its last attempt's worker died: running, lease elapsed."""
    _left_running(db, job_id, "gone/1/boot")


def test_errbacks_fire_once_for_cancelled_and_expired_jobs(pg, broker, client_app, tmp_path):
    mod = client_app(pg, broker, module=NATIVE)

    def with_errbacks(n: int, **options):
        return mod.inc.apply_async(({"n": n},), link_error=[mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))], **options)

    def errback_jobs(failed: str) -> list[dict]:
        return _rows(pg, jobs.c.kind == "noted_error", jobs.c.parent_id == failed)

    # Cancelled while pending (leases.cancel, as the API, revoke and the CLI do).
    pending = with_errbacks(1, countdown=600)
    _queued(broker)
    assert mod.leases.cancel(pending.id)
    (errback,) = errback_jobs(pending.id)  # created in the cancel's transaction
    assert errback["payload"] == {"job_id": pending.id, "error": "cancelled"}
    assert errback["idempotency_key"] == f"celery:{errback['id']}" and errback["status"] == "pending"
    assert _plain_errbacks(broker) == [[pending.id, str(tmp_path)]]
    assert not mod.leases.cancel(pending.id)  # already terminal: nothing fires again
    assert len(errback_jobs(pending.id)) == 1 and _plain_errbacks(broker) == []

    # Running, its last lease elapsed: the reaper expires it and its errbacks fire.
    running = with_errbacks(2)
    _expire(pg, running.id)
    _queued(broker)
    assert mod.leases.reap()["expired"] == 1
    (errback,) = errback_jobs(running.id)
    assert errback["payload"] == {"job_id": running.id, "error": "lease expired"}
    assert _plain_errbacks(broker) == [[running.id, str(tmp_path)]]
    mod.leases.cancel(running.id)
    assert mod.leases.reap() == {"requeued": 0, "expired": 0}
    assert len(errback_jobs(running.id)) == 1 and _plain_errbacks(broker) == []

    # A job of a run with link_error, cancelled alone: its errback job is in the run.
    run_id = str(uuid.uuid4())
    in_run = [with_errbacks(n, run_id=run_id) for n in (3, 4, 5)]
    _queued(broker)
    assert mod.leases.cancel(in_run[0].id)
    (errback,) = errback_jobs(in_run[0].id)
    assert str(errback["run_id"]) == run_id
    dispatched = [e["job_id"] for e in mod.leases.run_events(run_id) if e["detail"] == f"errback of {in_run[0].id}"]
    assert dispatched == [str(errback["id"])]
    # The run cancelled: each job's errbacks fire; a cancelled run takes no new job, so
    # the leased ones are created outside it, pending (they will run).
    assert mod.leases.cancel_run(run_id) == 3  # the two inc jobs and the first one's errback
    for cancelled in in_run[1:]:
        (errback,) = errback_jobs(cancelled.id)
        assert errback["run_id"] is None and errback["status"] == "pending"
    assert sorted(a[0] for a in _plain_errbacks(broker)) == sorted(r.id for r in in_run)


def in_a_run_cancelled_behind_it(mod, pg: str, broker: str, tmp_path):
    """A job with two errbacks (leased, plain) in a run then cancelled, as if cancel_run
    had missed it (its claim will find the run cancelled). The broker is emptied."""
    run_id = str(uuid.uuid4())
    job = mod.inc.apply_async(({"n": 1},), link_error=[mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))], run_id=run_id)
    _queued(broker)
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(sa.update(runs).where(runs.c.id == run_id).values(cancelled_at=sa.func.now()))
    engine.dispose()
    return job


def test_a_job_its_claim_finds_in_a_cancelled_run_fires_its_errbacks_once(pg, broker, client_app, tmp_path):
    """A job committed into a run after cancel_run looked at the run's jobs (a child of
    a parent's success, a submit in the caller's transaction): its claim cancels it
    instead of starting it, and what a cancel of the run sets off follows: its errbacks
    fire once. (The claim-time cancel fired none.)"""
    mod = client_app(pg, broker, module=NATIVE)
    job = in_a_run_cancelled_behind_it(mod, pg, broker, tmp_path)
    assert mod.leases.worker.begin(job.id, mod.inc.spec, "w@host") is None  # cancelled, not started
    assert mod.leases.get(job.id).status.value == "cancelled"
    (errback,) = _rows(pg, jobs.c.kind == "noted_error", jobs.c.parent_id == job.id)
    assert errback["payload"] == {"job_id": job.id, "error": "cancelled"} and errback["run_id"] is None
    assert _plain_errbacks(broker) == [[job.id, str(tmp_path)]]
    assert mod.leases.worker.begin(job.id, mod.inc.spec, "w@host") is None  # a second delivery: nothing again
    assert len(_rows(pg, jobs.c.kind == "noted_error", jobs.c.parent_id == job.id)) == 1 and _plain_errbacks(broker) == []


def test_a_chord_header_job_its_claim_finds_in_a_cancelled_run_removes_the_chord_once(pg, broker, client_app, tmp_path):
    """#18 item 8: a header job cancelled by its claim (its run cancelled) counts its
    chord down like any cancel: the chord is removed in the claim's transaction, the
    body's errbacks fire once, the other header jobs ending later fire nothing more."""
    from celery import chord

    from celery_lease.db.schema import chords

    # One job per delivery (the single claim), so a second delivery of the first header
    # job claims nothing else (a claim of what is due would take the others).
    mod = client_app(pg, broker, module=NATIVE, conf={"lease_coalesce_wakeups": False})
    body = mod.total.s().set(link_error=[mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))])
    chord([mod.inc.s({"n": i}) for i in range(3)], body).apply_async()
    header = sorted(_rows(pg, jobs.c.kind == "inc"), key=lambda r: r["canvas"]["group_index"])
    _queued(broker)
    run_id = str(uuid.uuid4())
    engine = sa.create_engine(pg)
    with engine.begin() as conn:  # the first header job sits in a cancelled run (missed by cancel_run)
        conn.execute(sa.insert(runs).values(id=run_id, cancelled_at=sa.func.now(), created_at=sa.func.now()))
        conn.execute(sa.update(jobs).where(jobs.c.id == header[0]["id"]).values(run_id=run_id))

    def chord_rows() -> int:
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(chords)).scalar_one()

    try:
        assert chord_rows() == 1
        first = str(header[0]["id"])
        assert mod.leases.worker.begin(first, mod.inc.spec, "w@host") is None  # cancelled, not started
        assert mod.leases.get(first).status.value == "cancelled"
        assert chord_rows() == 0  # the body never runs
        (errback,) = _rows(pg, jobs.c.kind == "noted_error")
        assert errback["payload"] == {"job_id": first, "error": "a chord header job failed"}
        assert [a[0] for a in _plain_errbacks(broker)] == [first]
        assert mod.leases.worker.begin(first, mod.inc.spec, "w@host") is None  # a second delivery: nothing again
        mod.leases.cancel(str(header[1]["id"]))
        assert len(_rows(pg, jobs.c.kind == "noted_error")) == 1 and _plain_errbacks(broker) == []
        assert _rows(pg, jobs.c.kind == "total") == []
    finally:
        engine.dispose()


def test_restart_recovery_fires_the_errbacks_of_a_job_it_fails_and_only_of_that_one(pg, broker, client_app, tmp_path):
    mod = client_app(pg, broker, module=NATIVE)
    node = "celery@restarted-host"
    spent, retried, elsewhere = (
        mod.inc.apply_async(({"n": n},), link_error=[mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))]) for n in (1, 2, 3)
    )
    # Left running by an earlier boot of `node` (or of another node), leases still valid.
    _left_running(pg, spent.id, f"{node}/4242/an-earlier-boot", expires="1 hour")
    _left_running(pg, retried.id, f"{node}/4242/an-earlier-boot", last_attempt=False, expires="1 hour")
    _left_running(pg, elsewhere.id, "celery@another-host/4242/an-earlier-boot", expires="1 hour")
    _queued(broker)

    # The worker_ready handler runs this when `node` comes back with a new boot id.
    assert mod.leases.recover(node) == {"requeued": 1, "failed": 1}
    rows = {str(r["id"]): r for r in _rows(pg, jobs.c.id.in_([spent.id, retried.id, elsewhere.id]))}
    assert rows[spent.id]["status"] == "failed"
    assert rows[spent.id]["error"] == "interrupted by restart"
    assert rows[retried.id]["status"] == "pending"  # attempts left: requeued, no errback
    assert rows[elsewhere.id]["status"] == "running"  # another node's lease: the reaper's
    (errback,) = _rows(pg, jobs.c.kind == "noted_error")
    assert str(errback["parent_id"]) == spent.id  # created in the recovery's transaction
    assert errback["payload"] == {"job_id": spent.id, "error": "interrupted by restart"}
    assert _plain_errbacks(broker) == [[spent.id, str(tmp_path)]]

    # Recovering again (another restart) finds nothing and fires nothing twice.
    assert mod.leases.recover(node) == {"requeued": 0, "failed": 0}
    assert len(_rows(pg, jobs.c.kind == "noted_error")) == 1 and _plain_errbacks(broker) == []


def test_a_chord_header_job_cancelled_or_expired_removes_the_chord_and_fires_the_body_errbacks_once(
    pg, broker, client_app, tmp_path
):
    from celery import chord

    from celery_lease.db.schema import chords

    # One job per delivery (the single claim), so a second delivery of the first header
    # job claims nothing else (a claim of what is due would take the others).
    mod = client_app(pg, broker, module=NATIVE, conf={"lease_coalesce_wakeups": False})
    body = mod.total.s().set(link_error=[mod.noted_error.s(), mod.plain_errback.s(str(tmp_path))])
    result = chord([mod.inc.s({"n": i}) for i in range(3)], body).apply_async()
    header = sorted(_rows(pg, jobs.c.kind == "inc"), key=lambda r: r["canvas"]["group_index"])
    _queued(broker)

    def chord_rows() -> int:
        engine = sa.create_engine(pg)
        try:
            with engine.connect() as conn:
                return conn.execute(sa.select(sa.func.count()).select_from(chords)).scalar_one()
        finally:
            engine.dispose()

    assert chord_rows() == 1
    first = str(header[0]["id"])
    mod.leases.cancel(first)
    assert chord_rows() == 0  # removed in the cancel's transaction: the body never runs
    (errback,) = _rows(pg, jobs.c.kind == "noted_error")
    assert errback["payload"] == {"job_id": first, "error": "a chord header job failed"}
    assert [a[0] for a in _plain_errbacks(broker)] == [first]
    # The other header jobs ending later fire nothing more.
    _expire(pg, str(header[1]["id"]))
    mod.leases.reap()
    mod.leases.cancel(str(header[2]["id"]))
    assert len(_rows(pg, jobs.c.kind == "noted_error")) == 1 and _plain_errbacks(broker) == []
    assert _rows(pg, jobs.c.kind == "total") == [] and result.state == "PENDING"


def test_the_pruner_removes_chord_counters_whose_header_can_no_longer_complete(pg, broker, client_app):
    from celery_lease.db.schema import chords

    mod = client_app(pg, broker, module=NATIVE)
    store = mod.leases.store
    live = mod.inc.submit({"n": 1})
    done = mod.inc.submit({"n": 2})
    mod.leases.cancel(done.id)
    never = str(uuid.uuid4())  # a header job that was never written
    cases = {"old_orphan": [done.id, never], "old_live": [live.id, done.id], "young_orphan": [never]}
    ids = {name: str(uuid.uuid4()) for name in cases}
    for name, members in cases.items():
        store.create_chord(ids[name], members, {"task": "body"})
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        old = sa.func.now() - sa.text("interval '2 hours'")
        conn.execute(sa.update(chords).where(chords.c.id.in_([ids["old_orphan"], ids["old_live"]])).values(created_at=old))
    mod.leases.prune(older_than=3600)
    with engine.connect() as conn:
        left = {str(r[0]) for r in conn.execute(sa.select(chords.c.id))}
    engine.dispose()
    assert left == {ids["old_live"], ids["young_orphan"]}
