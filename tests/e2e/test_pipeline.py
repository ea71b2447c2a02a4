"""The example pipeline (tasks/) end to end: PostgreSQL source and job database, Redis,
real `celery -A tasks.app worker` processes, one of them SIGKILLed mid-extract."""

from __future__ import annotations

import importlib
import sys
import uuid

import pytest
import sqlalchemy as sa

from celery_lease import InvalidPayload, LeaseError, Status
from celery_lease.db.schema import events
from tests.conftest import throwaway_database, wait_for

LEASE = "3"  # seconds: a killed worker's job is reaped this long after its last heartbeat


@pytest.fixture(scope="module")
def source_db():
    """A PostgreSQL database holding the sample shop tables (tasks/sample.py)."""
    from tasks import sample

    with throwaway_database("celery_lease_source") as url:
        yield url, sample.build(url, rows=12_000)


def _env(db: str, broker: str) -> dict:
    return {"CELERY_LEASE_DATABASE_URL": db, "CELERY_BROKER_URL": broker, "TASKS_LEASE_SECONDS": LEASE}


@pytest.fixture
def pipeline(monkeypatch):
    """Import tasks.app (and its handlers) in this process against a database and broker."""
    made = []

    def make(db: str, broker: str):
        for key, value in _env(db, broker).items():
            monkeypatch.setenv(key, value)
        for name in ("tasks.app", "tasks.pipeline"):
            sys.modules.pop(name, None)
        pipeline = importlib.import_module("tasks.pipeline")
        made.append(pipeline)
        return pipeline

    yield make
    for pipeline in made:
        pipeline.leases.store.dispose()
        pipeline.leases.app.close()
    for name in ("tasks.app", "tasks.pipeline"):
        sys.modules.pop(name, None)


def _start(workers, db, broker, name):
    return workers(db, broker, name=name, module="tasks.app", extra_env=_env(db, broker))


def _run_jobs(leases, run_id):
    return sorted(leases.store.list_jobs(run_id=run_id, limit=1000), key=lambda j: j.created_at)


def _finish(leases, run_id, timeout=90):
    """Play beat (reap + sweep) until every job of the run is terminal."""

    def done():
        leases.reap()
        leases.sweep()
        jobs = _run_jobs(leases, run_id)
        return jobs if jobs and all(j.terminal for j in jobs) else None

    return wait_for(done, timeout=timeout, interval=0.3, what="the run to finish")


def _loaded(db: str, table: str, load_id: str) -> tuple[int, int, int]:
    """(rows, distinct ids, sum of ids) that load job ``load_id`` wrote."""
    from tasks import warehouse

    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            dest = sa.Table(warehouse.destination_name(table), sa.MetaData(), autoload_with=conn)
            mine = dest.c[warehouse.LOAD_JOB_COLUMN] == load_id
            return tuple(
                conn.execute(
                    sa.select(
                        sa.func.count(),
                        sa.func.count(sa.distinct(dest.c.id)),
                        sa.func.coalesce(sa.func.sum(dest.c.id), 0),
                    ).where(mine)
                ).one()
            )
    finally:
        engine.dispose()


def test_discover_extract_load_chained_survives_a_sigkilled_worker(pg, broker, source_db, pipeline, workers):
    source_url, counts = source_db
    p = pipeline(pg, broker)
    w1 = _start(workers, pg, broker, "w1")
    w2 = _start(workers, pg, broker, "w2")
    by_node = {"w1@testhost": w1, "w2@testhost": w2}
    run_id = str(uuid.uuid4())
    discover = p.discover.submit({"source": source_url, "extract": True, "chunk_rows": 300, "pause": 0.2}, run_id=run_id)

    def an_extract_a_third_done():
        for job in _run_jobs(p.leases, run_id):
            prog = job.progress or {}
            if (
                job.kind == "extract"
                and job.status is Status.RUNNING
                and prog.get("of")
                and prog.get("rows", 0) * 3 >= prog["of"]
                and prog["rows"] < prog["of"]
            ):
                return job
        return None

    victim = wait_for(an_extract_a_third_done, timeout=60, interval=0.05, what="an extract a third done")
    node = victim.lease_owner.split("/")[0]
    by_node[node].kill()  # SIGKILL to the worker's process group: main process and pool
    killed_at = p.leases.get(victim.id)
    # Nothing told the table: the job is still running under the dead worker's lease.
    assert killed_at.status is Status.RUNNING and killed_at.lease_owner.startswith(node + "/")
    seen_rows = (killed_at.progress or {}).get("rows", 0)

    jobs = _finish(p.leases, run_id)
    assert all(j.status is Status.SUCCEEDED for j in jobs), [(j.kind, j.status, j.error) for j in jobs]
    by_kind: dict[str, list] = {}
    for job in jobs:
        by_kind.setdefault(job.kind, []).append(job)
    assert len(by_kind["discover"]) == 1 and by_kind["discover"][0].id == discover.id
    extracts = {j.payload["table"]: j for j in by_kind["extract"]}
    loads = {j.payload["table"]: j for j in by_kind["load"]}
    assert set(extracts) == set(loads) == set(counts)
    # The chain: discover -> extract -> load, all in the run.
    for table in counts:
        assert extracts[table].parent_id == discover.id
        assert loads[table].parent_id == extracts[table].id

    resumed = p.leases.get(victim.id)
    assert resumed.attempt == 2 and resumed.lease_losses == 1
    # The second attempt started from the checkpoint, not from row 0.
    assert resumed.result["resumed_from"] >= seen_rows > 0
    assert resumed.result["rows"] == counts[victim.payload["table"]]
    with sa.create_engine(pg).connect() as conn:
        kinds = [
            r.event for r in conn.execute(sa.select(events.c.event).where(events.c.job_id == victim.id).order_by(events.c.id))
        ]
    assert "reaped" in kinds and kinds[-1] == "succeeded"

    # Exactly once: each destination table holds every source row, once.
    src = sa.create_engine(source_url)
    with src.connect() as conn:
        for table, expected in counts.items():
            source_sum = conn.execute(sa.text(f"SELECT sum(id) FROM {table}")).scalar_one()
            assert _loaded(pg, table, loads[table].id) == (expected, expected, source_sum), table
    src.dispose()
    from tasks import warehouse

    with sa.create_engine(pg).connect() as conn:
        leftover = conn.execute(
            sa.select(sa.func.count())
            .select_from(warehouse.staging)
            .where(warehouse.staging.c.extract_id.in_([j.id for j in extracts.values()]))
        ).scalar_one()
    assert leftover == 0  # each load dropped its staged chunks with its success


def test_cancel_run_stops_the_chain(pg, broker, source_db, pipeline, workers):
    source_url, counts = source_db
    p = pipeline(pg, broker)
    w = _start(workers, pg, broker, "w1")
    run_id = str(uuid.uuid4())
    p.discover.submit({"source": source_url, "extract": True, "chunk_rows": 200, "pause": 0.3}, run_id=run_id)

    def a_running_extract():
        return next(
            (
                j
                for j in _run_jobs(p.leases, run_id)
                if j.kind == "extract" and j.status is Status.RUNNING and (j.progress or {}).get("rows")
            ),
            None,
        )

    running = wait_for(a_running_extract, timeout=60, what="an extract to be under way")
    assert p.leases.cancel_run(run_id) >= 1
    jobs = _finish(p.leases, run_id, timeout=30)
    assert p.leases.get(running.id).status is Status.CANCELLED
    # The handler stopped at its next raise_if_cancelled, and wrote nothing after.
    wait_for(
        lambda: f"job {running.id}: stopped after cancel" in w.log(), timeout=20, what="the worker to stop the cancelled extract"
    )
    # A load exists only for an extract that succeeded: none for a cancelled one.
    cancelled = {j.id for j in jobs if j.kind == "extract" and j.status is Status.CANCELLED}
    assert cancelled and not [j for j in jobs if j.kind == "load" and j.parent_id in cancelled]
    with pytest.raises(LeaseError):
        p.extract.submit({"source": source_url, "table": "orders"}, run_id=run_id)


def test_test_preview_and_clear_failures(pg, broker, source_db, pipeline, workers):
    source_url, counts = source_db
    p = pipeline(pg, broker)
    _start(workers, pg, broker, "w1")

    ok = p.leases.wait(p.check_source.submit({"source": source_url}).id, timeout=30)
    assert ok.status is Status.SUCCEEDED
    assert ok.result["dialect"] == "postgresql" and ok.result["tables"] == 3

    shown = p.leases.wait(p.preview.submit({"source": source_url, "table": "orders", "limit": 3}).id, timeout=30)
    assert shown.result["columns"][0] == "id" and [r[0] for r in shown.result["rows"]] == [1, 2, 3]

    # A wrong source fails at once, without retrying and without the driver's message
    # (which would carry the password).
    bad = "postgresql+psycopg2://root:pw-s3cret@127.0.0.1:1/nowhere"
    failed = p.leases.wait(p.check_source.submit({"source": bad}).id, timeout=30)
    assert failed.status is Status.FAILED and failed.attempt == 1
    assert failed.error.startswith("cannot connect to the source database") and "pw-s3cret" not in failed.error

    missing = p.leases.wait(p.extract.submit({"source": source_url, "table": "nope"}).id, timeout=30)
    assert missing.status is Status.FAILED and missing.error == "the source has no table 'nope'"


@pytest.mark.parametrize(
    "kind, payload",
    [
        ("extract", {"source": "not a url", "table": "orders"}),
        ("extract", {"source": "sqlite:///x.db", "table": "orders", "chunk_rows": 0}),
        ("extract", {"source": "sqlite:///x.db", "table": "orders", "pause": 60}),
        ("extract", {"source": "sqlite:///x.db", "table": ""}),
        ("preview", {"source": "sqlite:///x.db", "table": "orders", "limit": 10_000}),
        ("discover", {"source": "sqlite:///x.db", "tables": "orders"}),
        ("discover", {"source": "sqlite:///x.db", "colour": "blue"}),
        ("load", {"extract_id": "x", "table": "t", "columns": [{"name": "a", "type": "blob"}]}),
    ],
)
def test_bad_payloads_are_refused_at_submit(pg, broker, pipeline, kind, payload):
    p = pipeline(pg, broker)
    with pytest.raises(InvalidPayload):
        p.leases.submit(kind, payload)
    assert p.leases.store.list_jobs(limit=10) == []
