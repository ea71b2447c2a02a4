"""Fair share across tenants (``@leases.job(kind=..., fair=True)``): the key that orders a
fair kind's claims, tenants' weights, and what reads them (docs/decisions.md, fair share).

Start-time fair queueing: each pending job of a fair kind carries ``fair_key``, a
tenant's next job keyed ``1 / weight`` after the later of its own last pending key and
the round's head (the smallest pending key of the kind, queue, concurrency key and
priority). Claims take the smallest key within the top priority (ties: the oldest job),
so tenants with jobs waiting are served in proportion to their weights, and a late tenant
starts at the head. The rule: every decision is an index probe (celery_lease_jobs_fair,
_fair_tenant), never an enumeration of tenants. A weight change re-spaces the tenant's
pending jobs from the head (:func:`respace`), in the transaction that stores it.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from celery_lease.db.schema import ID, jobs, tenant_weights
from celery_lease.db.statements.common import _PENDING, _RUNNING, _c, _due, db_now
from celery_lease.status import Status

#: A tenant with no weight row, and jobs without a tenant, weigh this.
DEFAULT_WEIGHT = 1.0


class _greater(FunctionElement):
    """The greater of two numbers (``greatest`` on PostgreSQL, ``max`` on SQLite)."""

    type = sa.Float()
    inherit_cache = True


@compiles(_greater)
def _greater_pg(element, compiler, **kw):
    return f"greatest({compiler.process(element.clauses, **kw)})"


@compiles(_greater, "sqlite")
def _greater_sqlite(element, compiler, **kw):
    return f"max({compiler.process(element.clauses, **kw)})"


def weight_of(tenant: Any) -> sa.ColumnElement:
    """The weight of ``tenant`` (an expression): its row's, else DEFAULT_WEIGHT."""
    stored = sa.select(tenant_weights.c.weight).where(tenant_weights.c.tenant == tenant).scalar_subquery()
    return sa.func.coalesce(stored, sa.literal(DEFAULT_WEIGHT, sa.Float))


def _pending_fair(t) -> list[sa.ColumnElement[bool]]:
    # Literal 'pending' and fair_key IS NOT NULL: the fair indexes' predicate, which a
    # prepared generic plan can only use when the WHERE visibly implies it.
    return [t.status == _PENDING, t.fair_key.is_not(None)]


def _same(column: Any, value: Any, probe: Any) -> sa.ColumnElement:
    """``probe(column is value)`` for a value that may be NULL, as two probes of which a
    CASE runs one: "IS NOT DISTINCT FROM" is no index key."""
    return sa.case((value.is_(None), probe(column.is_(None))), else_=probe(column == value))


def key_group(t: Any) -> sa.ColumnElement:
    """A job's concurrency key as the fair index holds it: NULL is '' there, so that a
    walk for either is an equality, which an ordered index scan can follow (IS NULL is
    not). A kind's NULL-key and ''-key jobs share one fair order: harmless, the claim's
    limit counts the claimed job's own key."""
    return sa.func.coalesce(t.concurrency_key, sa.literal_column("''"))


def _head(kind: Any, queue: Any, concurrency_key: Any, priority: Any) -> sa.ScalarSelect:
    """The round's head: the smallest key of a due pending job of the kind, queue,
    concurrency key and priority (one probe of celery_lease_jobs_fair). NULL: none."""
    group = sa.func.coalesce(concurrency_key, sa.literal_column("''"))
    where = (*_pending_fair(_c), _c.kind == kind, _c.queue == queue, key_group(_c) == group, _c.priority == priority, _due(_c))
    return sa.select(_c.fair_key).where(*where).order_by(_c.fair_key).limit(1).scalar_subquery()


def _last(kind: Any, tenant: Any) -> sa.ColumnElement:
    """The largest key of the tenant's pending jobs of the kind (one probe of
    celery_lease_jobs_fair_tenant; jobs without a tenant are one tenant). NULL: none."""

    def probe(same_tenant: sa.ColumnElement[bool]) -> sa.ScalarSelect:
        where = (*_pending_fair(_c), _c.kind == kind, same_tenant)
        return sa.select(_c.fair_key).where(*where).order_by(_c.fair_key.desc()).limit(1).scalar_subquery()

    return _same(_c.tenant, tenant, probe)


def fair_key(kind: Any, queue: Any, concurrency_key: Any, priority: Any, tenant: Any, rank: Any) -> sa.ColumnElement:
    """The key of a tenant's ``rank``-th new job (1 for the first) of one submit:
    ``rank`` steps of 1 / weight after the later of the head and the tenant's last key.

    Two submits of one tenant racing may give equal keys: harmless, a tie is claimed
    oldest first."""
    zero = sa.literal(0.0, sa.Float)
    head = _head(kind, queue, concurrency_key, priority)
    start = _greater(sa.func.coalesce(head, zero), sa.func.coalesce(_last(kind, tenant), zero))
    return start + sa.cast(rank, sa.Float) / weight_of(tenant)


def fair_key_of_row() -> sa.ColumnElement:
    """fair_key in insert_jobs: bound per row (store.fair_params). ``:fair_rank`` NULL (a
    kind that is not fair): NULL, and nothing is read."""
    rank = sa.bindparam("fair_rank", type_=sa.Float)

    def bound(name: str) -> Any:
        return sa.bindparam(f"fair_{name}", type_=_c[name].type)

    key = fair_key(bound("kind"), bound("queue"), bound("concurrency_key"), bound("priority"), bound("tenant"), rank)
    return sa.case((rank.is_not(None), key), else_=sa.null())


def fair_head_job() -> sa.ColumnElement:
    """The job a delivery of a fair kind claims: the first due pending job of the
    delivered job's kind, queue and concurrency key in (priority desc, fair_key,
    created_at) order, or the delivered job itself when it is that first. NULL when the
    delivered job is not a due pending job of a fair kind (then the claim goes on as
    for any kind)."""
    named, best = jobs.alias("named"), jobs.alias("best")

    def delivered(column: str) -> sa.ScalarSelect:
        # Each read once, before the walk (an InitPlan): the walk's kind and queue are
        # then constants, so it is an ordered scan of celery_lease_jobs_fair that stops
        # at its first row, where a join with the delivered row is planned as a sort of
        # every pending job of the kind.
        return (
            sa.select(named.c[column])
            .where(
                named.c.id == sa.bindparam("job_id", type_=ID),
                named.c.status == Status.PENDING.value,
                named.c.fair_key.is_not(None),
                _due(named.c),
            )
            .scalar_subquery()
        )

    # The same concurrency key: the claim's limit counts the claimed job's.
    group = sa.func.coalesce(delivered("concurrency_key"), sa.literal_column("''"))
    walk = (
        sa.select(best.c.id)
        .where(
            *_pending_fair(best.c),
            best.c.kind == delivered("kind"),
            best.c.queue == delivered("queue"),
            key_group(best.c) == group,
            _due(best.c),
        )
        .order_by(best.c.priority.desc(), best.c.fair_key, best.c.created_at)
        .limit(1)
        .with_for_update(of=best, skip_locked=True)
        .scalar_subquery()
    )
    # A kind that is not fair (every claim of every kind carries this) pays one primary
    # key probe for the gate, not the walk's three.
    return sa.case((delivered("fair_key").is_not(None), walk), else_=sa.null())


# --- weights ---------------------------------------------------------------------------


@functools.cache
def set_weight(dialect: str) -> sa.Insert:
    """set_weight: :tenant weighs :weight from now on (insert or replace its row)."""
    insert: Any = postgresql.insert(tenant_weights) if dialect == "postgresql" else sqlite.insert(tenant_weights)
    stmt = insert.values(tenant=sa.bindparam("tenant"), weight=sa.bindparam("weight"), updated_at=db_now())
    return stmt.on_conflict_do_update(
        index_elements=[tenant_weights.c.tenant], set_={"weight": stmt.excluded.weight, "updated_at": db_now()}
    )


def clear_weight() -> sa.Delete:
    """clear_weight: :tenant weighs DEFAULT_WEIGHT again."""
    return sa.delete(tenant_weights).where(tenant_weights.c.tenant == sa.bindparam("tenant"))


@functools.cache
def respace() -> sa.Update:
    """respace: :of_tenant's pending jobs of every fair kind keyed again at its weight now
    in force: the n-th (in key order) of each kind, queue, concurrency key and priority at n / weight
    after that round's head, so a new weight is obeyed by the very next claims. Run in
    the transaction that stored the weight, after it."""
    tenant = sa.bindparam("of_tenant", type_=_c.tenant.type)  # (not "tenant": a column's)
    order = (_c.fair_key, _c.created_at)
    mine = (
        sa.select(
            _c.id.label("id"),
            sa.func.row_number()
            .over(partition_by=(_c.kind, _c.queue, _c.concurrency_key, _c.priority), order_by=order)
            .label("rank"),
        )
        .where(*_pending_fair(_c), _c.tenant == tenant)
        .cte("mine")
    )
    other = jobs.alias("other")
    head = (
        sa.select(sa.func.min(other.c.fair_key))
        .where(
            *_pending_fair(other.c),
            other.c.kind == _c.kind,
            other.c.queue == _c.queue,
            key_group(other.c) == key_group(_c),
            other.c.priority == _c.priority,
        )
        .scalar_subquery()
    )
    key = sa.func.coalesce(head, sa.literal(0.0, sa.Float)) + sa.cast(mine.c.rank, sa.Float) / weight_of(tenant)
    return sa.update(jobs).where(_c.id == mine.c.id).values(fair_key=key)


# --- reads -----------------------------------------------------------------------------


def tenants() -> sa.Select:
    """tenants: per tenant with pending or running jobs of fair kinds, or a stored
    weight: its weight, and its pending and running fair jobs (jobs without a tenant
    are one tenant, NULL)."""
    counted = (
        sa.select(
            _c.tenant.label("tenant"),
            sa.func.count().filter(_c.status == _PENDING).label("pending"),
            sa.func.count().filter(_c.status == _RUNNING).label("running"),
        )
        .where(_c.status.in_([_PENDING, _RUNNING]), _c.fair_key.is_not(None))
        .group_by(_c.tenant)
        .subquery("counted")
    )
    weights = tenant_weights
    joined = counted.join(weights, weights.c.tenant == counted.c.tenant, full=True)
    return (
        sa.select(
            sa.func.coalesce(counted.c.tenant, weights.c.tenant).label("tenant"),
            sa.func.coalesce(weights.c.weight, sa.literal(DEFAULT_WEIGHT, sa.Float)).label("weight"),
            sa.func.coalesce(counted.c.pending, 0).label("pending"),
            sa.func.coalesce(counted.c.running, 0).label("running"),
        )
        .select_from(joined)
        .order_by(sa.func.coalesce(counted.c.tenant, weights.c.tenant).nulls_first())
    )


def fair_params(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What insert_jobs binds for ``rows`` (job_row's, with ``fair``: the kind is
    fair): each row's columns and its fair_* parameters (fair_key_of_row). The rows of
    one tenant in one statement all read the same head and last key, so the n-th of a
    kind, queue, priority and tenant is given rank n."""
    seen: dict[tuple, int] = {}
    out = []
    for row in rows:
        values = {k: v for k, v in row.items() if k != "fair"}
        rank = None
        if row.get("fair"):
            group = (row["kind"], row.get("queue"), row.get("concurrency_key"), row.get("priority", 0), row.get("tenant"))
            rank = seen[group] = seen.get(group, 0) + 1
        values.update(
            fair_rank=rank,
            fair_kind=row["kind"],
            fair_queue=row.get("queue"),
            fair_concurrency_key=row.get("concurrency_key"),
            fair_priority=row.get("priority", 0),
            fair_tenant=row.get("tenant"),
        )
        out.append(values)
    return out
