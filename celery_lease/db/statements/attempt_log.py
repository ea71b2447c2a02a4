"""The job's attempt log (column ``attempts``): one entry per claim, in order, written by the
statements that claim and end attempts themselves, never by one of its own (no round trip
added to a claim or a completion).

Each entry is ``{"attempt", "owner", "started_at", "ended_at", "outcome"}``: the claim
appends it open (``outcome`` "running", ``ended_at`` null, owner ``node/pid/boot``), and
whatever ends the attempt closes the last entry with its outcome (status.AttemptOutcome).
The rule: only an open last entry is closed (a cancel of a pending job leaves the log as
it is); a hand-off and a snooze give their attempt back, so the next entry has the same
number. Bounded: the oldest entry is dropped from a log of MAX_ENTRIES when a claim
appends. Times are the database clock's (PostgreSQL: ISO 8601 with offset; SQLite: UTC).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from celery_lease.db.schema import JSON, jobs
from celery_lease.db.statements.common import db_now
from celery_lease.status import AttemptOutcome

#: Entries kept per job: the most recent ones.
MAX_ENTRIES = 50


class opened(FunctionElement):
    """(log, number, owner, now): the log with a new open entry for attempt ``number``
    by ``owner``."""

    type = JSON
    inherit_cache = True


class closed(FunctionElement):
    """(log, outcome, now): the log with its last entry ended with ``outcome``, when
    that entry is open."""

    type = JSON
    inherit_cache = True


def open_attempt(number: sa.ColumnElement, owner: sa.ColumnElement) -> opened:
    return opened(jobs.c.attempts, number, owner, db_now())


def close_attempt(outcome: AttemptOutcome) -> closed:
    # Literal SQL, not a bound value: prepared, only the rows' values travel.
    return closed(jobs.c.attempts, sa.literal_column(f"'{outcome.value}'"), db_now())


_RUNNING = f"'{AttemptOutcome.RUNNING.value}'"


@dataclass(frozen=True)
class _Json:
    """One dialect's spelling of the JSON operations the log needs."""

    entry: str  # (attempt, owner, started_at) -> a new open entry
    empty: str
    length: str  # (log)
    drop_first: str  # (log)
    append: str  # (log, entry)
    last_outcome: str  # (log)
    close_last: str  # (log, outcome, ended_at)


_SPELLINGS = {
    "postgresql": _Json(
        entry=(
            "jsonb_build_object('attempt', {0}, 'owner', CAST({1} AS text), 'started_at', {2},"
            f" 'ended_at', NULL, 'outcome', {_RUNNING})"
        ),
        empty="'[]'::jsonb",
        length="jsonb_array_length({0})",
        drop_first="({0} - 0)",
        append="({0} || jsonb_build_array({1}))",
        last_outcome="({0} -> -1 ->> 'outcome')",
        close_last="jsonb_set({0}, '{{-1}}', ({0} -> -1) || jsonb_build_object('ended_at', {2}, 'outcome', CAST({1} AS text)))",
    ),
    # The column is JSON text; '$[#]' appends, '$[#-1]' is the last element.
    "sqlite": _Json(
        entry=f"json_object('attempt', {{0}}, 'owner', {{1}}, 'started_at', {{2}}, 'ended_at', NULL, 'outcome', {_RUNNING})",
        empty="'[]'",
        length="json_array_length({0})",
        drop_first="json_remove({0}, '$[0]')",
        append="json_insert({0}, '$[#]', {1})",
        last_outcome="json_extract({0}, '$[#-1].outcome')",
        close_last="json_set({0}, '$[#-1].ended_at', {2}, '$[#-1].outcome', {1})",
    ),
}


@compiles(opened)
def _opened(element, compiler, **kw):
    json = _SPELLINGS[compiler.dialect.name]
    log, number, owner, now = (compiler.process(c, **kw) for c in element.clauses)
    prior = f"COALESCE({log}, {json.empty})"
    kept = f"(CASE WHEN {json.length.format(prior)} >= {MAX_ENTRIES} THEN {json.drop_first.format(prior)} ELSE {prior} END)"
    return json.append.format(kept, json.entry.format(number, owner, now))


@compiles(closed)
def _closed(element, compiler, **kw):
    json = _SPELLINGS[compiler.dialect.name]
    log, outcome, now = (compiler.process(c, **kw) for c in element.clauses)
    ended = json.close_last.format(log, outcome, now)
    return f"(CASE WHEN {json.last_outcome.format(log)} = {_RUNNING} THEN {ended} ELSE {log} END)"
