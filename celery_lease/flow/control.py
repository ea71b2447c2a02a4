"""Flow control across the fleet: concurrency limits, rate limits, priority, pause, all
enforced in the database at claim time, so they hold for every worker and host at once.

Which claim a delivery takes: a kind with no limit claims with CLAIM (no lock; it refuses
a kind an operator's override limits, and the refused delivery reads the overrides afresh);
a limited kind with CLAIM_LIMITED, after locking its row in ``celery_lease_limits``, only
while a slot is free and the rate window has room. A refused job stays ``pending``, its
attempt unspent, ``held`` says why (``limit``, ``rate``, ``pause``), and it is woken when
the cause ends: a slot's release (under the same lock), the next rate window, a resume.
Priority and the pause are guards of every claim. An override lives in the kind's limits
row, read by every claim, hold and wake. docs/flow-control.md is the user's view.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery_lease.broker.wakeups import RETRY_POLICY
from celery_lease.errors import UnknownKind
from celery_lease.flow.limits import LimitChange, Limits, Rate
from celery_lease.flow.store import ClaimResult, FlowStore
from celery_lease.lifecycle.claim import ClaimFollowUps, claim_delivery
from celery_lease.status import Held, Status

if TYPE_CHECKING:
    from celery import Celery

    from celery_lease.db.store import Store
    from celery_lease.settings import Settings

log = logging.getLogger("celery_lease.flow")


class JobKind(Protocol):
    """What flow control reads of a declared kind (kinds.py, a layer above)."""

    @property
    def kind(self) -> str: ...
    @property
    def task(self) -> str: ...
    @property
    def limits(self) -> Limits | None: ...
    @property
    def fair(self) -> bool: ...


class Registry(Protocol):
    """The kinds this process declares (kinds.Registry)."""

    def get(self, kind: str) -> JobKind | None: ...
    def resolve(self, kind: Any) -> JobKind: ...
    def names(self) -> list[str]: ...
    def __iter__(self) -> Iterator[JobKind]: ...


#: Seconds: the least countdown of a rate window's wakeup sent again because it came
#: early, so hosts whose clocks disagree never send it back and forth in a tight loop.
MIN_COUNTDOWN = 0.05
#: What a view of flow control shows per (kind, key).
STATES = ("running", "waiting_limit", "waiting_rate", "waiting_pause", "pending")
#: Seconds a worker process trusts its list of the kinds an operator's override limits
#: while the code declares no limit (a claim on the unlimited path refused by an
#: override the list misses reads it again at once).
OVERRIDES_REFRESH_SECONDS = 2.0
#: Where a limit in force comes from.
CODE, OVERRIDE = "code", "override"
_WAITING = {Held.LIMIT.value: "waiting_limit", Held.RATE.value: "waiting_rate", Held.PAUSE.value: "waiting_pause"}


class FlowControl:
    """Flow control for one CeleryLease: the claim of each delivery, the release of a
    limited job's slot, pause and resume, the sweeper's recovery, the view."""

    def __init__(
        self,
        store: Store,
        app: Celery,
        publish: Callable[[Sequence[dict]], int],
        registry: Registry,
        settings: Callable[[], Settings],
    ) -> None:
        self._store = store
        self._db = FlowStore(store)
        self._app = app
        self._publish = publish
        self._registry = registry
        self._settings = settings
        self._overridden: frozenset[str] = frozenset()
        self._overridden_at = -OVERRIDES_REFRESH_SECONDS
        self._overridden_lock = threading.Lock()

    def limited(self, spec: JobKind, *, fresh: bool = False) -> bool:
        """Whether claims of ``spec`` take the limited path (under its limits row lock):
        the code declares a limit, or an operator's override does (as this process last
        read, at most OVERRIDES_REFRESH_SECONDS ago). ``fresh``: the overrides read now."""
        return spec.limits is not None or spec.kind in self._overridden_kinds(fresh)

    def _overridden_kinds(self, fresh: bool = False) -> frozenset[str]:
        now = time.monotonic()
        if not fresh and now - self._overridden_at < OVERRIDES_REFRESH_SECONDS:
            return self._overridden
        with self._overridden_lock:  # one read per process and period, not one per thread
            if fresh or now - self._overridden_at >= OVERRIDES_REFRESH_SECONDS:
                try:
                    self._overridden = self._db.overridden_kinds()
                except Exception:
                    # Never fail a delivery for it: the last list stands until the next read.
                    log.warning("celery-lease: cannot read which kinds an operator limited", exc_info=True)
                self._overridden_at = now
        return self._overridden

    # --- worker: claim and release ---------------------------------------------------

    def claim(self, job_id: str, spec: JobKind, owner: str, *, follow_ups: ClaimFollowUps | None = None) -> dict[str, Any] | None:
        """Claim the job a delivery names (or a better one); None when nothing is
        claimed. Held jobs are marked; whatever must be woken is published, always to
        the queue stored in the job's row (never the delivery's routing key: a
        message is untrusted input). ``follow_ups``: see celery_lease.lifecycle.claim; a
        priority swap's new wakeup for the delivered job is one of them."""
        limited = self.limited(spec)

        def swapped(row: dict[str, Any]) -> None:
            say = log.debug if spec.fair else log.info  # a fair kind swaps on most claims
            say("celery-lease: job %s (%s): claimed job %s in its place", job_id, spec.kind, row["id"])
            # The swap never leaves the kind and queue: the claimed row's queue is the delivered job's.
            self._publish([{"id": job_id, "task": spec.task, "queue": row["queue"]}])

        f = dataclasses.replace(follow_ups or ClaimFollowUps(), swapped=swapped)
        for _ in range(3):  # again only when nothing held a claimable job (a slot freed meanwhile)
            if not limited:
                row = claim_delivery(self._store, job_id, owner, spec.task, follow_ups=f)
                result = ClaimResult(row=row) if row is not None else self._db.hold(job_id, spec.task)
                if result.retry and self.limited(spec, fresh=True):
                    # Refused by an override this process had not read (CLAIM checks):
                    # claimed again on the limited path.
                    limited = True
                    continue
            else:
                result = self._db.claim_limited(job_id, owner, spec.kind, spec.task, spec.limits, follow_ups=f)
            if not result.retry:
                break
        row = result.row
        try:
            self._follow_up(job_id, spec, result, limited)
        except Exception:
            # Never fail a delivery whose claim committed (its job would stay running
            # with no body): what was not woken is the sweeper's to recover.
            log.warning("celery-lease: job %s (%s): wakeups after the claim not sent; the sweeper will", job_id, spec.kind)
        return row

    def hold(self, job_id: str, spec: JobKind) -> None:
        """A many-job claim (worker/many_claim.py) took nothing: if a pause refused it,
        its delivered job and the kind's other due ones are held, woken by the resume."""
        result = self._db.hold(job_id, spec.task)
        if result.held == Held.PAUSE.value:
            self._db.hold_paused(job_id, spec.task)
        self._follow_up(job_id, spec, result, False)

    def many_claimed(self, job_id: str, spec: JobKind, first: dict[str, Any], own: bool) -> None:
        """After a limited kind's many-job claim (``first``: its first row): its rate window's
        wakes (FlowStore.many_claim_follow_ups); its job not claimed (``own``), as a single claim's."""
        woken, later = self._db.many_claim_follow_ups(spec.kind, first)
        self._follow_up(job_id, spec, ClaimResult(row=first if own else None, wake=woken, later=later), True)

    def _follow_up(self, job_id: str, spec: JobKind, result: ClaimResult, limited: bool) -> None:
        """What a claim's outcome asks to publish: woken jobs, the next window's wakeup,
        an early window wakeup again."""
        if result.wake:
            self._publish(result.wake)
        if result.retry and result.again is not None and limited:
            # Refused, yet held by nothing each time (others took the slots that kept
            # freeing): its delivery goes round again rather than wait for the sweeper.
            self._publish([result.again])
        if result.later is not None:
            self._publish_later(*result.later)
        if result.row is None:
            if result.held is not None:
                log.info("celery-lease: job %s (%s): held by its %s", job_id, spec.kind, result.held)
            elif limited and not result.retry:
                self._spent(job_id)

    def _spent(self, job_id: str) -> None:
        """A delivery of a limited kind that claimed nothing and held nothing."""
        target = self._db.claim_target(job_id)
        if target is None:
            return
        if target["status"] == Status.PENDING.value and target["held"] == Held.RATE.value and target["wait"]:
            # A rate window's wakeup delivered early (the publishing host's clock is
            # behind the database's): sent again for the time left, by the database clock.
            self._publish_later(max(MIN_COUNTDOWN, float(target["wait"])), target)
        else:
            # Spent or duplicate (its job was claimed by a higher-priority swap,
            # cancelled, ...): if it carried a rate window's wakeup, make sure the
            # window's capacity is used.
            self._publish(self._db.top_up(target["kind"], target["concurrency_key"]))

    def _publish_later(self, seconds: float, wakeup: dict) -> None:
        """A rate window's wakeup, due in ``seconds`` (database clock) on its job's queue."""
        try:
            self._app.send_task(
                wakeup["task"],
                task_id=str(wakeup["id"]),
                queue=wakeup["queue"],
                countdown=seconds,
                add_to_parent=False,
                retry_policy=RETRY_POLICY,
            )
        except Exception as exc:
            log.warning("celery-lease: cannot schedule the next rate window's wakeup (%s)", type(exc).__name__)

    def holds_slot(self, kind: str) -> bool:
        """True for a kind with a concurrency limit (declared, or maybe an override's):
        its jobs' ends must free their slot at once (so a success of such a kind does not
        wait in the completer)."""
        spec = self._registry.get(kind)
        if spec is None:
            return False
        declared = spec.limits is not None and spec.limits.concurrency is not None
        return declared or kind in self._overridden_kinds()

    # --- every way a job ends ----------------------------------------------------------

    def release(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Jobs left running (or pending): wake the jobs their concurrency limit holds,
        as many as slots are free now. Returns the wakeups published.

        Every way a job ends calls it, once its transition committed: the worker's
        outcome (success, failure, retry, snooze, hand-off, timeout, lease loss), a
        cancel (API, revoke, run), the reaper, restart recovery.

        ``rows``: mappings with the job's ``kind`` and ``concurrency_key``, and
        optionally ``limited`` (its kind has a limits row: a statement that returns
        ``statements.common.RELEASE_COLUMNS`` tells it, so nothing is read again). Without
        ``limited``, a kind this process declares is limited when it declares a
        concurrency; an unknown kind is looked up. Rows of unlimited kinds cost nothing.

        Never raises: the wakes that fail are left to the sweeper's recovery."""
        groups: dict[tuple[str, str | None], None] = {}
        unknown: dict[str, list[str | None]] = {}
        for row in rows:
            kind, key = row["kind"], row["concurrency_key"]
            limited = row.get("limited")
            if limited is None and self._registry.get(kind) is None:
                unknown.setdefault(kind, []).append(key)
                continue
            if limited or (limited is None and self.holds_slot(kind)):
                groups[kind, key] = None
        if unknown:
            try:
                for kind in self._db.limited_kinds(list(unknown)):
                    groups.update(dict.fromkeys((kind, key) for key in unknown[kind]))
            except Exception:
                log.warning("celery-lease: cannot tell which ended jobs free a slot; the sweeper will", exc_info=True)
        sent = 0
        for kind, key in groups:
            try:
                sent += self._publish(self._db.wake_for_slot(kind, key))
            except Exception:
                # The jobs stay held; the sweeper's recovery wakes them.
                log.warning("celery-lease: cannot wake jobs held by %s's limit; the sweeper will", kind, exc_info=True)
        return sent

    # --- pause -----------------------------------------------------------------------

    def pause(self, kind: str) -> bool:
        """Stop claiming jobs of ``kind`` (stored, survives restarts); running jobs
        finish. True when this call paused it."""
        return self._db.pause(self._registry.resolve(kind).kind)

    def resume(self, kind: str) -> int:
        """Claim ``kind`` again and wake every job its pause held; returns how many."""
        name = self._registry.resolve(kind).kind
        self._db.resume(name)
        woken = self._db.wake_all(Held.PAUSE, name, self._settings().batch_size)
        self._publish(woken)
        return len(woken)

    def is_paused(self, kind: str) -> bool:
        return self._db.is_paused(self._registry.resolve(kind).kind)

    # --- beat ------------------------------------------------------------------------

    def sweep(self) -> int:
        """Recover held jobs whose wakeup was missed: groups held longer than the sweep
        staleness threshold are topped up (limit, rate) or woken (pause ended, or the
        kind no longer declares a limit). Returns the wakeups published."""
        settings = self._settings()
        sent = 0
        for kind, key, held in self._db.stale_held_groups(settings.sweep_stale_seconds, settings.batch_size):
            spec = next((s for s in self._registry if s.kind == kind), None)
            if held == Held.PAUSE:
                if self._db.is_paused(kind):
                    continue
                woken = self._db.wake_all(Held.PAUSE, kind, settings.batch_size)
            elif spec is not None and not self.limited(spec):
                woken = self._db.wake_all(held, kind, settings.batch_size)
            else:
                woken = self._db.top_up(kind, key)
            sent += self._publish(woken)
        return sent

    # --- an operator's override ----------------------------------------------------

    def set_limits(self, kind: str, change: LimitChange) -> dict[str, Any]:
        """Change ``kind``'s limits for the whole fleet (stored, kept across restarts):
        see LimitChange. Jobs a raised or removed limit held are woken now. Returns the
        kind's limits in force (as in :meth:`overview`).

        A kind is accepted when this process declares it or the database has a row of
        it (a job, a limits row, a pause): UnknownKind otherwise, so a typo creates
        nothing."""
        spec = self._registry.get(kind)
        if spec is None and not self._db.kind_exists(kind):
            known = ", ".join(self._registry.names()) or "none"
            raise UnknownKind(f"no kind {kind!r}: no handler declares it here and no job has it (declared: {known})")
        self._db.override(kind, change)
        self._overridden_at = -OVERRIDES_REFRESH_SECONDS  # this process's next claim reads it
        try:
            for key in self._db.held_keys(kind):
                self._publish(self._db.top_up(kind, key))
        except Exception:
            log.warning("celery-lease: cannot wake the jobs %s's new limits let run; the sweeper will", kind, exc_info=True)
        return self._in_force(kind, {r["kind"]: r for r in self._db.limits_rows()}.get(kind))

    def _in_force(self, kind: str, row: Mapping[str, Any] | None) -> dict[str, Any]:
        """A kind's limits in force, where each comes from (CODE or OVERRIDE) and what
        the code declares. The code: this process's declared limits when it has some
        (newer than any row: also before any worker claimed), else what the kind's
        workers last wrote in its limits row."""
        row = row or {}
        spec = self._registry.get(kind)
        lim = None if spec is None else spec.limits
        code: tuple[int | None, str | None]
        if lim is not None:
            code = (lim.concurrency, None if lim.rate is None else str(lim.rate))
        else:
            code = (row.get("concurrency"), str(Rate(row["rate"], row["per_seconds"])) if row.get("rate") else None)
        concurrency, rate = row.get("concurrency_override"), row.get("rate_override")
        # An override: 0 is explicitly no limit (db/schema.py); NULL leaves the code's.
        rate_text = str(Rate(rate, row["per_seconds_override"])) if rate else None
        return {
            "concurrency": code[0] if concurrency is None else concurrency or None,
            "rate_limit": code[1] if rate is None else rate_text,
            "concurrency_source": CODE if concurrency is None else OVERRIDE,
            "rate_limit_source": CODE if rate is None else OVERRIDE,
            "declared_concurrency": code[0],
            "declared_rate_limit": code[1],
        }

    # --- what operators see --------------------------------------------------------

    def overview(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Per kind and key: its limits in force (and where each comes from: the code
        or an operator's override), whether it is paused, and how many jobs run, wait
        on the limit, the rate or the pause, or are pending otherwise. Without a
        tenant, every kind is listed, idle or not: those this process declares, those
        with a limits row or a pause, those with active jobs."""
        data = self._db.overview(tenant)
        stored = {r["kind"]: r for r in data["limits"]}
        paused = {r["kind"] for r in data["pauses"]}
        rows: dict[tuple[str, str | None], dict[str, Any]] = {}

        def entry(kind: str, key: str | None) -> dict[str, Any]:
            if (kind, key) not in rows:
                rows[kind, key] = {
                    "kind": kind,
                    "key": key,
                    **self._in_force(kind, stored.get(kind)),
                    "paused": kind in paused,
                    **dict.fromkeys(STATES, 0),
                }
            return rows[kind, key]

        for kind, key, status, held, count in data["counts"]:
            state = "running" if status == "running" else _WAITING.get(held, "pending")
            entry(kind, key)[state] += count
        if tenant is None:  # kinds with no active job, too
            for kind in set(self._registry.names()) | set(stored) | paused:
                if not any(k == kind for k, _ in rows):
                    entry(kind, None)
        return sorted(rows.values(), key=lambda r: (r["kind"], r["key"] or ""))
