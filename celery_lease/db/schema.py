"""The canonical schema. Migrations must reproduce it exactly (tests/integration/test_schema.py).

The same tables serve PostgreSQL and SQLite. Partial indexes (``WHERE status = ...``)
keep claim, reap and sweep proportional to the live jobs, not to the terminal history.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from celery_lease.status import Event, Status

metadata = sa.MetaData()

# none_as_null: a Python None is SQL NULL, never the JSON value null.
JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
TS = sa.DateTime(timezone=True)
ID = sa.Uuid(as_uuid=False)


#: Percent of each celery_lease_jobs page that inserts fill (migration 0008).
JOBS_FILLFACTOR = 70

#: Terminal statuses other than succeeded: the celery_lease_jobs_unsuccessful index.
UNSUCCESSFUL = sorted(s.value for s in Status if s.terminal and s is not Status.SUCCEEDED)


def _in(column: str, values) -> str:
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


def _partial(where: str) -> dict:
    clause = sa.text(where)
    return {"postgresql_where": clause, "sqlite_where": clause}


jobs = sa.Table(
    "celery_lease_jobs",
    metadata,
    # The job id is also the Celery task id of every wakeup, so Flower lists jobs by it.
    sa.Column("id", ID, primary_key=True),
    sa.Column("kind", sa.String(200), nullable=False),
    # Celery task name and queue of the wakeup, so beat can publish without importing
    # the handler modules.
    sa.Column("task", sa.String(255), nullable=False),
    sa.Column("queue", sa.String(200)),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False, server_default="0"),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("lease_seconds", sa.Integer, nullable=False),
    # Fencing token: +1 on every claim and on every revoke (cancel, reap, requeue).
    # Every write of an attempt is guarded by the generation it claimed.
    sa.Column("lease_generation", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("lease_owner", sa.String(255)),  # "node/pid/boot"
    # A random number each claim writes (one per claim call, the same for its retries):
    # a claim whose reply was lost finds exactly the rows its own first try took by it
    # (lifecycle.claim, worker/many_claim.py), never "any running row of this owner".
    sa.Column("claim_token", sa.BigInteger),
    sa.Column("lease_expires_at", TS),
    # Lease losses (reaped, interrupted) are counted apart from handler errors, so an
    # operator can tell a job that gets OOM-killed from a buggy one.
    sa.Column("lease_losses", sa.Integer, nullable=False, server_default="0"),
    sa.Column("run_after", TS),  # not claimable before; the sweeper wakes it when due
    sa.Column("woken_at", TS),  # last wakeup published
    sa.Column("payload", JSON, nullable=False),
    sa.Column("result", JSON),
    sa.Column("progress", JSON),
    sa.Column("error", sa.Text),
    # Only save_checkpoint writes this column; status transitions never touch it,
    # except success, which clears it in the same statement.
    sa.Column("checkpoint", JSON),
    sa.Column("run_id", ID),
    sa.Column("parent_id", ID),
    sa.Column("idempotency_key", sa.String(255)),
    sa.Column("tenant", sa.String(200)),
    # Flow control (celery_lease.flow). Higher priority is claimed first among due
    # pending jobs of a kind; the concurrency key (from the kind's concurrency_key
    # function, at submit) is what a per-key limit counts; held says why flow control
    # refused a claim ('limit', 'rate', 'pause'): the job stays pending, spends no
    # attempt, and is woken when that cause ends. Cleared when it is woken or claimed.
    sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
    sa.Column("concurrency_key", sa.String(255)),
    sa.Column("held", sa.String(16)),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.Column("started_at", TS),
    sa.Column("finished_at", TS),
    # What Celery's canvas asked of this job (celery_lease/canvas.py): the rest of its
    # chain, link / link_error signatures, its chord, priority. NULL for a plain submit.
    sa.Column("canvas", JSON),
    # The submitter's OpenTelemetry context (celery_lease.tracing: JSON of the W3C
    # traceparent / tracestate headers), parent of every attempt's span. NULL untraced.
    sa.Column("trace_context", sa.Text),
    # Every attempt in order (at most the last 50): attempt, owner, started_at, ended_at,
    # outcome; appended by the claim, closed by what ends the attempt, in their own
    # statements (db/statements/attempt_log.py). NULL before the first claim.
    sa.Column("attempts", JSON),
    # Fair share (a kind declared fair=True; NULL for every other job): the job's place
    # in its kind's weighted round of tenants, set at submit (statements/fair.py) and
    # re-spaced when its tenant's weight changes. Claims of a fair kind take the
    # smallest first within the top priority. Added last: migration 0015.
    sa.Column("fair_key", sa.Float),
    sa.CheckConstraint(_in("status", Status), name="celery_lease_jobs_status_check"),
    sa.CheckConstraint("attempt >= 0 AND max_attempts >= 1", name="celery_lease_jobs_attempts_check"),
    # Room on each page for a row's next version, so an update that changes no indexed
    # column (a checkpoint, a progress write) stays on its page and out of every index
    # (HOT); transitions change status and are never HOT (migration 0008).
    postgresql_with={"fillfactor": JOBS_FILLFACTOR},
)

# Every index is paid for by every non-HOT update of a job (each transition is one), so
# the set is minimal and partial: a job is in an index only while a scan needs it.
# Idempotency: unique per kind, and only rows that carry a key are indexed.
sa.Index(
    "celery_lease_jobs_idempotency_key",
    jobs.c.kind,
    jobs.c.idempotency_key,
    unique=True,
    **_partial("idempotency_key IS NOT NULL"),
)

# Claim is by primary key; these serve the maintenance scans and the API.
# The sweep (statements.maintenance.claim_due_wakeups) reads three ranges of it: never woken and due at
# once, never woken and run_after past, woken before the staleness threshold. Its keys
# are not written while a job is pending but by a wakeup; a claim takes the job out.
sa.Index("celery_lease_jobs_wakeup", jobs.c.woken_at, jobs.c.run_after, **_partial("status = 'pending' AND held IS NULL"))
sa.Index("celery_lease_jobs_running", jobs.c.lease_expires_at, **_partial("status = 'running'"))
# (Restart recovery finds a node's jobs through the running index: running rows are few.)
sa.Index(
    "celery_lease_jobs_finished",
    jobs.c.finished_at,
    **_partial(_in("status", sorted(s.value for s in Status if s.terminal))),
)
sa.Index("celery_lease_jobs_run", jobs.c.run_id, **_partial("run_id IS NOT NULL"))
# Lists of the jobs that ended without success (``?status=failed``), newest first: the
# rare terminal statuses, which the created index would walk the whole history to find
# (pending and running jobs are few and recent; succeeded ones are most rows). Only a
# job that ends so enters it (migration 0007).
sa.Index(
    "celery_lease_jobs_unsuccessful",
    jobs.c.status,
    jobs.c.created_at,
    jobs.c.id,
    **_partial(_in("status", UNSUCCESSFUL)),
)
sa.Index("celery_lease_jobs_created", jobs.c.created_at, jobs.c.id)
# A tenant token's pages (newest first, keyset on created_at, id) walk this in order,
# whatever other tenants hold; untenanted jobs stay out of it (migration 0002).
sa.Index("celery_lease_jobs_tenant", jobs.c.tenant, jobs.c.created_at, jobs.c.id, **_partial("tenant IS NOT NULL"))
# Flow control. Jobs of unlimited kinds at the default priority enter neither index:
# only held jobs (woken in priority order when capacity frees) and pending jobs with a
# priority above 0 (which a claim of a lower one takes instead) are in them.
sa.Index(
    "celery_lease_jobs_held",
    jobs.c.kind,
    jobs.c.concurrency_key,
    jobs.c.priority,
    jobs.c.created_at,
    **_partial("status = 'pending' AND held IS NOT NULL"),
)
sa.Index(
    "celery_lease_jobs_priority",
    jobs.c.kind,
    jobs.c.priority,
    jobs.c.created_at,
    **_partial("status = 'pending' AND priority > 0"),
)

# Fair share: a fair kind's claim order within one queue, concurrency key and priority
# (its first due row is what a claim takes, and its smallest key the round's head, both
# one probe), and a tenant's last key (one probe at submit). Only pending jobs of fair
# kinds are in them.
sa.Index(
    "celery_lease_jobs_fair",
    jobs.c.kind,
    jobs.c.queue,
    # NULL as '': statements/fair.key_group, an equality an ordered walk can follow.
    sa.func.coalesce(jobs.c.concurrency_key, sa.literal_column("''")),
    jobs.c.priority.desc(),
    jobs.c.fair_key,
    jobs.c.created_at,
    **_partial("status = 'pending' AND fair_key IS NOT NULL"),
)
# The many-job claim (statements/many_claim.py, _picked): the due jobs of one kind and
# queue in claim order, walked from the first and left after n + 1 rows (migration 0016).
sa.Index(
    "celery_lease_jobs_due",
    jobs.c.kind,
    sa.func.coalesce(jobs.c.queue, sa.literal_column("''")),
    jobs.c.priority.desc(),
    jobs.c.fair_key,
    jobs.c.created_at,
    **_partial("status = 'pending' AND held IS NULL"),
)
sa.Index(
    "celery_lease_jobs_fair_tenant",
    jobs.c.kind,
    jobs.c.tenant,
    jobs.c.fair_key,
    **_partial("status = 'pending' AND fair_key IS NOT NULL"),
)

runs = sa.Table(
    "celery_lease_runs",
    metadata,
    sa.Column("id", ID, primary_key=True),
    # Set once by cancel_run; a cancelled run accepts no new jobs.
    sa.Column("cancelled_at", TS),
    sa.Column("created_at", TS, nullable=False),
)

events = sa.Table(
    "celery_lease_events",
    metadata,
    # Append-only: rows are inserted, read, and pruned with their jobs; never updated.
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("run_id", ID, nullable=False),
    sa.Column("job_id", ID, nullable=False),
    sa.Column("event", sa.String(16), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("detail", sa.Text),
    sa.Column("created_at", TS, nullable=False),
    sa.CheckConstraint(_in("event", Event), name="celery_lease_events_event_check"),
)
sa.Index("celery_lease_events_run", events.c.run_id, events.c.id)
sa.Index("celery_lease_events_job", events.c.job_id)

chords = sa.Table(
    "celery_lease_chords",
    metadata,
    # The chord's group id (Celery's), created before its header jobs.
    sa.Column("id", ID, primary_key=True),
    # Header jobs still to succeed; the success that takes it to 0 creates the body,
    # in the same transaction, so the body is created once.
    sa.Column("remaining", sa.Integer, nullable=False),
    sa.Column("members", JSON, nullable=False),  # header job ids, in header order
    sa.Column("body", JSON, nullable=False),  # the body's signature
    sa.Column("created_at", TS, nullable=False),
)

# --- flow control ----------------------------------------------------------------------

limits = sa.Table(
    "celery_lease_limits",
    metadata,
    # One row per limited kind (declared in code or by an operator's override): every
    # claim of the kind locks it (FOR UPDATE), so the count of its running jobs and its
    # rate window cannot change under a claim.
    sa.Column("kind", sa.String(200), primary_key=True),
    # The limits as last declared by a worker's @leases.job (the code is the truth;
    # these let beat and operators see and apply them without importing handlers).
    sa.Column("concurrency", sa.Integer),
    sa.Column("rate", sa.Integer),
    sa.Column("per_seconds", sa.Integer),
    # An operator's override (``celery lease limit``, the API, the dashboard), which
    # workers never write: NULL keeps the declared value (the code default), 0 means
    # explicitly no limit, N >= 1 is the limit. per_seconds_override is set exactly
    # when rate_override is N >= 1. What binds a claim is the override when set, else
    # the declared value: in_force.in_force_* (the claim SQL reads it there).
    sa.Column("concurrency_override", sa.Integer),
    sa.Column("rate_override", sa.Integer),
    sa.Column("per_seconds_override", sa.Integer),
    # The current rate window (epoch seconds // per_seconds, database clock), the claims
    # counted in it, and the window a wakeup is already scheduled for.
    sa.Column("rate_window", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("rate_claims", sa.Integer, nullable=False, server_default="0"),
    sa.Column("woken_window", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("updated_at", TS, nullable=False),
)

pauses = sa.Table(
    "celery_lease_pauses",
    metadata,
    # A row pauses its kind: no claim of that kind succeeds until resume deletes it.
    sa.Column("kind", sa.String(200), primary_key=True),
    sa.Column("paused_at", TS, nullable=False),
)

tenant_weights = sa.Table(
    "celery_lease_tenant_weights",
    metadata,
    # A tenant's share of its fair kinds' claims (``celery lease weight``, the API): a
    # tenant with no row has weight 1, as have jobs without a tenant.
    sa.Column("tenant", sa.String(200), primary_key=True),
    sa.Column("weight", sa.Float, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.CheckConstraint("weight > 0", name="celery_lease_tenant_weights_weight_check"),
)

# --- the dashboard ---------------------------------------------------------------------

sessions = sa.Table(
    "celery_lease_sessions",
    metadata,
    # One row per signed-in dashboard session; signing out deletes it, so a copied
    # cookie stops working everywhere at once. Holds no secret (see
    # db/statements/sessions.py): id and token are HMACs under the server's secret.
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
)
sa.Index("celery_lease_sessions_expires", sessions.c.expires_at)

# --- what a transition leaves behind it ----------------------------------------------

landings = sa.Table(
    "celery_lease_landings",
    metadata,
    # One row per transaction of a Landing (db/landing.py), inserted first in it under a
    # token the client made: after a lost reply, whether the row exists is whether that
    # transaction committed. Nothing else reads it; the pruner deletes rows older than
    # LANDING_RETENTION (beat/maintenance.py).
    sa.Column("token", ID, primary_key=True),
    sa.Column("created_at", TS, nullable=False),
)

outbox = sa.Table(
    "celery_lease_outbox",
    metadata,
    # A follow-up that leaves the database (a plain Celery callback or errback), written
    # in the transaction of the transition that sets it off: what committed is what goes
    # out, whether or not its client heard the commit. The worker deletes a row once it
    # sent it; the sweeper sends and deletes any left older than OUTBOX_AGE. So each is
    # sent at least once.
    sa.Column("id", ID, primary_key=True),
    sa.Column("kind", sa.String(32), nullable=False),  # outbox.KIND_* (db/statements/outbox.py)
    sa.Column("payload", JSON, nullable=False),
    sa.Column("created_at", TS, nullable=False),
)
sa.Index("celery_lease_outbox_created", outbox.c.created_at)

# --- finished jobs past the hot table (PostgreSQL) ------------------------------------
#
# Terminal jobs without an idempotency key, and their run events, move out of
# celery_lease_jobs lease_archive_after seconds after they finish (beat's archive tick,
# db/history.py) into these tables, range-partitioned by the day the job finished (UTC);
# retention drops a day's partitions whole, so pruning leaves no dead tuples and the
# hot path's table holds the live jobs and the last archive_after of finished ones.
# SQLite has neither: it keeps every job in celery_lease_jobs, pruned row by row.
#
# Invariant: a job id is in exactly one of celery_lease_jobs and celery_lease_history
# (the move is one statement). A keyed job stays in celery_lease_jobs: the key's
# uniqueness is celery_lease_jobs_idempotency_key, an index of that table alone.
#
# The history tables were made by LIKE celery_lease_jobs / celery_lease_events (migration
# 0014): a column added to either must be added to its history table and its view.

history_metadata = sa.MetaData()

history = sa.Table(
    "celery_lease_history",
    history_metadata,
    *(sa.Column(c.name, c.type, nullable=c.nullable, server_default=c.server_default) for c in jobs.columns),
    # Only finished jobs: a read for pending or running jobs skips every partition
    # (constraint exclusion) instead of reading each to its end.
    sa.CheckConstraint(_in("status", sorted(s.value for s in Status if s.terminal)), name="celery_lease_history_status_check"),
    postgresql_partition_by="RANGE (finished_at)",
)
# The same reads as on celery_lease_jobs (by id, newest first, a tenant's, the failed
# ones, a run's), each a partitioned index: one per day partition.
sa.Index("celery_lease_history_id", history.c.id)
sa.Index("celery_lease_history_created", history.c.created_at, history.c.id)
# A kind's jobs, newest first: a day partition without them is one index probe, where
# merging the created index of every day reads such a day to its end.
sa.Index("celery_lease_history_kind", history.c.kind, history.c.created_at, history.c.id)
sa.Index(
    "celery_lease_history_tenant",
    history.c.tenant,
    history.c.created_at,
    history.c.id,
    postgresql_where=sa.text("tenant IS NOT NULL"),
)
sa.Index(
    "celery_lease_history_unsuccessful",
    history.c.status,
    history.c.created_at,
    history.c.id,
    postgresql_where=sa.text(_in("status", UNSUCCESSFUL)),
)
sa.Index("celery_lease_history_run", history.c.run_id, postgresql_where=sa.text("run_id IS NOT NULL"))
sa.Index("celery_lease_history_finished", history.c.finished_at)

history_events = sa.Table(
    "celery_lease_history_events",
    history_metadata,
    *(sa.Column(c.name, c.type, nullable=c.nullable, autoincrement=False) for c in events.columns),
    # The job's finished_at: its events are dropped with it.
    sa.Column("finished_at", TS, nullable=False),
    postgresql_partition_by="RANGE (finished_at)",
)
sa.Index("celery_lease_history_events_run", history_events.c.run_id, history_events.c.id)
sa.Index("celery_lease_history_events_job", history_events.c.job_id)

# What reads see: every job and every event wherever it lives (views of migration 0014;
# on SQLite over the one table). Reads only: FOR UPDATE and writes go to the tables.
view_metadata = sa.MetaData()
jobs_all = sa.Table("celery_lease_jobs_all", view_metadata, *(sa.Column(c.name, c.type) for c in jobs.columns))
events_all = sa.Table("celery_lease_events_all", view_metadata, *(sa.Column(c.name, c.type) for c in events.columns))
