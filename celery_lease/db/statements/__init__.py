"""The statement catalogue: every SQL statement celery-lease runs, named after what it does,
one module per subject (common, submit, claim, attempt, cancel, maintenance, lost, events,
canvas, reads, metrics, dashboard, landing, flow, fair: docs/internals.md).

Statements are SQLAlchemy Core constructs with bound parameters, statuses from
:class:`Status`, time from the database's clock (never a worker's or beat's). The rule:
each state transition is exactly one guarded statement. An attempt's writes match ``id``,
``status = 'running'`` and its ``lease_generation`` (zero rows: the lease is lost, the
write is discarded); revoking statements (cancel, reap, recovery) bump the generation and
are durable (db/durability.py); nothing matches a terminal status. Statements with no
arguments are built once (``functools.cache``): building one costs more than running it.
"""
