"""A limited kind's claim may wait on its kind's limits row lock: no lease of this
process may lapse meanwhile (#18 item 7), and a claim whose own lease lapsed during the
wait must not start its body. Real PostgreSQL and Redis, the worker side of a real app
(WorkerState) driven as Celery's signals drive it; the lock is held from the test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs, limits

HOST = "celery@flow-leases"


def _app(client_app, pg, broker, *, limited_lease: int = 60):
    """The tests' app with two kinds: ``quick`` (unlimited, a 2 s lease) and ``limited``
    (concurrency 1); the limited kind's limits row exists (its lock can be held). One
    job per delivery (the single claim, whose priority swap these tests follow)."""
    mod = client_app(pg, broker, conf={"lease_coalesce_wakeups": False})
    leases = mod.leases
    quick = leases.job(kind="fl_quick", lease_seconds=2, name="tests.flow_leases.quick")(lambda ctx, p: {"ok": 1})
    limited = leases.job(kind="fl_limited", concurrency=1, lease_seconds=limited_lease, name="tests.flow_leases.limited")(
        lambda ctx, p: {"ran": True}
    )
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(sa.delete(limits).where(limits.c.kind == "fl_limited"))
        conn.execute(limits.insert().values(kind="fl_limited", concurrency=1, updated_at=sa.func.now()))
    engine.dispose()
    return mod, quick.spec, limited.spec


def _submit(mod, spec) -> str:
    return str(mod.leases.store.insert_jobs([mod.leases.producer.job_row(spec, {}, {})], keyed=False)[0].id)


def _swap(client_app, pg, broker):
    """A ``quick`` job (``low``) and one of higher priority (``high``): a delivery of
    ``low`` claims ``high`` in its place, and the claim's follow-up publishes ``low``'s
    new wakeup (flow._publish)."""
    mod, quick, _ = _app(client_app, pg, broker)
    leases = mod.leases
    low = _submit(mod, quick)
    high = str(leases.store.insert_jobs([leases.producer.job_row(quick, {}, {"priority": 5})], keyed=False)[0].id)
    return leases.worker, quick, low, high


@contextmanager
def _kind_locked(pg, kind: str, seconds: float) -> Iterator[None]:
    """Another connection holds ``kind``'s limits row lock for ``seconds`` (as a
    slow release or claim of the kind would)."""
    locked = threading.Event()

    def hold() -> None:
        engine = sa.create_engine(pg)
        try:
            with engine.begin() as conn:
                conn.execute(sa.select(limits.c.kind).where(limits.c.kind == kind).with_for_update())
                locked.set()
                time.sleep(seconds)
        finally:
            engine.dispose()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        yield
    finally:
        holder.join(seconds + 10)


def _row(pg, job_id: str) -> sa.Row:
    engine = sa.create_engine(pg)
    try:
        with engine.connect() as conn:
            query = sa.select(jobs.c.status, jobs.c.attempt, jobs.c.lease_generation, jobs.c.result)
            return conn.execute(query.where(jobs.c.id == job_id)).one()
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_a_finished_success_is_not_held_hostage_by_a_limited_claims_lock_wait(pg, broker, client_app):
    """#18 item 7: a success waiting to ride on the process's next claim, and that claim
    a limited kind's, stalled 3 s on its kind's lock. The success must not wait in the
    claim, unrenewed (its 2 s lease lapsed there: dropped, its job requeued and run
    again): the completer's thread writes it meanwhile."""
    mod, quick, limited = _app(client_app, pg, broker)
    worker = mod.leases.worker
    worker.completer.LINGER = 0.3  # type: ignore[attr-defined]  # the ride it waits for comes sooner
    done, claimed = _submit(mod, quick), _submit(mod, limited)
    with _kind_locked(pg, "fl_limited", 3.0):
        attempt = worker.begin(done, quick, HOST)
        assert attempt is not None
        assert worker.execute(quick, attempt) == {"ok": 1}
        worker.end(attempt)  # the success waits for a ride
        started = time.monotonic()
        second = worker.begin(claimed, limited, HOST)  # waits for the kind's lock
        assert time.monotonic() - started > 2.0  # (the lock was waited for: the test tests something)
    assert second is not None
    worker.end(second)
    worker.flush()
    row = _row(pg, done)
    assert (row.status, row.attempt, row.lease_generation, row.result) == ("succeeded", 1, 1, {"ok": 1})


@pytest.mark.timeout(60)
def test_a_claim_whose_lease_lapsed_during_its_lock_wait_does_not_start_its_body(pg, broker, client_app):
    """A limited kind with a 2 s lease whose claim waits 2.5 s on its kind's lock: the
    claim commits, but its lease (counted from before it was sent) has lapsed, and the
    reaper and another worker may take the job any moment. The body must not start:
    the job is handed off, its attempt not spent, and the next claim runs it."""
    mod, _, limited = _app(client_app, pg, broker, limited_lease=2)
    worker = mod.leases.worker
    job = _submit(mod, limited)
    with _kind_locked(pg, "fl_limited", 2.5):
        late = worker.begin(job, limited, HOST)
    assert late is None  # not started
    row = _row(pg, job)
    assert (row.status, row.attempt, row.lease_generation) == ("pending", 0, 1)
    again = worker.begin(job, limited, HOST)  # (the hand-off's wakeup, delivered)
    assert again is not None and (again.attempt, again.generation) == (1, 2)
    assert worker.execute(limited, again) == {"ran": True}
    worker.end(again)
    worker.flush()
    assert _row(pg, job).status == "succeeded"


@pytest.mark.timeout(60)
def test_a_claims_slow_follow_up_does_not_cost_the_job_it_claimed(pg, broker, client_app, monkeypatch):
    """A delivery of a low-priority job claims a higher-priority one in its place, and
    the claim's follow-up publishes the delivered job's new wakeup: with the broker slow
    (here 1.5 s, as kombu retrying a publish through a broker restart) on a 2 s lease.
    The claimed attempt joins the heartbeat before its follow-ups run, so its lease is
    renewed meanwhile and its body starts. (It joined after them: past half its lease
    counted from the claim's send, the job was handed off, the claim wasted.)"""
    worker, quick, low, high = _swap(client_app, pg, broker)
    flow = worker.flow
    publish = flow._publish

    def slow_publish(rows):
        time.sleep(1.5)
        return publish(rows)

    monkeypatch.setattr(flow, "_publish", slow_publish)
    started = time.monotonic()
    attempt = worker.begin(low, quick, HOST)
    assert time.monotonic() - started > 1.5  # (the follow-up was slow: the test tests something)
    assert attempt is not None and attempt.job_id == high
    assert worker.execute(quick, attempt) == {"ok": 1}
    worker.end(attempt)
    worker.flush()
    row = _row(pg, high)
    assert (row.status, row.attempt, row.lease_generation, row.result) == ("succeeded", 1, 1, {"ok": 1})
    assert _row(pg, low).status == "pending"  # its new wakeup went out, late


@pytest.mark.timeout(60)
def test_a_claim_whose_renewals_failed_during_its_follow_ups_is_still_handed_off(pg, broker, client_app, monkeypatch):
    """The claimed job's row stays locked by another transaction while the claim's
    follow-up (the swapped-out job's new wakeup) is slow: every renewal skips the locked
    row, so by the attempt's own clock its lease lapses (0.8 of it, unconfirmed) and the
    heartbeat marks it lost. Past half its lease the body must not start: the job is
    handed off, its attempt not spent, as soon as the lock is gone. (Were the lapse seen
    by this clock alone kept, the fenced hand-off would be refused and the job would stay
    running until the reaper spent its only attempt.)"""
    worker, quick, low, high = _swap(client_app, pg, broker)
    flow = worker.flow
    publish = flow._publish
    seen: list[tuple[str, bool, bool]] = []  # the heartbeat's attempts once the lock is let go

    def slow_publish(rows):
        engine = sa.create_engine(pg)
        try:
            with engine.begin() as conn:
                conn.execute(sa.select(jobs.c.id).where(jobs.c.id == high).with_for_update())
                held = list(worker.heartbeat._attempts.values())
                deadline = time.monotonic() + 10
                while not all(a.lost.is_set() for a in held) and time.monotonic() < deadline:
                    time.sleep(0.05)
                seen.extend((a.job_id, a.lost.is_set(), a.known_lost) for a in held)
        finally:
            engine.dispose()
        return publish(rows)

    monkeypatch.setattr(flow, "_publish", slow_publish)
    assert worker.begin(low, quick, HOST) is None
    # The fault happened: the claimed attempt was in the heartbeat, which lost it by
    # its own clock (lapsed, not known lost: no renewal matched no row).
    assert seen == [(high, True, False)]
    row = _row(pg, high)
    assert (row.status, row.attempt, row.lease_generation) == ("pending", 0, 1)
    assert _row(pg, low).status == "pending"
