"""The job store: one method per named statement of :mod:`celery_lease.db.queries`.

It runs them on a :class:`~celery_lease.db.engine.Database` (engines, transactions,
prepared statements) and turns rows into :class:`~celery_lease.job.Job` values. Run
events are built here, in :meth:`Store.log_events`, and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.engine import Connection

from celery_lease.db import queries as q
from celery_lease.db.engine import Database, Timeouts
from celery_lease.db.prepared import Prepared
from celery_lease.errors import DatabaseUnavailable
from celery_lease.job import Job
from celery_lease.status import Event, Status

log = logging.getLogger("celery_lease")


def _event_source(job: Any) -> tuple[Any, Any, int]:
    if isinstance(job, Mapping):
        return job["run_id"], job["id"], job["attempt"]
    return job.run_id, getattr(job, "job_id", None) or job.id, job.attempt


def _view(row: Mapping[Any, Any]) -> dict[str, Any]:
    """An API view row: ids as strings, times as aware UTC (SQLite returns them naive)."""
    out = dict(row)
    for key, value in out.items():
        if isinstance(value, datetime) and value.tzinfo is None:
            out[key] = value.replace(tzinfo=timezone.utc)
        elif key.endswith("id") and value is not None:
            out[key] = str(value)
    return out


@dataclass(eq=False)
class RidingSuccesses:
    """complete_jobs parameters for ``count`` attempts, sent with a claim. ``done``: the ids
    completed (those that landed before a lost reply too), or None if sent without them."""

    params: dict[str, Any]
    count: int
    done: set[str] | None = None


class Store(Database):
    def __init__(
        self, url: str, *, source: str = "database_url", prepare_statements: bool = True, timeouts: Timeouts | None = None
    ) -> None:
        super().__init__(url, source=source, timeouts=timeouts)
        #: The per-job statements, prepared server-side (PostgreSQL only).
        self._prepared: dict[str, Prepared] | None = None
        if self.dialect == "postgresql" and prepare_statements:
            self._prepared = {
                "claim": Prepared(q.claim_job_logged()),
                "insert": Prepared(q.insert_jobs(self.dialect, on_key_conflict_nothing=False), column_keys=q.INSERTED_COLUMNS),
            }

    # --- producer --------------------------------------------------------------------

    def insert_jobs(
        self, rows: list[dict[str, Any]], *, keyed: bool, connection=None, landed: list[Job] | None = None
    ) -> list[Job]:
        """Insert new jobs; returns those this call inserted. A row whose id already
        exists was inserted by an earlier try of this same submit whose reply was lost
        (a retry after a dropped connection): it is read back, not inserted again nor
        reported as a conflict, and appended to ``landed``."""
        if self._prepared is not None and len(rows) == 1 and not keyed and connection is None:
            # A plain single submit: one prepared INSERT, committed durably.
            inserted = [Job.from_row(r) for r in self.execute_prepared(self._prepared["insert"], rows[0])]
        else:
            stmt = q.insert_jobs(self.dialect, on_key_conflict_nothing=keyed)

            def work(conn: Connection) -> list[Job]:
                if len(rows) == 1:
                    result = conn.execute(stmt, rows[0])
                else:
                    result = conn.execute(stmt, rows)
                return [Job.from_row(r) for r in result.mappings()]

            # The INSERT is one statement: outside a caller's transaction it commits alone.
            inserted = self.transaction(self.engine(single=True), work, connection=connection)
        if len(inserted) < len(rows):
            new = {j.id for j in inserted}
            missing = [str(r["id"]) for r in rows if str(r["id"]) not in new]
            found = self.get_jobs_by_ids(missing, connection=connection)
            if found:
                log.warning("celery-lease: %d job(s) had landed before a lost reply; not inserted again", len(found))
                if landed is not None:
                    landed.extend(found)
        return inserted

    def pending_wakeups(self, ids: Sequence[str]) -> list[dict]:
        return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(q.pending_wakeups(ids)).mappings()])

    def get_jobs_by_ids(self, ids: Sequence[str], *, connection=None) -> list[Job]:
        def work(conn):
            return [Job.from_row(r) for r in conn.execute(q.get_jobs_by_ids(ids)).mappings()]

        return self.transaction(self.durable, work, connection=connection)

    def get_jobs_by_keys(self, kind: str, keys: Sequence[str], *, connection=None) -> list[Job]:
        def work(conn):
            return [Job.from_row(r) for r in conn.execute(q.get_jobs_by_keys(kind, keys)).mappings()]

        return self.transaction(self.durable, work, connection=connection)

    def mark_not_woken(self, ids: Sequence[str]) -> None:
        self.transaction(self.durable, lambda c: c.execute(q.mark_not_woken(ids)))

    def ensure_run(self, run_id: str, *, connection=None) -> bool:
        """Create the run if new; return False when the run was cancelled."""

        def work(conn):
            conn.execute(q.upsert_run(self.dialect, run_id))
            return conn.execute(q.get_run(run_id)).mappings().one()["cancelled_at"] is None

        return self.transaction(self.durable, work, connection=connection)

    # --- reads -----------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        def work(conn):
            row = conn.execute(q.get_job(job_id)).mappings().first()
            return None if row is None else Job.from_row(row)

        return self.transaction(self.durable, work)

    def list_jobs(self, **filters) -> list[Job]:
        return self.transaction(self.durable, lambda c: [Job.from_row(r) for r in c.execute(q.list_jobs(**filters)).mappings()])

    def get_view(self, job_id: str, *, tenant: str | None = None) -> dict[str, Any] | None:
        """The API columns of one job (of ``tenant``, when given), or None."""

        def work(conn):
            row = conn.execute(q.get_job_view(job_id, tenant=tenant)).mappings().first()
            return None if row is None else _view(row)

        return self.transaction(self.durable, work)

    def list_views(self, **filters) -> list[dict[str, Any]]:
        """list_jobs, reading only the API columns."""
        return self.transaction(self.durable, lambda c: [_view(r) for r in c.execute(q.list_job_views(**filters)).mappings()])

    def run_visible(self, run_id: str, *, tenant: str | None = None) -> bool:
        return self.transaction(self.durable, lambda c: c.execute(q.run_visible(run_id, tenant=tenant)).first() is not None)

    def tenant_run_events(self, run_id: str, tenant: str, *, after_seq: int = 0, limit: int = 1000) -> list[dict]:
        """A tenant's events of a run, each with its ``seq`` among them (see queries)."""
        stmt = q.list_tenant_run_events(run_id, tenant, after_seq=after_seq, limit=limit)
        return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(stmt).mappings()])

    def run_events(self, run_id: str, *, after_id: int = 0, limit: int = 1000, tenant: str | None = None) -> list[dict]:
        stmt = q.list_run_events(run_id, after_id=after_id, limit=limit, tenant=tenant)
        return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(stmt).mappings()])

    def metrics(self, stale_seconds: float) -> dict[str, Any]:
        """The aggregates behind /metrics, read in one transaction."""

        def work(conn):
            return {
                "jobs": [tuple(r) for r in conn.execute(q.job_totals())],
                "events": [tuple(r) for r in conn.execute(q.event_totals())],
                "leases": tuple(conn.execute(q.lease_health(), {"stale_seconds": stale_seconds}).one()),
            }

        return self.transaction(self.durable, work)

    # --- lease life ------------------------------------------------------------------

    def claim(
        self,
        job_id: str,
        owner: str,
        task: str,
        *,
        may_adopt: Callable[[int], bool] | None = None,
        successes: RidingSuccesses | None = None,
    ) -> dict[str, Any] | None:
        """Claim a job for one attempt; None when the delivery is a duplicate, names a
        job of another task than the one it was delivered to, or flow control refuses
        it (celery_lease.flow tells which). The row's id is the job claimed: a
        higher-priority job of the same kind may be claimed instead. A row whose
        ``status`` is ``cancelled`` is a job the claim found in a cancelled run (and
        cancelled): it must not start.

        A claim retried after a dropped connection may have landed before its reply was
        lost; then the retry matches nothing (the job is running) and the job is
        adopted if it runs under this ``owner`` and ``may_adopt(its generation)`` (no
        other attempt of it lives in this process; see queries.adopt_claim), instead of
        being left running with no body until its lease expires.

        With ``successes`` (PostgreSQL, prepared statements), they are written by the
        same statement; see :class:`RidingSuccesses` for what the caller learns.
        """
        params = {"job_id": job_id, "owner": owner, "wakeup_task": task}
        retried: list[bool] = []

        def note_retry() -> None:
            retried.append(True)

        row: Any
        if self._prepared is not None:
            rows = None if successes is None else self._claim_completing(params, successes, retried)
            if rows is None:
                rows = self.execute_prepared(self._prepared["claim"], params, on_retry=note_retry)
            row = rows[0] if rows else None
        elif self.dialect == "postgresql":
            row = self.transaction(
                self.engine(single=True),
                lambda conn: conn.execute(q.claim_job_logged(), params).mappings().first(),
                on_retry=note_retry,
            )
        else:

            def work(conn):
                # The job claimed may be another than job_id: see queries.claim_job_flow.
                claimed = conn.execute(q.claim_job_flow(), params).mappings().first()
                if claimed is not None:
                    run_cancelled = claimed["status"] == Status.CANCELLED.value
                    event, detail = (Event.CANCELLED, q.RUN_CANCELLED) if run_cancelled else (Event.CLAIMED, owner)
                    self.log_events(conn, [(claimed, event, detail)])
                return claimed

            row = self.transaction(self.durable, work, on_retry=note_retry)
        if row is None and retried and may_adopt is not None:
            adopt = q.adopt_claim()
            row = self.transaction(self.engine(single=True), lambda conn: conn.execute(adopt, params).mappings().first())
            if row is not None and not may_adopt(row["lease_generation"]):
                row = None  # an attempt of this process holds it: a duplicate after all
            if row is not None:
                log.warning("celery-lease: job %s: its claim had landed before the reply was lost; adopted", job_id)
        return None if row is None else dict(row)

    def _claim_completing(self, params: dict[str, Any], successes: RidingSuccesses, retried: list[bool]) -> list[dict] | None:
        """The claim with ``successes`` riding on it; None when the statement failed on
        something else than a lost database (a value it refused): the claim is then sent
        alone, and ``successes.done`` stays None."""
        assert self._prepared is not None
        key = f"claim_complete_{successes.count}"
        stmt = self._prepared.get(key) or self._prepared.setdefault(key, Prepared(q.claim_job_completing(successes.count)))
        try:
            (row,) = self.execute_prepared(stmt, {**params, **successes.params}, on_retry=lambda: retried.append(True))
        except DatabaseUnavailable:
            raise
        except Exception:
            log.warning("celery-lease: a claim carrying %d success(es) failed; claiming alone", successes.count, exc_info=True)
            return None
        done = set(row.pop("completed") or ())
        if retried and len(done) < successes.count:
            keys = [(str(successes.params[f"job_id_{i}"]), successes.params[f"generation_{i}"]) for i in range(successes.count)]
            try:
                done |= self.landed_successes([k for k in keys if k[0] not in done])
            except DatabaseUnavailable:
                pass  # the caller re-checks each missing one (fenced), which settles it
        successes.done = done
        return [] if row["id"] is None else [row]

    def renew(self, leases: Sequence[tuple[str, int]]) -> dict[tuple[str, int], bool]:
        """Renew many (job, generation) leases in one statement, on the heartbeat's own
        connection; return those still held, each with whether it was renewed (False:
        its row was locked by a transaction, see queries.renew_leases)."""

        def work(conn):
            return {(str(r[0]), r[1]): bool(r[2]) for r in conn.execute(q.renew_leases(self.dialect, leases))}

        return self.transaction(self.engine(heartbeat=True), work)

    def complete_many(self, params: dict[str, Any], count: int) -> set[str]:
        """complete_jobs for ``count`` attempts; returns the ids that completed. After a
        retry (a dropped connection) those that had landed before the reply was lost
        count as completed too."""
        retried: list[bool] = []
        if self._prepared is not None:
            key = f"complete_{count}"
            stmt = self._prepared.get(key) or self._prepared.setdefault(key, Prepared(q.complete_jobs(count)))
            done = {str(r["id"]) for r in self.execute_prepared(stmt, params, on_retry=lambda: retried.append(True))}
        else:
            done = self.transaction(
                self.engine(single=True),
                lambda conn: {str(r[0]) for r in conn.execute(q.complete_jobs(count), params)},
                on_retry=lambda: retried.append(True),
            )
        if retried and len(done) < count:
            keys = [(str(params[f"job_id_{i}"]), params[f"generation_{i}"]) for i in range(count)]
            done |= self.landed_successes([k for k in keys if k[0] not in done])
        return done

    def landed_successes(self, leases: Sequence[tuple[str, int]]) -> set[str]:
        """Of these (job, generation) attempts, the ids recorded as succeeded under that
        generation: only that attempt can have written it (a success keeps the
        generation; every other transition bumps it)."""
        if not leases:
            return set()
        stmt = q.landed_successes(leases)
        return self.transaction(self.durable, lambda conn: {str(r[0]) for r in conn.execute(stmt)})

    def guarded(self, stmt, params: dict[str, Any], *, connection: Connection | None = None) -> bool:
        """Run one guarded write; False when its guard matched no row. Alone (committed
        by itself, asynchronously: progress and checkpoints) unless a ``connection`` is
        given."""
        return self.transaction(
            self.engine(fast=True, single=True), lambda conn: conn.execute(stmt, params).rowcount == 1, connection=connection
        )

    def log_events(self, conn: Connection | None, entries: Iterable[tuple[Any, Event, str | None]]) -> None:
        """Append run events for jobs that belong to a run; the one place events are built.

        Each entry is (job, event, detail), the job being a Job, a row mapping or an
        attempt: anything with a run id, a job id and an attempt number.
        """
        rows = []
        for job, event, detail in entries:
            run_id, job_id, attempt = _event_source(job)
            if run_id is not None:
                rows.append(q.event_row(str(run_id), str(job_id), event, attempt, detail))
        if rows:
            self.transaction(self.durable, lambda c: c.execute(q.append_events(), rows), connection=conn)

    # --- revoking statements ---------------------------------------------------------

    def cancel(self, *, job_id: str | None = None, run_id: str | None = None) -> list[str]:
        def work(conn):
            if run_id is not None:
                conn.execute(q.upsert_run(self.dialect, run_id))
                conn.execute(q.cancel_run(), {"run_id": run_id})
            rows = conn.execute(q.cancel_jobs(job_id=job_id, run_id=run_id)).mappings().all()
            self.log_events(conn, [(r, Event.CANCELLED, None) for r in rows])
            return [str(r["id"]) for r in rows]

        return self.transaction(self.durable, work)

    def _requeue(self, stmt, params: dict, event: Event, cause: str) -> list[dict]:
        def work(conn):
            rows = [dict(r) for r in conn.execute(stmt, params).mappings()]
            self.log_events(conn, [(r, event, f"{cause}: {r['status']}") for r in rows])
            return rows

        return self.transaction(self.durable, work)

    def reap(self, limit: int) -> list[dict]:
        return self._requeue(q.reap_expired(), {"limit": limit}, Event.REAPED, "lease expired")

    def recover(self, node: str, boot: str) -> list[dict]:
        stmt = q.recover_restarted(owner_prefix=f"{node}/", owner_boot=f"/{boot}")
        return self._requeue(stmt, {}, Event.REQUEUED, "interrupted by restart")

    def claim_due_wakeups(self, stale_seconds: float, limit: int) -> list[dict]:
        return self.transaction(
            self.durable,
            lambda c: [
                dict(r) for r in c.execute(q.claim_due_wakeups(), {"stale_seconds": stale_seconds, "limit": limit}).mappings()
            ],
        )

    def prune(self, older_than_seconds: float, limit: int) -> int:
        def work(conn):
            params = {"cutoff_seconds": older_than_seconds, "limit": limit}
            ids = [str(r[0]) for r in conn.execute(q.prune_jobs(self.dialect), params)]
            if ids:
                conn.execute(q.delete_job_events(ids))
            return len(ids)

        return self.transaction(self.durable, work)

    # --- canvas ----------------------------------------------------------------------

    def create_chord(self, group_id: str, members: list[str], body: Any) -> None:
        stmt = q.insert_chord(self.dialect)
        params = {"group_id": group_id, "remaining": len(members), "members": members, "body": body}
        self.transaction(self.durable, lambda c: c.execute(stmt, params))

    def count_down_chord(self, conn: Connection, group_id: str) -> dict[str, Any] | None:
        """In a member's success transaction: the chord row after this member, or None
        when the chord is gone (failed) or already complete."""
        row = conn.execute(q.count_down_chord(), {"group_id": group_id}).mappings().first()
        return None if row is None else dict(row)

    def delete_chord(self, conn: Connection, group_id: str) -> Any:
        """Remove a chord; its body's signature, or None when it was already removed."""
        row = conn.execute(q.delete_chord(), {"group_id": group_id}).first()
        return None if row is None else row[0]

    def job_results(self, conn: Connection, ids: Sequence[str]) -> dict[str, Any]:
        return {str(r[0]): r[1] for r in conn.execute(q.job_results(ids))}

    def make_due(self, job_id: str) -> None:
        self.guarded(q.make_due(), {"job_id": job_id})
