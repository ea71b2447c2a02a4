"""A delivery that holds its wakeup's mark (broker/waking.py, worker/many_claim.py), in one
process against real PostgreSQL and Redis: while it holds, submits of its kind publish
nothing and its claims take their jobs; whichever way it stops holding (nothing came, the
mark went, out of time, a warm stop), no job it counted is left without a claim or a
wakeup."""

from __future__ import annotations

import pytest
import redis

from celery_lease.worker import many_claim, shutdown
from tests.integration.test_batch import rows

HOST = "w@host"
QUEUE = "celery"


@pytest.fixture
def mod(pg, broker, client_app):
    return client_app(pg, broker, module="tests.apps.app_batch")


@pytest.fixture
def queue(broker):
    client = redis.Redis.from_url(broker)
    yield lambda: client.llen(QUEUE)
    client.close()


@pytest.fixture
def echo(mod, monkeypatch):
    """The tests' default kind, one job of it run here first: its bodies are known short.
    What counts as short is pinned: on a loaded machine (CI runs these beside workers) an
    echo attempt can take longer than HOLD_BODY_SECONDS, and its delivery would not hold."""
    monkeypatch.setattr(many_claim, "HOLD_BODY_SECONDS", 1.0)
    spec = mod.leases.registry.resolve("echo")
    worker = mod.leases.worker
    worker.completer.LINGER = 60.0  # (the flush writes the endings)
    job = mod.leases.submit("echo", {"value": -1})
    lead = worker.begin(job.id, spec, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is None  # its first: nothing known, nothing held
    _run(mod, spec, lead)
    return spec


def _run(mod, spec, lead) -> None:
    worker = mod.leases.worker
    worker.execute(spec, lead)
    worker.end(lead)
    worker.flush()


def _submit(mod, n: int) -> list[str]:
    return [mod.leases.submit("echo", {"value": i}).id for i in range(n)]


def _mark(mod, spec):
    waking = mod.leases.producer.waking
    client = redis.Redis.from_url(mod.app.conf.broker_url)
    key = waking.mark_of(spec.task, QUEUE)
    return lambda: client.get(key)


def test_a_holder_claims_what_is_submitted_while_it_holds_and_lets_go_when_nothing_came(pg, mod, echo, queue):
    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    sent = queue()
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is not None  # a short kind's delivery holds
    assert mark() == b"1"  # read, not deleted
    later = _submit(mod, 3)
    assert queue() == sent and mark() == b"4"  # counted; no message
    _run(mod, echo, lead)  # its job, then (the count moved) a claim of the three
    assert [r.status for r in rows(pg, [first, *later])] == ["succeeded"] * 4
    assert mark() is None  # nothing came since its last look: let go
    assert mod.leases.worker.heartbeat.held_jobs() == set()
    _submit(mod, 1)
    assert queue() == sent + 1  # a submit after it publishes


def test_a_holder_whose_mark_went_claims_once_more(pg, mod, echo, queue, monkeypatch):
    """The mark lapsed (a body ran past its lifetime) or was deleted: the holder cannot
    tell what was counted since its look, so one more claim takes it."""
    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is not None
    later = _submit(mod, 2)  # counted on the mark ...
    redis.Redis.from_url(mod.app.conf.broker_url).delete(mod.leases.producer.waking.mark_of(echo.task, QUEUE))
    _run(mod, echo, lead)  # ... which went before the holder looked again
    assert [r.status for r in rows(pg, [first, *later])] == ["succeeded"] * 3
    assert mark() is None and mod.leases.worker.heartbeat.held_jobs() == set()


def test_a_holder_out_of_time_lets_go_and_claims_once_more(pg, mod, echo, queue, monkeypatch):
    monkeypatch.setattr(many_claim, "CLAIM_AGAIN_SECONDS", 0.0)
    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is not None
    later = _submit(mod, 2)
    _run(mod, echo, lead)
    assert [r.status for r in rows(pg, [first, *later])] == ["succeeded"] * 3
    assert mark() is None  # let go: the next submit publishes
    sent = queue()
    _submit(mod, 1)
    assert queue() == sent + 1


def test_a_warm_stop_hands_back_what_a_holder_counted(pg, mod, echo, queue):
    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is not None
    later = _submit(mod, 2)
    sent = queue()
    shutdown.request()
    try:
        _run(mod, echo, lead)
    finally:
        shutdown.reset()
    # The lead ran (its body had started); the two counted were claimed once more and
    # handed back, each with a wakeup of its own, their attempt not spent.
    assert [(r.status, r.attempt) for r in rows(pg, [first, *later])] == [("succeeded", 1)] + [("pending", 0)] * 2
    assert queue() == sent + 2
    assert mark() is None and mod.leases.worker.heartbeat.held_jobs() == set()


def test_a_kind_whose_bodies_ran_long_deletes_its_mark_before_it_claims(pg, mod, echo, queue, monkeypatch):
    """Held through a long body, the mark would keep the jobs submitted meanwhile from
    the other pool processes: such a kind's delivery lets it go first, as a lone one does."""
    monkeypatch.setattr(many_claim, "HOLD_BODY_SECONDS", 0.0)
    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is None
    assert mark() is None
    sent = queue()
    (other,) = _submit(mod, 1)
    assert queue() == sent + 1  # its own wakeup, for another process
    _run(mod, echo, lead)
    assert [r.status for r in rows(pg, [first])] == ["succeeded"]
    assert rows(pg, [other])[0].status == "pending"  # not this delivery's: its wakeup's


def test_a_holders_full_claim_wakes_another_process_whatever_its_mark(pg, mod, echo, queue, monkeypatch):
    """Counted on the held mark, the full claim's wakeup would not go: it is pushed."""
    # Every claim takes DEFAULT_CAP whatever the attempts took here (on a loaded machine
    # an echo can take over CLAIM_SECONDS / DEFAULT_CAP, and there would be two full claims).
    monkeypatch.setattr(many_claim, "CLAIM_SECONDS", 3600.0)
    (first,) = _submit(mod, 1)
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is not None
    task = mod.app.tasks[echo.task]
    later = [j.id for j in task.submit_many([{"value": i} for i in range(many_claim.DEFAULT_CAP + 20)])]
    sent = queue()
    _run(mod, echo, lead)  # a claim of DEFAULT_CAP (full), then one of the rest
    assert queue() == sent + 1  # the full claim's wakeup, for the other pool processes
    assert {r.status for r in rows(pg, [first, *later])} == {"succeeded"}


def test_a_holder_that_claimed_nothing_claims_again_for_a_submit_counted_after_its_look(pg, mod, echo, monkeypatch):
    """A submit whose row committed after the claim's snapshot, counted before the
    holder let go: the delivery claims once more instead of ending with nothing."""
    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None
    _run(mod, echo, lead)
    assert mark() is None
    (stale,) = _submit(mod, 1)  # its wakeup's delivery comes after a claim took it
    lead = mod.leases.worker.begin(stale, echo, HOST)  # (no routing key: no mark read or held)
    _run(mod, echo, lead)
    claim = many_claim.claim_many
    landed: list[str] = []

    def claim_then_a_submit(*args, **kwargs):
        found = claim(*args, **kwargs)
        if not landed:
            landed.extend(_submit(mod, 1))
        return found

    monkeypatch.setattr(many_claim, "claim_many", claim_then_a_submit)
    redis.Redis.from_url(mod.app.conf.broker_url).set(mod.leases.producer.waking.mark_of(echo.task, QUEUE), 1)
    lead = mod.leases.worker.begin(stale, echo, HOST, QUEUE)  # the stale delivery: holds, finds nothing
    assert lead is not None and [a.job_id for a in lead.claimed_together] == landed
    assert lead.holds_mark is None and mark() is None  # let go before that claim
    _run(mod, echo, lead)
    assert [r.status for r in rows(pg, landed)] == ["succeeded"]


def test_a_holder_whose_first_claim_fails_lets_go_of_its_mark(pg, mod, echo, monkeypatch):
    from celery_lease.errors import DatabaseUnavailable

    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    assert mark() == b"1"

    def unavailable(*_, **__):
        raise DatabaseUnavailable("claim")

    monkeypatch.setattr(many_claim, "claim_many", unavailable)
    with pytest.raises(DatabaseUnavailable):
        mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert mark() is None  # the next submit publishes its own wakeup
    monkeypatch.undo()
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None
    _run(mod, echo, lead)


def test_a_holder_claims_before_any_round_trip_to_redis_then_renews_its_mark(pg, mod, echo, monkeypatch):
    """A lone job's start waits for no Redis reply: the holder knows the count its push
    set (waking.PUSHED) without reading it, and renews its mark after the claim."""
    from celery_lease.broker import waking as waking_module

    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    waking = mod.leases.producer.waking
    order: list[str] = []  # every Redis call of the mark's, by what it does
    names = {waking_module._LOOK: "look", waking_module._RENEW: "renew", waking_module._RELEASE: "release"}
    script, delete = waking._script, waking._delete
    monkeypatch.setattr(waking, "_script", lambda s, *a: (order.append(names[s]), script(s, *a))[1])
    monkeypatch.setattr(waking, "_delete", lambda keys: (order.append("delete"), delete(keys))[1])
    claim = many_claim.claim_many

    def claim_recorded(*args, **kwargs):
        order.append("claim")
        return claim(*args, **kwargs)

    monkeypatch.setattr(many_claim, "claim_many", claim_recorded)
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and lead.holds_mark is not None and lead.holds_mark.seen == waking_module.PUSHED
    assert order == ["claim", "renew"]
    ttl = redis.Redis.from_url(mod.app.conf.broker_url).pttl(waking.mark_of(echo.task, QUEUE))
    assert 0 < ttl <= waking_module.HOLD_TTL_MS < waking_module.MARK_TTL_MS  # renewed: a long body holds no one back long
    _run(mod, echo, lead)
    assert order[:3] == ["claim", "renew", "release"] and mark() is None  # released: nothing came since the push


def test_a_holder_whose_count_had_moved_before_its_claim_claims_once_more(pg, mod, echo, queue, monkeypatch):
    """Submits counted between the push and the claim: the claim took them, but the
    holder, its count unread, cannot tell; it claims once more (finding nothing) and lets go."""
    mark = _mark(mod, echo)
    (first,) = _submit(mod, 1)
    before = _submit(mod, 2)  # counted on the mark before the delivery's claim
    assert mark() == b"3"
    lead = mod.leases.worker.begin(first, echo, HOST, QUEUE)
    assert lead is not None and {a.job_id for a in lead.claimed_together} == {first, *before}
    claims: list[int] = []
    claim = many_claim.claim_many

    def counted(*args, **kwargs):
        found = claim(*args, **kwargs)
        claims.append(len([r for r in found if r["id"] is not None]))
        return found

    monkeypatch.setattr(many_claim, "claim_many", counted)
    _run(mod, echo, lead)
    assert claims == [0]  # once more, for what it could not tell
    assert [r.status for r in rows(pg, [first, *before])] == ["succeeded"] * 3
    assert mark() is None and mod.leases.worker.heartbeat.held_jobs() == set()
    sent = queue()
    _submit(mod, 1)
    assert queue() == sent + 1
