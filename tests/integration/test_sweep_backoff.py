"""The sweeper's re-sends back off: a wakeup that stays unclaimed is far more often
queued behind a broker backlog than lost, and re-sending it every threshold fed the
backlog it waited behind (celery_lease/db/statements/maintenance.py, _resend_due)."""

from __future__ import annotations

import time

import pytest

#: The staleness threshold of these tests (seconds).
STALE = 0.5


def _resends(store, job_id: str, seconds: float) -> list[float]:
    """When (seconds from now) the sweeper re-sent ``job_id``'s wakeup, sweeping every 50 ms."""
    out: list[float] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if any(str(r["id"]) == job_id for r in store.claim_due_wakeups(STALE, 100)):
            out.append(round(time.monotonic() - started, 2))
        time.sleep(0.05)
    return out


def test_a_wakeup_nobody_claims_is_resent_after_one_threshold_then_at_doubling_intervals(pg, client_app):
    """Nothing consumes the memory broker: the job's wakeup stays queued. Re-sent every
    threshold, it would be sent 7 times in 3.6 s; backing off, after 0.5, 1 and 2 s
    (the job's wait when last woken, at most 4 thresholds)."""
    mod = client_app(pg, "memory://")
    job = mod.echo.submit({"value": 1})
    resent = _resends(mod.leases.store, job.id, 3.6)
    assert 2 <= len(resent) <= 4, resent
    assert resent[0] < 1.5, "the first re-send still comes after one threshold"


def test_resends_back_off_no_further_than_four_thresholds(pg, client_app):
    """A job woken long after it became pending (held by a limit for an hour, say) is
    re-sent after at most 4 thresholds, not after its whole wait."""
    import sqlalchemy as sa

    mod = client_app(pg, "memory://")
    job = mod.echo.submit({"value": 1})
    engine = sa.create_engine(pg)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE celery_lease_jobs SET updated_at = now() - interval '1 hour' WHERE id = :id"), {"id": job.id}
        )
    engine.dispose()
    resent = _resends(mod.leases.store, job.id, 2.6)
    assert len(resent) == 1 and 1.9 <= resent[0] <= 2.6, resent


class _Queue:
    """The broker queue "celery", counted and emptied through kombu (any transport)."""

    def __init__(self, url: str) -> None:
        from kombu import Connection

        self.conn = Connection(url)

    def count(self) -> int:
        channel = self.conn.channel()
        try:
            return channel.queue_declare(queue="celery", passive=True).message_count
        except self.conn.channel_errors:  # a Redis list is gone once empty
            return 0
        finally:
            channel.close()

    def purge(self) -> None:
        channel = self.conn.channel()
        try:
            channel.queue_purge("celery")
        finally:
            channel.close()


@pytest.mark.parametrize("transport", ["redis", "amqp"])
def test_a_job_no_worker_takes_has_a_bounded_number_of_wakeups_queued(pg, client_app, request, transport):
    """Nobody consumes the job's queue (a real Redis, a real RabbitMQ): its wakeup stays
    there. Backing off alone, the sweeper still added a copy every RESEND_BACKOFF_MAX
    thresholds, without end (17 copies after 60 thresholds). A re-send is published only
    when the broker's queue cannot hold an earlier copy (celery_lease/broker/resends.py): here,
    never. Once that wakeup is lost (the queue purged), it is re-sent within the backoff."""
    url = request.getfixturevalue("broker") if transport == "redis" else request.getfixturevalue("amqp_broker").url
    stale = 0.1
    mod = client_app(pg, url, conf={"lease_sweep_stale_seconds": stale})
    queue = _Queue(url)
    try:
        job = mod.echo.submit({"value": 1})
        assert queue.count() == 1
        started = time.monotonic()
        while time.monotonic() - started < 60 * stale:
            mod.leases.sweep()
            time.sleep(stale / 5)
        assert queue.count() <= 2, queue.count()

        queue.purge()  # the wakeup is lost (a broker restart without persistence)
        deadline = time.monotonic() + 5 * stale  # the backoff: at most RESEND_BACKOFF_MAX thresholds
        while queue.count() == 0 and time.monotonic() < deadline:
            mod.leases.sweep()
            time.sleep(stale / 5)
        assert queue.count() == 1
        assert mod.leases.get(job.id).status.value == "pending"
    finally:
        queue.conn.release()
