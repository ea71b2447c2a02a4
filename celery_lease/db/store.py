"""The job store: one method per named statement of :mod:`celery_lease.db.statements`.

It runs them on a :class:`~celery_lease.db.engine.Database` (engines, transactions,
prepared statements) and turns rows into :class:`~celery_lease.job.Job` values. Run
events are built here, in :meth:`Store.log_events`, and nowhere else, but by the
PostgreSQL statements that write their own (statements.claim.claim,
maintenance.reap_expired_logged: the same rows, in the same statement). The transitions
that end attempts or jobs are executed by celery_lease/lifecycle, not here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from sqlalchemy.engine import Connection

from celery_lease.db.engine import Database, Timeouts
from celery_lease.db.history import History
from celery_lease.db.prepared import Prepared, PreparedScript
from celery_lease.db.reads import Reads
from celery_lease.db.statements import attempt as attempt_sql
from celery_lease.db.statements import cancel, canvas, events, landing, maintenance, outbox, submit
from celery_lease.db.statements.common import row_dicts
from celery_lease.db.statements.fair import fair_params
from celery_lease.job import Job
from celery_lease.status import Event

log = logging.getLogger("celery_lease")


def _event_source(job: Any) -> tuple[Any, Any, int]:
    if isinstance(job, Mapping):
        return job["run_id"], job["id"], job["attempt"]
    return job.run_id, getattr(job, "job_id", None) or job.id, job.attempt


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What this database offers the layers above, which choose a way by it and never
    by which database it is."""

    #: A delivery may claim many jobs in one statement (CLAIM_MANY: a many-job claim).
    many_job_claims: bool
    #: Plain successes are worth gathering, many written per statement, in the background.
    background_completions: bool
    #: Jobs of one queue sharing their columns go in one statement (insert_shared_jobs).
    shared_inserts: bool
    #: The vendor (Django's name) of connections whose transaction a submit may join.
    joinable_vendor: str | None


class Store(Reads, History, Database):
    def __init__(
        self,
        url: str,
        *,
        source: str = "database_url",
        prepare_statements: bool = True,
        timeouts: Timeouts | None = None,
        read_url: str | None = None,
    ) -> None:
        super().__init__(url, source=source, timeouts=timeouts, read_url=read_url)
        #: The per-job statements, prepared server-side (PostgreSQL only).
        pg = self.dialect == "postgresql"
        self._prepared: dict[Any, Prepared] | None = {} if pg and prepare_statements else None
        self.capabilities = Capabilities(
            many_job_claims=pg, background_completions=pg, shared_inserts=pg, joinable_vendor="postgresql" if pg else None
        )

    def alone(self, stmt, params: Mapping, *, lock=None, fast=False, on_retry: Callable | None = None, then=None) -> list[dict]:
        """``stmt``'s rows, run alone in its transaction, after ``lock`` (a row lock it
        runs under) when given. Prepared (PostgreSQL, lease_prepare_statements): one
        script, one round trip, autocommit. Else one by one: a statement alone commits
        by itself, and ``fast`` runs them in a transaction of the fast engine; ``then(conn,
        rows)`` ends it (what a statement that does not log itself leaves to its caller)."""
        if self._prepared is not None:
            assert then is None, "a prepared statement runs alone"
            key = (lock, stmt)
            if key not in self._prepared:
                self._prepared[key] = PreparedScript(Prepared(lock), Prepared(stmt)) if lock is not None else Prepared(stmt)
            return self.execute_prepared(self._prepared[key], dict(params), on_retry=on_retry)

        def work(conn: Connection) -> list[dict]:
            if lock is not None:
                conn.execute(lock, params)
            rows = [dict(r) for r in conn.execute(stmt, params).mappings()]
            return rows if then is None else then(conn, rows)

        engine = self.fast if fast else self.engine(single=lock is None and then is None)
        return self.transaction(engine, work, on_retry=on_retry)

    # --- producer --------------------------------------------------------------------

    def insert_jobs(
        self, rows: list[dict[str, Any]], *, keyed: bool, connection=None, landed: list[Job] | None = None
    ) -> list[Job]:
        """Insert new jobs; returns those this call inserted. A row whose id already
        exists was inserted by an earlier try of this same submit whose reply was lost
        (a retry after a dropped connection): it is read back, not inserted again nor
        reported as a conflict, and appended to ``landed``."""
        stmt = submit.insert_jobs(self.dialect, on_key_conflict_nothing=keyed)
        params = fair_params(rows)

        def work(conn: Connection) -> list[Job]:
            if len(params) == 1:
                result = conn.execute(stmt, params[0])
            else:
                result = conn.execute(stmt, params)
            return [Job.from_row(r) for r in result.mappings()]

        # The INSERT is one statement: outside a caller's transaction it commits alone.
        retried: list[bool] = []
        inserted = self.transaction(self.engine(single=True), work, connection=connection, on_retry=partial(retried.append, True))
        self._read_back_landed([str(r["id"]) for r in rows], {j.id for j in inserted}, landed, connection, bool(retried))
        return inserted

    def insert_shared_jobs(
        self, shared: dict[str, Any], records: list[dict], *, keyed: bool, connection=None, landed: list[Job] | None = None
    ) -> list[Job]:
        """submit.insert_shared_jobs (PostgreSQL): jobs sharing every column but submit.PER_JOB_FIELDS
        (``records``, one dict each), with their ``dispatched`` events (jobs of a run), in one statement,
        alone a prepared one; returns those inserted, built from what was sent and the
        database's created_at / run_after. Missing ids are insert_jobs' lost-reply rows."""
        text = json.dumps(records, separators=(",", ":"))
        params = {**shared, "jobs": text}
        rows: list[Any]
        retried: list[bool] = []
        again = partial(retried.append, True)  # a dropped connection made it try again
        fair, in_run = bool(shared.get("fair")), shared["run_id"] is not None
        stmt = submit.insert_shared_jobs(on_key_conflict_nothing=keyed, fair=fair, in_run=in_run)
        if not keyed and connection is None:
            rows = [(r["id"], r["created_at"], r["run_after"]) for r in self.alone(stmt, params, on_retry=again)]
        else:
            engine = self.engine(single=True)
            rows = self.transaction(engine, lambda c: list(c.execute(stmt, params)), connection=connection, on_retry=again)
        sent = {str(r["id"]): r for r in json.loads(text)}  # payloads as stored: tuples become lists
        base = Job.pending_fields(shared)
        inserted = []
        for job_id, created_at, run_after in rows:
            record = sent[str(job_id)]
            own = {"id": str(job_id), "payload": record["payload"], "idempotency_key": record.get("idempotency_key")}
            inserted.append(Job.of_fields({**base, **own, "created_at": created_at, "run_after": run_after}))
        self._read_back_landed(list(sent), {j.id for j in inserted}, landed, connection, bool(retried))
        return inserted

    def _read_back_landed(self, ids: list[str], inserted: set[str], landed: list[Job] | None, connection, retried: bool) -> None:
        """Rows an insert did not return although they exist: an earlier try of it that
        committed before its reply was lost (``retried``), or ids the caller chose and
        submitted before (one Celery ``task_id`` applied twice). Read back into ``landed``
        (a conflicting idempotency key is not found by id: the caller reads it by key)."""
        if len(inserted) == len(ids):
            return
        found = self.get_jobs_by_ids([i for i in ids if i not in inserted], connection=connection)
        if found and retried:  # else the same ids were simply submitted again: nothing to report
            log.warning("celery-lease: %d job(s) had landed before a lost reply; not inserted again", len(found))
        if landed is not None:
            landed.extend(found)

    def pending_wakeups(self, ids: Sequence[str]) -> list[dict]:
        return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(submit.pending_wakeups(ids)).mappings()])

    def get_jobs_by_ids(self, ids: Sequence[str], *, connection=None) -> list[Job]:
        def work(conn):
            return [Job.from_row(r) for r in conn.execute(submit.get_jobs_by_ids(ids)).mappings()]

        return self.transaction(self.durable, work, connection=connection)

    def get_jobs_by_keys(self, kind: str, keys: Sequence[str], *, connection=None) -> list[Job]:
        def work(conn):
            return [Job.from_row(r) for r in conn.execute(submit.get_jobs_by_keys(kind, keys)).mappings()]

        return self.transaction(self.durable, work, connection=connection)

    def mark_not_woken(self, ids: Sequence[str]) -> None:
        self.transaction(self.durable, lambda c: c.execute(submit.mark_not_woken(ids)))

    def ensure_run(self, run_id: str, *, connection=None) -> bool:
        """Create the run if new; return False when the run was cancelled."""

        def work(conn):
            conn.execute(submit.upsert_run(self.dialect, run_id))
            return conn.execute(submit.get_run(run_id)).mappings().one()["cancelled_at"] is None

        return self.transaction(self.durable, work, connection=connection)

    # --- lease life ------------------------------------------------------------------

    def renew(self, leases: Sequence[tuple[str, int]]) -> dict[tuple[str, int], bool]:
        """Renew many (job, generation) leases in one statement, on the heartbeat's own
        connection; return those still held, each with whether it was renewed (False:
        its row was locked by a transaction, see statements.attempt.renew_leases)."""

        def work(conn):
            return {(str(r[0]), r[1]): bool(r[2]) for r in conn.execute(attempt_sql.renew_leases(self.dialect, leases))}

        return self.transaction(self.engine(heartbeat=True), work)

    def rows_in(self, conn: Connection, stmt, params: Mapping[str, Any], *, key: Any = None) -> list[dict[str, Any]]:
        """``stmt``'s rows on ``conn`` (the caller's transaction): sent as a prepared
        statement where the store prepares them, its plan kept per connection (``key``:
        the catalogue's cached construct it was made from, so one per statement), else
        as text."""
        if self._prepared is None or key is None:
            return row_dicts(conn.execute(stmt, params))
        prepared = self._prepared.get(key) or self._prepared.setdefault(key, Prepared(stmt))
        return prepared.run(conn, dict(params))

    def guarded(self, stmt, params: dict[str, Any], *, connection: Connection | None = None) -> bool:
        """Run one guarded write; False when its guard matched no row. Alone (committed
        by itself, asynchronously: progress and checkpoints) unless a ``connection`` is
        given."""

        def work(conn: Connection) -> bool:
            result = conn.execute(stmt, params)
            # (A statement with RETURNING: SQLite counts its rows only once read.)
            return (len(result.all()) if result.returns_rows else result.rowcount) == 1

        return self.transaction(self.engine(fast=True, single=True), work, connection=connection)

    def log_events(self, conn: Connection | None, entries: Iterable[tuple[Any, Event, str | None]]) -> None:
        """Append run events for jobs that belong to a run; the one place events are built.

        Each entry is (job, event, detail), the job being a Job, a row mapping or an
        attempt: anything with a run id, a job id and an attempt number.
        """
        rows = []
        for job, event, detail in entries:
            run_id, job_id, attempt = _event_source(job)
            if run_id is not None:
                rows.append(events.event_row(str(run_id), str(job_id), event, attempt, detail))
        if rows:
            self.transaction(self.durable, lambda c: c.execute(events.append_events(), rows), connection=conn)

    # --- revoking statements (executed by celery_lease/lifecycle) -------------------

    def mark_run_cancelled(self, conn: Connection, run_id: str) -> None:
        """The run takes no new job (in the transaction that cancels its jobs)."""
        conn.execute(submit.upsert_run(self.dialect, run_id))
        conn.execute(cancel.cancel_run(), {"run_id": run_id})

    def claim_due_wakeups(self, stale_seconds: float, limit: int) -> list[dict]:
        params = {"stale_seconds": stale_seconds, "limit": limit}
        # Every sweep tick runs it, mostly finding nothing: prepared, it is parsed and
        # analyzed once per connection (0.54 -> 0.35 ms idle at 1,000,000 pending jobs).
        stmt = maintenance.claim_due_wakeups(self.dialect)
        if self.dialect != "postgresql":
            return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(stmt, params).mappings()])
        return self._maintain("sweep", stmt, params)

    def any_lease_elapsed(self) -> bool:
        """Whether a running job's lease has elapsed (the reaper's idle tick: one read)."""
        stmt = maintenance.any_lease_elapsed()
        if self.dialect != "postgresql":
            return bool(self.transaction(self.durable, lambda c: c.execute(stmt).scalar()))
        return bool(self._maintain("reap_probe", stmt, {})[0]["elapsed"])

    def _maintain(self, name: str, stmt, params: dict[str, Any]) -> list[dict]:
        """A maintenance statement on PostgreSQL alone in its transaction (autocommit),
        prepared unless prepare_statements is off."""
        if self._prepared is None:
            return self.transaction(self.engine(single=True), lambda c: [dict(r) for r in c.execute(stmt, params).mappings()])
        prepared = self._prepared.get(name) or self._prepared.setdefault(name, Prepared(stmt))
        return self.transaction(self.engine(single=True), lambda c: prepared.run(c, params))

    def prune(self, older_than_seconds: float, limit: int) -> int:
        def work(conn):
            params = {"cutoff_seconds": older_than_seconds, "limit": limit}
            ids = [str(r[0]) for r in conn.execute(maintenance.prune_jobs(self.dialect), params)]
            if ids:
                conn.execute(maintenance.delete_job_events(ids))
            return len(ids)

        return self.transaction(self.durable, work)

    def prune_landings(self, older_than_seconds: float, limit: int) -> int:
        """Delete a Landing's marker rows (db/landing.py) older than ``older_than_seconds``;
        PostgreSQL only (SQLite has no lost reply, and no marker)."""
        if self.dialect != "postgresql":
            return 0
        params = {"cutoff_seconds": older_than_seconds, "limit": limit}
        return self.transaction(self.durable, lambda c: c.execute(landing.prune_marks(), params).rowcount)

    # --- the outbox ---------------------------------------------------------------------

    def write_outbox(self, conn: Connection, kind: str, payloads: Sequence[Any]) -> list[str]:
        """Insert follow-ups in the caller's transaction; returns their ids."""
        rows = [{"id": str(uuid.uuid4()), "kind": kind, "payload": p} for p in payloads]
        if rows:
            conn.execute(outbox.insert_outbox(), rows)
        return [r["id"] for r in rows]

    def delete_outbox(self, ids: Sequence[str]) -> None:
        if ids:
            self.transaction(self.fast, lambda c: c.execute(outbox.delete_outbox(ids)))

    def take_outbox(self, age_seconds: float, limit: int) -> list[dict]:
        """Follow-ups older than ``age_seconds`` (see statements.outbox.take_outbox)."""
        params = {"age_seconds": age_seconds, "limit": limit}
        stmt = outbox.take_outbox(self.dialect)
        return self.transaction(self.durable, lambda c: [dict(r) for r in c.execute(stmt, params).mappings()])

    def make_due(self, job_id: str) -> None:
        self.guarded(canvas.make_due(), {"job_id": job_id})

    # --- chord counters (see celery_lease.canvas): one row per applied chord, counted down by
    # its header jobs' successes, removed when the body is created, when a header job fails,
    # expires or is cancelled, or by the pruner ----------------------------------------

    def create_chord(self, group_id: str, members: list[str], body: Any) -> None:
        stmt = canvas.insert_chord(self.dialect)
        params = {"group_id": group_id, "remaining": len(members), "members": members, "body": body}
        self.transaction(self.durable, lambda c: c.execute(stmt, params))

    def count_down_chord(self, conn: Connection, group_id: str) -> dict[str, Any] | None:
        """In a member's success transaction: the chord row after this member, or None
        when the chord is gone (failed) or already complete."""
        row = conn.execute(canvas.count_down_chord(), {"group_id": group_id}).mappings().first()
        return None if row is None else dict(row)

    def delete_chord(self, conn: Connection, group_id: str) -> Any:
        """Remove a chord; its body's signature, or None when it was already removed."""
        row = conn.execute(canvas.delete_chord(), {"group_id": group_id}).first()
        return None if row is None else row[0]

    def job_results(self, conn: Connection, ids: Sequence[str]) -> dict[str, Any]:
        return {str(r[0]): r[1] for r in conn.execute(canvas.job_results(ids))}

    def prune_chords(self, older_than_seconds: float, limit: int) -> int:
        params = {"cutoff_seconds": older_than_seconds, "limit": limit}
        return self.transaction(self.durable, lambda conn: len(conn.execute(canvas.prune_chords(self.dialect), params).all()))
