"""The attempt log's SQL (db/statements/attempt_log.py) on both dialects: a claim
appends an open entry and drops the oldest past MAX_ENTRIES; an ending closes only an
open last entry."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs
from celery_lease.db.statements.attempt_log import MAX_ENTRIES, close_attempt, open_attempt
from celery_lease.status import AttemptOutcome
from celery_lease.testing import migrated


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    url = migrated(f"sqlite:///{tmp_path / 'log.db'}") if request.param == "sqlite" else request.getfixturevalue("pg")
    engine = sa.create_engine(url)
    yield engine
    engine.dispose()


def _entry(n: int, outcome: str = "succeeded") -> dict:
    return {"attempt": n, "owner": "w@h/1/b", "started_at": "2026-11-30 10:00:00.000000", "ended_at": None, "outcome": outcome}


def test_the_log_is_capped_and_only_an_open_entry_is_closed(db, make_job):
    job = make_job(str(db.url.render_as_string(hide_password=False)), attempts=[_entry(n) for n in range(1, MAX_ENTRIES + 1)])
    where = jobs.c.id == job

    def write(value) -> list[dict]:
        with db.begin() as conn:
            conn.execute(sa.update(jobs).where(where).values(attempts=value))
            return conn.execute(sa.select(jobs.c.attempts).where(where)).scalar_one()

    log = write(open_attempt(sa.literal(MAX_ENTRIES + 1), sa.literal("w2@h/7/c")))
    assert len(log) == MAX_ENTRIES and log[0]["attempt"] == 2  # the oldest went
    assert {k: log[-1][k] for k in ("attempt", "owner", "ended_at", "outcome")} == {
        "attempt": MAX_ENTRIES + 1,
        "owner": "w2@h/7/c",
        "ended_at": None,
        "outcome": "running",
    }
    log = write(close_attempt(AttemptOutcome.LEASE_EXPIRED))
    assert log[-1]["outcome"] == "lease expired" and log[-1]["ended_at"] is not None
    assert log[-2] == _entry(MAX_ENTRIES)  # earlier entries untouched
    # Closed already (a cancel of the pending job that was requeued): nothing changes.
    assert write(close_attempt(AttemptOutcome.CANCELLED)) == log


def test_a_job_never_claimed_has_no_log_to_close(db, make_job):
    job = make_job(str(db.url.render_as_string(hide_password=False)))
    with db.begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.id == job).values(attempts=close_attempt(AttemptOutcome.CANCELLED)))
        assert conn.execute(sa.select(jobs.c.attempts).where(jobs.c.id == job)).scalar_one() is None
