"""The claim made ahead of the pool (``lease_claim_ahead``, PostgreSQL, prefork).

Without it each pool child claims the job its wakeup names in ``task_prerun``: one
durable round trip per job, in the child, before the body. With it, the worker's main
process holds each wakeup it receives for a short window (``WINDOW`` seconds), claims
as many as there are free pool processes with ONE durable statement
(db/statements/claim_batch.py) and hands each claimed request to the pool with its
lease in the request (``LEASE``: the claimed row, and when the claim was sent). The
child's ``task_prerun`` takes that attempt (:meth:`WorkerState.adopt_ahead`) instead of
claiming; heartbeat, cancel notices, timeouts and the outcome's fenced write are the
child's as before. A wakeup whose job could not be claimed (a duplicate, not due,
terminal, of a paused kind) is acked here and never reaches the pool.

Invariants:

* the lease owner is the main process's (``node/pid/boot``); the leases its children
  run are fenced by their generation as any other. A child killed mid-job is reported
  here (WorkerLostError) and its lease released at once (worker/lost.py accepts leases
  owned by this live main process); a killed main process leaves running rows whose
  lease lapses for the reaper, or that restart recovery requeues.
* a lease in a request is trusted only with this boot's ``_SECRET`` (inherited by the
  pool children through fork): the request dict starts as the message's headers, and a
  forged header must not make a child run a job it never claimed.
* a batch whose reply was lost is settled before it is retried (``_Landed``): the rows
  of the batch running under this owner with a generation this process never
  dispatched are the lost try's claims, adopted; the main process claims one batch at a
  time, so no other claim of this owner can be in flight.
* anything the batch does not cover goes the old way, claimed by the child: a
  limited kind (flow control's claim), a batch=N kind (worker/batch.py), a delivery that is not a plain wakeup (the child
  refuses it with its reason), and every delivery of a batch the database refused.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from celery.app.task import Context
from celery.worker.state import reserved_requests, task_ready
from celery.worker.strategy import default

from celery_lease.db.statements.claim_batch import adopt_batch, claim_batch
from celery_lease.errors import LeaseError
from celery_lease.job import parse_job_id
from celery_lease.worker import borne, shutdown
from celery_lease.worker.attempt import owner_of

if TYPE_CHECKING:
    from celery_lease.db.store import Store

log = logging.getLogger("celery_lease.worker")

#: The request key that carries a claimed lease to the pool child.
LEASE = "lease_claim"
#: Seconds a wakeup waits for others to share its claim (most of a burst's wakeups
#: arrive within it: the event loop reads what is buffered before the timer fires).
WINDOW = 0.002
#: Seconds between looks for a free pool process while all are busy and no request
#: handed to the pool has ended (a process may be running a request that went the old way).
POLL = 0.05
#: Wakeups claimed by one statement at most (the prefetch bounds a batch anyway).
MAX_BATCH = 200
#: Generations this process dispatched, remembered to tell a lost try's claims apart.
REMEMBERED = 100_000

_SECRET = secrets.token_hex(16)


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """The consumer strategy of a LeaseTask: Celery's own, whose hand-over to the pool
    goes through the main process's :class:`Ahead` when the setting is on and the
    worker runs an event loop over a prefork pool."""
    if not _applies(task, consumer):
        return default(task, app, consumer, **kwargs)
    ahead = consumer.__dict__.get("_celery_lease_ahead")
    if ahead is None:
        ahead = consumer.__dict__["_celery_lease_ahead"] = Ahead(consumer)
    return default(task, app, _Handing(consumer, ahead.hold), **kwargs)


def _applies(task: Any, consumer: Any) -> bool:
    from celery.concurrency.prefork import TaskPool

    owner = getattr(task, "owner", None)
    return (
        owner is not None
        and owner.settings.claim_ahead
        and owner.store.dialect == "postgresql"
        and getattr(consumer, "hub", None) is not None
        and isinstance(consumer.pool, TaskPool)
    )


class _Handing:
    """The consumer as Celery's strategy sees it, but for the hand-over of a request."""

    def __init__(self, consumer: Any, hold: Any) -> None:
        self._consumer = consumer
        self.on_task_request = hold

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def lease_of(request: Any) -> dict[str, Any] | None:
    """The lease the main process claimed for ``request`` (a task's context), or None."""
    lease = getattr(request, LEASE, None)
    if isinstance(lease, dict) and lease.get("secret") == _SECRET:
        return lease
    return None


def _plain_wakeup(req: Any) -> bool:
    """The child's own refusal check, run on the request here: only a delivery that
    passes it is claimed ahead (a refused one must not take a lease)."""
    _, _, embed = req._payload
    context = Context({**req.request_dict, **(embed or {})})
    return borne.wakeup_refusal(context) is None


class _Landed(Exception):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        super().__init__("batch landed")
        self.rows = rows


class Ahead:
    """The main process's batched claim (one per consumer).

    A claim's lease runs from the moment it is sent, so a wakeup is claimed only for a
    pool process that is free now: the body starts at once, as when the child claimed
    it. With every process busy, wakeups stay held (unacked, unclaimed) until a request
    handed to the pool ends (its result callback asks for a flush), or ``POLL`` passes
    (a process taken by a request that went the old way); a claimed lease never waits
    in the pool's queue behind a body (a database outage that stalls the bodies would
    let it lapse unrun, its attempt spent)."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self._owner = owner_of(consumer.hostname)
        self._held: list[Any] = []
        self._timer: Any = None
        self._due = float("inf")  # when the timer fires (monotonic)
        self._dispatched: OrderedDict[tuple[str, int], None] = OrderedDict()

    def hold(self, req: Any) -> None:
        req.request_dict.pop(LEASE, None)  # only this process puts one there
        spec = req.task.spec
        if spec.limits is not None or spec.batch is not None or not _plain_wakeup(req):
            self._consumer.on_task_request(req)
            return
        self._held.append(req)
        self._flush_in(WINDOW)

    def _flush_in(self, delay: float) -> None:
        """A flush within ``delay`` seconds (an earlier one already due stands)."""
        due = time.monotonic() + delay
        if self._timer is not None:
            if self._due <= due:
                return
            self._timer.cancel()
        self._timer, self._due = self._consumer.hub.call_later(delay, self.flush), due

    def _ended(self, callback: Any) -> Any:
        """``callback`` (a request's result callback), then a flush for the held wakeups."""

        def ended(*args: Any, **kwargs: Any) -> Any:
            try:
                return callback(*args, **kwargs)
            finally:
                if self._held:
                    self._flush_in(0)

        return ended

    def _free(self) -> int:
        """Pool processes with no request handed to them: every reserved request is
        either held here or handed to the pool (leased ones never wait for a bucket)."""
        return self._consumer.pool.num_processes - (len(reserved_requests) - len(self._held))

    def flush(self) -> None:
        self._timer, self._due = None, float("inf")
        free = min(self._free(), MAX_BATCH)
        if free <= 0 or not self._held:
            if self._held:  # all busy: a request's end flushes, or this look
                self._flush_in(POLL)
            return
        batch, self._held = self._held[:free], self._held[free:]
        if self._held:
            self._flush_in(POLL)
        handle = self._consumer.on_task_request
        if shutdown.requested():
            for req in batch:  # the child re-wakes each job for another worker
                handle(req)
            return
        by_owner: dict[int, list[Any]] = {}
        for req in batch:
            by_owner.setdefault(id(req.task.owner), []).append(req)
        for reqs in by_owner.values():
            self._dispatch(reqs, handle)

    def _dispatch(self, reqs: list[Any], handle: Any) -> None:
        sent_at = time.monotonic()
        try:
            rows = self._claim(reqs[0].task.owner.store, reqs)
        except LeaseError:
            log.warning("celery-lease: a batch of %d claims failed; each is claimed by its pool process", len(reqs))
            for req in reqs:
                handle(req)
            return
        for req in reqs:
            row = rows.pop(parse_job_id(req.id), None)
            if row is None:
                log.info("celery-lease: job %s: duplicate or not claimable delivery; skipped", req.id)
                req.acknowledge()
                task_ready(req)
                continue
            self._remember((req.id, row["lease_generation"]))
            req.request_dict[LEASE] = {**row, "sent_at": sent_at, "secret": _SECRET}
            # (Celery's request class has no __slots__: the pool calls these attributes.)
            req.on_success, req.on_failure = self._ended(req.on_success), self._ended(req.on_failure)
            handle(req)

    def _claim(self, store: Store, held: list[Any]) -> dict[str, dict[str, Any]]:
        """The rows the batch claimed, by job id (a cancelled one too: its child runs
        what a cancel sets off and starts nothing)."""
        deliveries = list({(parse_job_id(req.id), req.task.name) for req in held})
        params = {"deliveries": deliveries, "owner": self._owner}
        engine = store.engine(single=True)
        retried = False

        def landed() -> None:
            nonlocal retried
            retried = True
            ids = [job_id for job_id, _ in deliveries]
            adopt = adopt_batch()
            try:
                found = store.transaction(
                    engine, lambda c: [dict(r) for r in c.execute(adopt, {"job_ids": ids, "owner": self._owner}).mappings()]
                )
            except LeaseError:
                return  # still unreachable: the retry finds out
            rows = [r for r in found if (str(r["id"]), r["lease_generation"]) not in self._dispatched]
            if rows:
                log.warning("celery-lease: a batch's claims had landed before the reply was lost; %d adopted", len(rows))
                raise _Landed(rows)

        stmt = claim_batch()
        try:
            rows = store.transaction(engine, lambda c: [dict(r) for r in c.execute(stmt, params).mappings()], on_retry=landed)
            if not rows and retried:
                landed()  # the retry claimed nothing: the first try may have
        except _Landed as found:
            rows = found.rows
        return {str(row["id"]): row for row in rows}

    def _remember(self, key: tuple[str, int]) -> None:
        self._dispatched[key] = None
        if len(self._dispatched) > REMEMBERED:
            self._dispatched.popitem(last=False)
