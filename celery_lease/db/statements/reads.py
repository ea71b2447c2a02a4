"""Reads of jobs and of run events (celery_lease.db.reads): one job, a page of jobs,
a run's events; the HTTP API's reads, a tenant's only, never a large column unasked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_lease.db.schema import events, jobs
from celery_lease.db.statements.common import _c, sql_function
from celery_lease.db.statements.history import everywhere


def get_job(job_id: str) -> sa.Select:
    return everywhere(sa.select(jobs).where(_c.id == job_id))


def get_checkpoint(job_id: str) -> sa.Select:
    """get_checkpoint: one job's checkpoint (no row: no such job)."""
    return everywhere(sa.select(_c.checkpoint).where(_c.id == job_id))


def ids_between(low: str, high: str, limit: int) -> sa.Select:
    """ids_between: the first ``limit`` job ids from ``low`` to ``high`` (a prefix's
    range: a range scan of the primary key, never a scan of the table)."""
    return everywhere(sa.select(_c.id).where(_c.id >= low, _c.id <= high).order_by(_c.id).limit(limit))


#: What the HTTP API shows of a job: never the payload, checkpoint or lease internals,
#: which may be megabytes (and the lease owner names a worker host).
VIEW_COLUMNS = (
    _c.id,
    _c.kind,
    _c.queue,
    _c.status,
    _c.result,
    _c.error,
    _c.progress,
    _c.attempt,
    _c.max_attempts,
    _c.created_at,
    _c.started_at,
    _c.finished_at,
    _c.run_id,
    _c.parent_id,
)


def get_job_view(job_id: str, *, tenant: str | None = None) -> sa.Select:
    """get_job_view: one job's API columns and its attempt log; with ``tenant``, only
    that tenant's job.

    The tenant is in the WHERE clause: another tenant's job reads no more than a
    missing one (one primary-key probe, none of its large columns)."""
    stmt = sa.select(*VIEW_COLUMNS, _c.attempts).where(_c.id == job_id)
    return everywhere(stmt if tenant is None else stmt.where(_c.tenant == tenant))


#: The size in bytes of a JSON column's stored text (NULL for NULL).
json_bytes = sql_function("json_bytes", sa.Integer(), "octet_length(CAST({} AS TEXT))", "length(CAST({} AS BLOB))")


def _bounded(column: Any, max_bytes: int) -> tuple[Any, Any]:
    """``column`` when its JSON text is at most ``max_bytes`` (else NULL), and its size:
    a list page never reads a large value out of the table."""
    size = json_bytes(column)
    return sa.case((size <= max_bytes, column), else_=sa.null()).label(column.name), size.label(f"{column.name}_bytes")


def list_job_summaries(*, max_value_bytes: int, **filters: Any) -> sa.Select:
    """list_job_summaries: list_jobs with the API columns, ``result`` and ``progress``
    only when their JSON text is at most ``max_value_bytes`` (NULL otherwise), and
    their sizes (``result_bytes``, ``progress_bytes``)."""
    result, result_bytes = _bounded(_c.result, max_value_bytes)
    progress, progress_bytes = _bounded(_c.progress, max_value_bytes)
    columns = [c for c in VIEW_COLUMNS if c.name not in ("result", "progress")]
    return list_jobs(columns=(*columns, result, result_bytes, progress, progress_bytes), **filters)


def run_visible(run_id: str, *, tenant: str | None = None) -> sa.Select:
    """run_visible: 1 when the run holds a job (of ``tenant``, when given)."""
    stmt = sa.select(sa.literal(1)).where(_c.run_id == run_id)
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    return everywhere(stmt.limit(1))


def list_jobs(
    *,
    status: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    tenant: str | None = None,
    run_id: str | None = None,
    after: tuple[Any, str] | None = None,
    limit: int = 50,
    columns: Sequence[Any] = (jobs,),
) -> sa.Select:
    """Newest first; ``after`` is the (created_at, id) of the last row of a page.

    Keyset pagination on (created_at, id) is stable under concurrent inserts: new
    rows sort before the cursor and never shift later pages. A tenant's pages walk
    the ``celery_lease_jobs_tenant`` index (tenant, created_at, id).
    """
    stmt = sa.select(*columns)
    if status is not None:
        stmt = stmt.where(_c.status == status)
    if kind is not None:
        stmt = stmt.where(_c.kind == kind)
    if queue is not None:
        stmt = stmt.where(_c.queue == queue)
    if tenant is not None:
        stmt = stmt.where(_c.tenant == tenant)
    if run_id is not None:
        stmt = stmt.where(_c.run_id == run_id)
    if after is not None:
        created_at, job_id = after
        # On SQLite this compares text: db_now() spells times as bound datetimes do.
        stmt = stmt.where(sa.or_(_c.created_at < created_at, sa.and_(_c.created_at == created_at, _c.id < job_id)))
    return everywhere(stmt.order_by(_c.created_at.desc(), _c.id.desc()).limit(limit))


def _tenant_jobs_of_run(run_id: str, tenant: str) -> sa.Select:
    return sa.select(_c.id).where(_c.run_id == run_id, _c.tenant == tenant)


def list_run_events(run_id: str, *, after_id: int = 0, limit: int = 1000, tenant: str | None = None) -> sa.Select:
    """A run's events in order; with ``tenant``, only events of that tenant's jobs."""
    stmt = sa.select(events).where(events.c.run_id == run_id, events.c.id > after_id)
    if tenant is not None:
        stmt = stmt.where(events.c.job_id.in_(_tenant_jobs_of_run(run_id, tenant)))
    return everywhere(stmt.order_by(events.c.id).limit(limit))


def list_tenant_run_events(run_id: str, tenant: str, *, after_seq: int = 0, limit: int = 1000) -> sa.Select:
    """list_tenant_run_events: the events of one tenant's jobs of a run, numbered 1, 2, 3
    ... (``seq``) in order among themselves.

    Event ids come from one sequence for every tenant, so the gaps between a tenant's
    own ids would count everyone else's events: a tenant pages by ``seq`` instead.
    (Pruning a run's old jobs deletes their events and renumbers the later ones.)
    """
    visible = (
        sa.select(events, sa.func.row_number().over(order_by=events.c.id).label("seq"))
        .where(events.c.run_id == run_id, events.c.job_id.in_(_tenant_jobs_of_run(run_id, tenant)))
        .subquery("visible")
    )
    return everywhere(sa.select(visible).where(visible.c.seq > after_seq).order_by(visible.c.seq).limit(limit))
