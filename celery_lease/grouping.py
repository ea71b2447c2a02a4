"""A Celery group's leased members as one submit: one INSERT, one transaction, its
wakeups published together.

Celery applies a group (and a chord's header) member by member inside one
``app.producer_or_acquire()`` block. For an app with a CeleryLease that block is a
:class:`GroupSubmit`: a leased member applied with the block's producer and a group id is
checked and turned into its row at once (a bad payload still raises at that member), and
the rows are written when the block ends, before ``group.apply_async`` returns, by one
:meth:`~celery_lease.producer.Producer.submit_rows`. The rule: all rows or none, the error
reaching the caller; a block left by an exception writes none. Only the app's own
``producer_or_acquire`` is wrapped (:func:`install`), never Celery's class; a leased task
applied outside such a block submits at once. Plain members are Celery's, as before.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from celery import Celery

if TYPE_CHECKING:
    from celery_lease.kinds import JobKind
    from celery_lease.producer import Producer

#: The group submits open in this thread (or task), innermost last.
_OPEN: contextvars.ContextVar[tuple[GroupSubmit, ...]] = contextvars.ContextVar("celery_lease_group_submits", default=())

_MARK = "_celery_lease_group_submits"


class GroupSubmit:
    """One ``producer_or_acquire`` block of an app with a CeleryLease."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner  # Celery's FallbackContext
        self.producer: Any = None
        #: (producer, connection, row) of each leased member, in the order applied.
        self._rows: list[tuple[Producer, Any, dict[str, Any]]] = []

    def __enter__(self) -> Any:
        self.producer = self._inner.__enter__()
        _OPEN.set((*_OPEN.get(), self))
        return self.producer

    def __exit__(self, exc_type, exc, tb) -> Any:
        _OPEN.set(tuple(b for b in _OPEN.get() if b is not self))
        rows, self._rows = self._rows, []
        # The broker producer goes back to its pool first: the flush publishes with its own.
        suppressed = self._inner.__exit__(exc_type, exc, tb)
        if exc_type is None and rows:
            _flush(rows)
        return suppressed

    def add(self, producer: Producer, spec: JobKind, payload: Any, submit: dict[str, Any]) -> None:
        """Keep a member's row (made and checked now) for the flush; ``submit``: the
        producer options of LeaseTask._submit_options."""
        options = dict(submit)
        keys = options.pop("idempotency_keys")
        connection = options.pop("connection", None)
        row = producer.job_row(spec, producer.serialize(spec, payload), {**options, "idempotency_key": keys[0]})
        if any(str(kept["id"]) == str(row["id"]) for _, _, kept in self._rows):
            raise TypeError(f"{spec.task}: two members of one group have the task id {row['id']}")
        if self._rows and self._rows[0][1] is not connection:
            raise TypeError(f"{spec.task}: the leased members of one group must share one connection= (or none)")
        self._rows.append((producer, connection, row))


def _flush(rows: list[tuple[Producer, Any, dict[str, Any]]]) -> None:
    # One submit per producer: apps with two CeleryLeases in one group are two writes.
    by_producer: dict[int, tuple[Producer, Any, list[dict[str, Any]]]] = {}
    for producer, connection, row in rows:
        by_producer.setdefault(id(producer), (producer, connection, []))[2].append(row)
    for producer, connection, group_rows in by_producer.values():
        producer.submit_rows(group_rows, keyed=True, connection=connection)


def group_submit_for(options: dict[str, Any]) -> GroupSubmit | None:
    """The open group submit a leased member applied with these options belongs to, or None
    (applied outside a group: submitted at once)."""
    producer = options.get("producer")
    if producer is None or not options.get("group_id") or not options.get("task_id"):
        return None
    for block in reversed(_OPEN.get()):
        if block.producer is producer:
            return block
    return None


def install(app: Celery) -> None:
    """Wrap ``app.producer_or_acquire`` (this app's attribute only, see the module's
    docstring) so that a group's leased members are written together."""
    if getattr(app, _MARK, False):
        return
    acquire = app.producer_or_acquire

    def producer_or_acquire(producer: Any = None) -> GroupSubmit:
        return GroupSubmit(acquire(producer))

    producer_or_acquire.__doc__ = acquire.__doc__
    # Instance attribute: shadows Celery's method for this app alone.
    app.producer_or_acquire = producer_or_acquire
    setattr(app, _MARK, True)
