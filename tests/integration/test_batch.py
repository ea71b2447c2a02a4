"""A batched kind (``batch=N``, worker/many_claim.py) in one process, against real PostgreSQL:
one statement claims many jobs, one statement completes their successes, and each job
keeps its own lease, attempt, fencing and outcome (a poison value, a raising handler, a
lease lost on one row touch only that job)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from celery_lease.db.engine import Database
from celery_lease.db.schema import jobs
from celery_lease.worker import many_claim, shutdown

HOST = "w@host"


@pytest.fixture
def mod(pg, broker, client_app):
    return client_app(pg, broker, module="tests.apps.app_batch")


@contextlib.contextmanager
def job_updates() -> Iterator[list[str]]:
    """The statements that update job rows, sent while the block runs (renewals aside):
    through SQLAlchemy, or EXECUTEd as prepared on the driver's connection (db/prepared.py)."""
    seen: list[str] = []

    def record(conn, cursor, statement, *_):
        if "UPDATE celery_lease_jobs" in statement and "renewable" not in statement:
            seen.append(statement)

    executed = Database.execute_prepared

    def execute(self, stmt, *args, **kwargs):
        for part in getattr(stmt, "parts", (stmt,)):  # (a PreparedScript: the lock, then the claim)
            record(None, None, part.prepare_sql)
        return executed(self, stmt, *args, **kwargs)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    Database.execute_prepared = execute
    try:
        yield seen
    finally:
        Database.execute_prepared = executed
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)


def rows(pg, ids: list[str]) -> list[sa.Row]:
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            query = sa.select(jobs.c.id, jobs.c.status, jobs.c.attempt, jobs.c.lease_generation, jobs.c.result, jobs.c.error)
            found = {str(r.id): r for r in conn.execute(query.where(jobs.c.id.in_(ids)))}
    finally:
        engine.dispose()
    return [found[i] for i in ids]


def _claim(mod, first: str):
    with job_updates() as updates:
        lead = mod.leases.worker.begin(first, mod.b_note.spec, HOST)
    assert lead is not None and lead.claimed_together is not None
    assert len(updates) == 1, updates  # the whole batch: ONE statement
    return lead


def test_one_statement_claims_many_and_one_completes_them(pg, mod, monkeypatch):
    monkeypatch.setattr(many_claim, "CLAIM_AGAIN_SECONDS", 0.0)  # (the claim again: the test below)
    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(6)])]
    lead = _claim(mod, ids[0])
    assert [a.job_id for a in lead.claimed_together] == ids[:4]  # batch=4, oldest first, the delivery's own first
    assert {(a.attempt, a.generation) for a in lead.claimed_together} == {(1, 1)}  # each its own attempt and token
    assert [r.status for r in rows(pg, ids)] == ["running"] * 4 + ["pending"] * 2
    worker = mod.leases.worker
    # The flush writes them, not the 2 ms linger: four bodies may take longer than that
    # on a loaded machine (two statements, seen once in a fresh-clone run).
    worker.completer.LINGER = 60.0
    with job_updates() as updates:
        assert worker.execute(mod.b_note.spec, lead) == {"n": 0, "attempt": 1}
        worker.flush()  # (the process's completer writes them, in the background)
    worker.end(lead)
    worker.flush()
    assert len(updates) == 1, updates  # four successes: ONE statement
    assert [(r.status, r.result) for r in rows(pg, ids[:4])] == [("succeeded", {"n": i, "attempt": 1}) for i in range(4)]
    # A delivery of a job the batch ran claims what is left (its wakeup is a duplicate).
    rest = worker.begin(ids[1], mod.b_note.spec, HOST)
    assert rest is not None and [a.job_id for a in rest.claimed_together] == ids[4:]
    worker.execute(mod.b_note.spec, rest)
    worker.end(rest)
    worker.flush()
    assert [r.status for r in rows(pg, ids)] == ["succeeded"] * 6
    assert worker.begin(ids[5], mod.b_note.spec, HOST) is None  # nothing left


def test_a_delivery_whose_claim_came_back_full_claims_again_once_its_jobs_ran(pg, mod):
    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(10)])]
    lead = _claim(mod, ids[0])
    assert lead.claims_again_for is not None  # full: 4 of 10
    worker = mod.leases.worker
    worker.completer.LINGER = 60.0
    with job_updates() as updates:
        assert worker.execute(mod.b_note.spec, lead) == {"n": 0, "attempt": 1}
        worker.flush()
    worker.end(lead)
    claims = [u for u in updates if "SKIP LOCKED" in u]
    # Two claims more (4 + 2, the last one not full: no third), no message between them;
    # and the endings still share statements.
    assert len(claims) == 2, updates
    assert len(updates) - len(claims) < 10, updates
    assert [(r.status, r.result) for r in rows(pg, ids)] == [("succeeded", {"n": i, "attempt": 1}) for i in range(10)]
    assert worker.heartbeat.held_jobs() == set()  # every lease it took is let go
    assert worker.begin(ids[9], mod.b_note.spec, HOST) is None  # nothing left


def test_a_claim_again_that_fails_leaves_the_delivery_its_outcome_and_the_rest_pending(pg, mod, monkeypatch):
    """The jobs of the first claim ran: a claim again that raises (the database away) is
    logged, the delivery reports its own job's outcome, and what is left stays due."""
    from celery_lease.errors import DatabaseUnavailable

    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(6)])]
    lead = _claim(mod, ids[0])
    worker = mod.leases.worker

    def unavailable(*_, **__):
        raise DatabaseUnavailable("claim")

    monkeypatch.setattr(many_claim, "claim_many", unavailable)
    assert worker.execute(mod.b_note.spec, lead) == {"n": 0, "attempt": 1}
    worker.end(lead)
    worker.flush()
    monkeypatch.undo()
    assert [r.status for r in rows(pg, ids)] == ["succeeded"] * 4 + ["pending"] * 2
    assert worker.heartbeat.held_jobs() == set()
    rest = worker.begin(ids[0], mod.b_note.spec, HOST)
    assert rest is not None and sorted(a.job_id for a in rest.claimed_together) == sorted(ids[4:])
    worker.execute(mod.b_note.spec, rest)  # (ended: no lease of this test renewed in later ones)
    worker.end(rest)
    worker.flush()
    assert [r.status for r in rows(pg, ids)] == ["succeeded"] * 6


def test_a_warm_stop_ends_the_claiming_again(pg, mod):
    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(8)])]
    lead = _claim(mod, ids[0])
    worker = mod.leases.worker
    shutdown.request()
    try:
        worker.execute(mod.b_note.spec, lead)
        worker.end(lead)
        worker.flush()
    finally:
        shutdown.reset()
    statuses = [r.status for r in rows(pg, ids)]
    # The lead ran (its body had started when the stop came); the claim's others were
    # handed back, and nothing more was claimed.
    assert statuses == ["succeeded"] + ["pending"] * 7, statuses
    assert [r.attempt for r in rows(pg, ids)][1:] == [0] * 7
    assert [r.lease_generation for r in rows(pg, ids)] == [1] * 4 + [0] * 4  # the rest never claimed


def test_a_poison_value_and_a_raising_handler_touch_only_their_own_job(pg, mod):
    payloads = [{"n": 0}, {"raise": True}, {"nul": True}, {"n": 3}]
    ids = [j.id for j in mod.b_note.submit_many(payloads)]
    lead = _claim(mod, ids[0])
    worker = mod.leases.worker
    worker.execute(mod.b_note.spec, lead)
    worker.end(lead)
    worker.flush()
    ok0, raised, poison, ok3 = rows(pg, ids)
    assert (ok0.status, ok3.status) == ("succeeded", "succeeded")
    assert (raised.status, raised.attempt) == ("pending", 1)  # retried: its own attempts (max 2)
    assert (poison.status, poison.attempt) == ("failed", 1), poison.error  # at once: retrying cannot store it
    assert "NUL" in poison.error


def test_a_lease_lost_on_one_row_leaves_the_others_written(pg, mod):
    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(3)])]
    lead = _claim(mod, ids[0])
    engine = sa.create_engine(pg)
    try:
        with engine.begin() as conn:  # a reap and another worker's claim took job 1 meanwhile
            conn.execute(jobs.update().where(jobs.c.id == ids[1]).values(lease_generation=jobs.c.lease_generation + 1))
    finally:
        engine.dispose()
    worker = mod.leases.worker
    worker.execute(mod.b_note.spec, lead)
    worker.end(lead)
    worker.flush()
    first, taken, last = rows(pg, ids)
    assert (first.status, last.status) == ("succeeded", "succeeded")
    assert (taken.status, taken.lease_generation, taken.result) == ("running", 2, None)  # the newer holder's
    assert lead.claimed_together[1].lost.is_set()


@pytest.mark.parametrize("bad", [0, 1001, True, 2.0, "5"])
def test_batch_is_an_int_from_1_to_1000(client_app, pg, broker, bad):
    mod = client_app(pg, broker)
    with pytest.raises(ValueError, match="batch must be an int from 1 to 1000"):
        mod.leases.job(kind="b_bad", batch=bad)


@pytest.fixture
def flow_mod(pg, broker, client_app):
    """The flow-control app, whose batched kinds have limits (b_capped, b_rated,
    b_keyed), and b_open, which has none in code; its spans table created."""
    mod = client_app(pg, broker, module="tests.apps.app_flow")
    engine = sa.create_engine(pg)
    try:
        mod.flow_metadata.create_all(engine)
    finally:
        engine.dispose()
    return mod


def held_of(pg, ids: list[str]) -> list[tuple[str, str | None]]:
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            found = {str(r.id): (r.status, r.held) for r in conn.execute(sa.select(jobs).where(jobs.c.id.in_(ids)))}
    finally:
        engine.dispose()
    return [found[i] for i in ids]


def _claimed(mod, kind: str, job_id: str) -> list[str]:
    """The ids a delivery of ``job_id`` claims in one batch (ONE job update statement)."""
    lead = _lead(mod, kind, job_id)
    return [] if lead is None else [a.job_id for a in lead.claimed_together]


def _lead(mod, kind: str, job_id: str):
    spec = getattr(mod, kind).spec
    with job_updates() as updates:
        lead = mod.leases.worker.begin(job_id, spec, HOST)
    claims = [u for u in updates if "picked" in u]
    assert len(claims) == 1 and updates[0] == claims[0], updates  # after the limits row lock: ONE statement
    return lead


def test_a_limited_batch_claims_at_most_its_free_slots_and_holds_the_rest(pg, flow_mod):
    mod = flow_mod
    ids = [j.id for j in mod.b_capped.submit_many([{"n": i} for i in range(30)])]
    lead = _lead(mod, "b_capped", ids[0])
    assert sorted(a.job_id for a in lead.claimed_together) == sorted(ids[:2])  # N = min(batch=10, concurrency 2 - 0 running)
    # The rest of the first 10 picked are held by the limit; the 11th is the next wakeup's.
    assert held_of(pg, ids[:12]) == [("running", None)] * 2 + [("pending", "limit")] * 8 + [("pending", None)] * 2
    assert _claimed(mod, "b_capped", ids[10]) == []  # both slots taken: nothing
    assert held_of(pg, ids[10:21]) == [("pending", "limit")] * 10 + [("pending", None)]
    # The batch's successes free their slots: as many held jobs are woken as slots freed.
    worker = mod.leases.worker
    worker.execute(mod.b_capped.spec, lead)
    worker.end(lead)
    worker.flush()
    states = held_of(pg, ids)
    assert states[:2] == [("succeeded", None)] * 2
    # Woken (held cleared, a wakeup sent) as slots freed, best first: the oldest held.
    # (Each success freed its slot; a wake counts the running jobs, not the woken.)
    assert states[2:4] == [("pending", None)] * 2
    assert states[2:21].count(("pending", None)) <= 2 + 2 + 1  # and the next wakeup's
    # (The jobs of one submit_many share created_at: which due job comes first is open.)
    assert len(_claimed(mod, "b_capped", ids[2])) == 2  # the two slots freed
    assert _claimed(mod, "b_capped", ids[4]) == []


def test_a_limited_batch_takes_what_the_rate_window_still_takes_and_counts_it(pg, flow_mod):
    from celery_lease.db.schema import limits

    mod = flow_mod
    ids = [j.id for j in mod.b_rated.submit_many([{"n": i} for i in range(12)])]
    assert len(_claimed(mod, "b_rated", ids[0])) == 5  # rate 5/s: N = min(10, 5 left in the window)
    states = held_of(pg, ids)
    assert states.count(("running", None)) == 5
    assert states.count(("pending", "rate")) == 5  # the rest of the batch waits for the next window
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.select(limits.c.rate_claims).where(limits.c.kind == "b_rated")).scalar() == 5
    finally:
        engine.dispose()


def test_a_batch_claim_that_spends_its_window_schedules_the_next_for_the_held(pg, flow_mod):
    """Jobs an earlier claim held for the rate are not picked again: a claim that takes a
    window's last places and holds none itself must still ask for the next window's
    wakeup, or the held wait for the sweeper (e2e test_flow failed 1 run in 7-20)."""
    from celery_lease.db.schema import limits
    from celery_lease.flow.store import FlowStore

    mod = flow_mod
    ids = [j.id for j in mod.b_rated.submit_many([{"n": i} for i in range(12)])]
    assert len(_claimed(mod, "b_rated", ids[0])) == 5  # and 5 held for the rate
    engine = sa.create_engine(pg)
    try:
        with engine.begin() as conn:  # as after that wakeup's delivery: nothing scheduled
            conn.execute(sa.update(limits).where(limits.c.kind == "b_rated").values(woken_window=0))
    finally:
        engine.dispose()
    spent = {"opened": True, "window_claims": 5, "window_rate": 5, "held_rate": 0}
    woken, later = FlowStore(mod.leases.store).many_claim_follow_ups("b_rated", spent)
    assert woken == [] and later is not None
    seconds, carrier = later
    assert 0 <= seconds <= 1.0 and held_of(pg, [str(carrier["id"])]) == [("pending", "rate")]


def test_a_limited_batch_bounds_each_concurrency_key(pg, flow_mod):
    mod = flow_mod
    tenants = ["a", "a", "b", "a", "b", "c"]
    ids = [j.id for j in mod.b_keyed.submit_many([{"tenant": t} for t in tenants])]
    # concurrency=1 per tenant: one job of each key, in claim order; the others held.
    assert sorted(_claimed(mod, "b_keyed", ids[0])) == sorted([ids[0], ids[2], ids[5]])
    assert [h for _, h in held_of(pg, [ids[1], ids[3], ids[4]])] == ["limit"] * 3


def test_an_operators_override_binds_a_batched_kind(pg, flow_mod):
    from celery_lease.flow.limits import LimitChange

    mod = flow_mod
    ids = [j.id for j in mod.b_open.submit_many([{"n": i} for i in range(4)])]
    in_force = mod.leases.flow.set_limits("b_open", LimitChange(concurrency=1))  # once refused for batch=
    assert in_force["concurrency"] == 1
    assert _claimed(mod, "b_open", ids[0]) == ids[:1]
    assert [h for _, h in held_of(pg, ids[1:])] == ["limit"] * 3


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
def test_a_claim_and_a_completion_whose_replies_were_lost_are_found_landed(pg, broker, client_app, prepared):
    """Both commit, then the connection drops before the reply. The claim's pipeline asks
    the server (db/landing.py): run again blindly, it would take the next jobs and
    leave the first batch running with no body until their leases expired. The
    successes (the completer's statement) are read back by their generations: found
    succeeded, not re-run and not given to the reaper."""
    from tests.harness.pgfaults import PgFaultProxy
    from tests.integration.test_lost_replies import reply_lost_once

    url = sa.engine.make_url(pg)
    proxy = PgFaultProxy(url.host or "127.0.0.1", url.port or 5432).start()
    try:
        mod = client_app(proxy.url_for(pg), broker, conf={"lease_prepare_statements": prepared}, module="tests.apps.app_batch")
        ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(8)])]
        worker = mod.leases.worker
        with reply_lost_once(mod.leases.store.durable) as lost:
            lead = worker.begin(ids[0], mod.b_note.spec, HOST)
        assert lost and lead is not None
        assert [(a.job_id, a.attempt, a.generation) for a in lead.claimed_together] == [(i, 1, 1) for i in ids[:4]]
        assert [r.status for r in rows(pg, ids)] == ["running"] * 4 + ["pending"] * 4
        rule = proxy.lose_reply("ended_logged")  # the successes' one statement (its events' CTE)
        worker.execute(mod.b_note.spec, lead)
        worker.end(lead)
        worker.flush()
        assert rule.hits == 1
        assert [(r.status, r.lease_generation) for r in rows(pg, ids[:4])] == [("succeeded", 1)] * 4
    finally:
        proxy.close()


@pytest.mark.parametrize("path", ["direct", "kombu"])
def test_submits_of_a_batched_kind_share_one_wakeup_until_a_delivery_claims(pg, broker, mod, path):
    """The mark and the push are one script on the direct path; with a
    before_task_publish receiver (which may change the body) the message takes kombu's
    publish, after the mark is set on its own. after_task_publish: once per message."""
    import redis
    from celery import signals

    published: list[str] = []

    def after(sender=None, headers=None, **kwargs):
        published.append(headers["id"])

    def before(**kwargs):
        pass

    signals.after_task_publish.connect(after, weak=False)
    if path == "kombu":
        signals.before_task_publish.connect(before, weak=False)
    client = redis.Redis.from_url(broker)
    try:
        before_len = client.llen("celery")
        mod.b_note.submit_many([{"n": i} for i in range(9)])  # batch=4
        mod.b_note.submit({"n": 9})
        assert client.llen("celery") - before_len == 1  # one on its way: its claim takes the rest
        waking = mod.leases.producer.waking
        waking.let_go(waking.mark_of(mod.b_note.spec.task, "celery"))  # a delivery is about to claim
        last = mod.b_note.submit({"n": 10})  # (its mark last found set: asked first, counted)
        assert client.llen("celery") - before_len == 2  # committed after that claim may read: its own
        mod.b_note.submit({"n": 11})  # (its mark last found free: it rides with the push)
        assert client.llen("celery") - before_len == 2
        assert len(published) == 2 and published[-1] == last.id
    finally:
        signals.after_task_publish.disconnect(after)
        signals.before_task_publish.disconnect(before)
        client.close()


def test_one_publish_of_several_kinds_pushes_a_marked_wakeup_only_where_its_mark_was_free(flow_mod, broker):
    """Several wakeups in one pipeline: a kind with a limit in its code (not coalesced) is
    pushed as it is; each coalesced kind's script pushes only if its mark was free.
    after_task_publish goes for exactly the messages pushed."""
    from celery import signals

    from tests.integration.test_native_canvas import _queued

    mod, producer = flow_mod, flow_mod.leases.producer
    marked = mod.unlimited.submit({})  # its mark stays set: no delivery took it
    freed = mod.b_capped.submit({"n": 1})
    producer.waking.let_go(producer.waking.mark_of(mod.b_capped.spec.task, "celery"))  # a delivery is about to claim
    plain = mod.limited2.submit({})
    _queued(broker)
    published: list[str] = []

    def after(sender=None, headers=None, **kwargs):
        published.append(headers["id"])

    signals.after_task_publish.connect(after, weak=False)
    try:
        producer.publish_wakeups([marked, freed, plain], coalesce=True)
    finally:
        signals.after_task_publish.disconnect(after)
    assert sorted(m["headers"]["id"] for m in _queued(broker)) == sorted([freed.id, plain.id])
    assert sorted(published) == sorted([freed.id, plain.id])


def test_an_in_process_run_runs_only_its_own_job(pg, mod):
    other = mod.b_note.submit({"n": 1})
    assert mod.b_note.apply(({"n": 2},)).get(timeout=10) == {"n": 2, "attempt": 1}
    assert rows(pg, [other.id])[0].status == "pending"


def test_a_duplicate_delivery_costs_the_claim_alone_and_a_paused_one_is_held(pg, broker, client_app):
    # (Unprepared: every statement, the claim's and a hold's, passes SQLAlchemy's hook.)
    mod = client_app(pg, broker, conf={"lease_prepare_statements": False}, module="tests.apps.app_batch")
    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(2)])]
    worker, spec = mod.leases.worker, mod.b_note.spec
    lead = _claim(mod, ids[0])  # both
    with job_updates() as updates:
        # Running here, yet claimed again: the job it names may have been reaped and be
        # due (nothing here can tell), and submits may have left theirs to this claim.
        assert worker.begin(ids[1], spec, HOST) is None  # nothing due: the claim alone
    assert len(updates) == 1
    worker.execute(spec, lead)
    worker.end(lead)
    worker.flush()
    with job_updates() as updates:
        assert worker.begin(ids[1], spec, HOST) is None  # done: nothing due, nothing held
    assert len(updates) == 1

    paused = mod.b_note.submit({"n": 3}).id
    mod.leases.pause("b_note")
    assert worker.begin(paused, spec, HOST) is None
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.select(jobs.c.held).where(jobs.c.id == paused)).scalar() == "pause"
    finally:
        engine.dispose()
    mod.leases.resume("b_note")
    again = worker.begin(paused, spec, HOST)
    assert again is not None and again.job_id == paused
    worker.execute(spec, again)
    worker.end(again)
    worker.flush()
    assert rows(pg, [paused])[0].status == "succeeded"


def test_a_job_of_a_cancelled_run_is_cancelled_by_the_batch_claim_never_started(pg, mod, make_job):
    import uuid

    run = str(uuid.uuid4())
    first = mod.b_note.submit({"n": 0}, run_id=run).id
    mod.leases.cancel_run(run)
    # Committed after the cancel (a child written with its parent's success, say).
    late = make_job(pg, kind="b_note", task=mod.b_note.name, run_id=run)
    plain = mod.b_note.submit({"n": 1}).id
    lead = mod.leases.worker.begin(late, mod.b_note.spec, HOST)
    assert lead is not None and [a.job_id for a in lead.claimed_together] == [plain]
    assert [r.status for r in rows(pg, [first, late, plain])] == ["cancelled", "cancelled", "running"]
    mod.leases.worker.execute(mod.b_note.spec, lead)
    mod.leases.worker.end(lead)
    mod.leases.worker.flush()


def test_a_batch_claim_rerun_after_a_lost_reply_and_a_restart_adopts_its_first_rows(broker, client_app):
    """Issue #27 item 2: claim_many commits, its reply is lost, and PostgreSQL restarts
    before the Landing can ask whether it committed, so the claim runs again. Its guard
    ("any due pending job of the kind") took the next four jobs, and the first try's
    four stayed running under this process with no body until the reaper spent their
    attempt. The re-run adopts the first try's rows by the claim's token instead."""
    import psycopg2

    from celery_lease.db import migrate
    from celery_lease.db.store import Store
    from tests.harness import pgcluster

    if not pgcluster.available():
        pytest.skip("needs PostgreSQL server binaries (bash dev.sh test installs them)")
    with pgcluster.private_cluster() as cluster:
        url = cluster.create_database("jobs")
        store = Store(url)
        migrate.upgrade(store)
        store.dispose()
        mod = client_app(url, broker, module="tests.apps.app_batch")
        ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(8)])]
        dialect = mod.leases.store.durable.dialect
        original = dialect.do_commit
        restarted: list[int] = []

        def do_commit(dbapi_connection):
            original(dbapi_connection)  # the claim's durable COMMIT lands
            if not restarted:
                restarted.append(1)
                dbapi_connection.close()
                cluster.restart()  # before the Landing can ask: its question is void
                raise psycopg2.OperationalError("server closed the connection unexpectedly")

        dialect.do_commit = do_commit
        try:
            lead = mod.leases.worker.begin(ids[0], mod.b_note.spec, HOST)
        finally:
            dialect.do_commit = original
        assert restarted == [1]
        assert lead is not None and lead.claimed_together is not None
        assert [(a.job_id, a.attempt, a.generation) for a in lead.claimed_together] == [(i, 1, 1) for i in ids[:4]]
        assert [(r.status, r.lease_generation) for r in rows(url, ids)] == [("running", 1)] * 4 + [("pending", 0)] * 4
        mod.leases.worker.execute(mod.b_note.spec, lead)
        mod.leases.worker.end(lead)
        mod.leases.worker.flush()
        # Each job ran once, on its first token: the rest by the delivery's claim again.
        assert [(r.status, r.lease_generation) for r in rows(url, ids)] == [("succeeded", 1)] * 8
        mod.leases.store.dispose()


def test_a_renewal_after_a_batch_success_landed_warns_of_no_lost_lease(pg, mod, caplog):
    """Issue #27 item 7: the batch's attempts stayed in the heartbeat until their success
    statement returned, so a renewal that ran just after it committed found the rows
    succeeded and logged "lease lost (cancelled or reaped)" for jobs that had succeeded
    on their first attempt. Here that renewal runs right after the completer's commit."""
    from celery_lease.worker.completion import BackgroundCompleter

    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(4)])]
    worker = mod.leases.worker
    lead = _claim(mod, ids[0])
    complete = BackgroundCompleter._write_many
    renewed: list[int] = []  # one entry per injected renewal that ran

    def complete_then_renew(self, items):
        done = complete(self, items)
        worker.heartbeat._renew_held([a for a in lead.claimed_together if a.key in worker.heartbeat._attempts])
        renewed.append(len(items))
        return done

    BackgroundCompleter._write_many = complete_then_renew  # type: ignore[method-assign]
    try:
        with caplog.at_level("WARNING", logger="celery_lease"):
            worker.execute(mod.b_note.spec, lead)
            worker.flush()
    finally:
        BackgroundCompleter._write_many = complete  # type: ignore[method-assign]
    worker.end(lead)
    worker.flush()
    assert [r.status for r in rows(pg, ids)] == ["succeeded"] * 4
    # The injection ran (an error inside it is only logged by the completer: a renamed
    # method left this test checking nothing).
    assert sum(renewed) == 4
    assert not [r.message for r in caplog.records if "lease lost" in r.message]


def test_a_batch_claims_slow_follow_up_does_not_cost_the_batch(pg, broker, client_app, monkeypatch):
    """A full batch's claim wakes what is left of the kind for another process: with the
    broker slow (1.5 s, as kombu retrying a publish through a broker restart) on a 2 s
    lease. The batch's attempts join the heartbeat before that follow-up runs, so their
    leases are renewed meanwhile and the batch runs. (They joined after it: past half the
    lease counted from the claim's send, the whole batch was handed off.)"""
    monkeypatch.setenv("CL_TEST_LEASE", "2")
    mod = client_app(pg, broker, module="tests.apps.app_batch")
    worker = mod.leases.worker
    ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(5)])]
    publish = worker.producer.publish_wakeups

    def slow_publish(wakeups, **kw):
        if wakeups:  # (the claim's transition publishes none, through this same call)
            time.sleep(1.5)
        return publish(wakeups, **kw)

    monkeypatch.setattr(worker.producer, "publish_wakeups", slow_publish)
    started = time.monotonic()
    lead = worker.begin(ids[0], mod.b_note.spec, HOST)
    assert time.monotonic() - started > 1.5  # (the follow-up was slow: the test tests something)
    assert lead is not None and [a.job_id for a in lead.claimed_together] == ids[:4]
    worker.execute(mod.b_note.spec, lead)
    worker.end(lead)
    worker.flush()
    # (The fifth by the delivery's claim again, once the four ran.)
    assert [(r.status, r.attempt, r.lease_generation) for r in rows(pg, ids)] == [("succeeded", 1, 1)] * 5


def test_a_batchs_successes_are_written_through_a_database_outage_within_their_leases(pg, broker, client_app):
    """A reviewer's question: are a batched kind's plain successes retried through a
    database outage, as the completer's are (BackgroundCompleter._write_many)? They
    were not: the batch's one statement met DatabaseUnavailable, the successes were
    logged as given to the reaper, and each job's finished body cost it an attempt. For
    OUTAGE seconds (well within the 30 s leases) every try of that statement loses its
    connection and no new connection is accepted; once the database is back, every
    success lands, under the attempt and fencing token that ran it."""
    import threading

    from tests.harness.pgfaults import PgFaultProxy

    outage_seconds = 2.0
    url = sa.engine.make_url(pg)
    proxy = PgFaultProxy(url.host or "127.0.0.1", url.port or 5432).start()
    try:
        mod = client_app(proxy.url_for(pg), broker, module="tests.apps.app_batch")
        ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(4)])]
        worker = mod.leases.worker
        lead = _claim(mod, ids[0])
        outage = proxy.fail("ended_logged", times=None)  # the successes' one statement (its events' CTE)
        proxy.refuse(outage_seconds)
        threading.Timer(outage_seconds, proxy.remove, [outage]).start()
        started = time.monotonic()
        assert worker.execute(mod.b_note.spec, lead) == {"n": 0, "attempt": 1}
        worker.end(lead)
        worker.flush()
        assert outage.hits >= 1 and time.monotonic() - started >= outage_seconds - 0.5
        assert [(r.status, r.attempt, r.lease_generation, r.result) for r in rows(pg, ids)] == [
            ("succeeded", 1, 1, {"n": i, "attempt": 1}) for i in range(4)
        ]
    finally:
        proxy.close()


def test_on_sqlite_a_limited_batched_kind_claims_one_job_per_wakeup_within_its_limit(sqlite_url, broker, client_app):
    # (SQLite has no batch claim: each delivery is a single claim, limited as any kind's.)
    mod = client_app(sqlite_url, broker, module="tests.apps.app_flow")
    ids = [j.id for j in mod.b_capped.submit_many([{"n": i} for i in range(3)])]
    worker, spec = mod.leases.worker, mod.b_capped.spec
    claimed = [worker.begin(i, spec, HOST) for i in ids]
    assert [a is not None and a.claimed_together is None for a in claimed] == [True, True, False]  # concurrency=2
    assert held_of(sqlite_url, ids) == [("running", None)] * 2 + [("pending", "limit")]
