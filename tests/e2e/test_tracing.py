"""OpenTelemetry across real processes: the test submits under its own span (an SDK
provider with an in-memory exporter, in this process); `celery worker` processes on
tests.apps.app_otel export their spans as JSON lines to a file. Every attempt's span
must be a child of its submit's span, whatever brought the attempt about: a first
wakeup, a retry, a reap after a SIGKILL, a wakeup the sweeper re-sent from the row."""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict

import pytest
import sqlalchemy as sa

from celery_lease import Status, tracing
from celery_lease.db.schema import jobs
from tests.conftest import wait_for
from tests.e2e.test_faults import pid_in

APP = "tests.apps.app_otel"
#: Short leases, so a killed attempt is reaped within seconds.
ENV = {"CL_TEST_LEASE": "3"}
#: The sweeper re-sends a wakeup not claimed within a second.
CONF = {"lease_sweep_stale_seconds": 1}


class Traces:
    """This process's tracer provider (in-memory exporter) and the workers' span file."""

    def __init__(self, path) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.path = path
        self.memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.memory))
        trace.set_tracer_provider(provider)
        self.tracer = provider.get_tracer("tests")

    def here(self) -> list[dict]:
        from tests.apps.app_otel import span_record

        return [span_record(s) for s in self.memory.get_finished_spans()]

    def workers(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]


@pytest.fixture
def traces(tmp_path):
    """Sets this process's tracer provider for one test, and unsets it after (the API
    takes one provider per process: its globals are reset, and celery-lease's cache)."""
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    yield Traces(tmp_path / "spans.jsonl")
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    tracing._tracer = None


def ours(spans: list[dict], kind: str) -> list[dict]:
    return [s for s in spans if s["kind"] == kind and s["attributes"].get("messaging.system") == tracing.SYSTEM]


def attempts_by_job(spans: list[dict]) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for s in sorted(ours(spans, "CONSUMER"), key=lambda s: s["attributes"]["celery_lease.attempt"]):
        out[s["attributes"]["celery_lease.job_id"]].append(s)
    return out


def wait_done(mod, ids: list[str], timeout: float = 90) -> None:
    def done():
        mod.leases.reap()
        mod.leases.sweep()
        return all(mod.leases.get(i).status is Status.SUCCEEDED for i in ids)

    wait_for(done, timeout=timeout, interval=0.25, what=f"{len(ids)} jobs to succeed")


@pytest.mark.timeout(180)
def test_every_attempt_span_is_a_child_of_its_submit_after_retries_reaps_and_sweeps(
    pg, broker, redis_server, client_app, workers, traces, marker_dir
):
    mod = client_app(pg, broker, conf=CONF, extra_env=ENV, module=APP)
    with traces.tracer.start_as_current_span("caller") as caller:
        lost = mod.echo.submit({"value": "lost"})
        redis_server.flush()  # its wakeup is lost: only the row carries its context now
        flaky = mod.flaky.submit({"ok_at": 2})  # attempt 1 fails, attempt 2 succeeds
        killed = mod.steps.submit({"steps": 20, "sleep": 0.2, "marker_dir": str(marker_dir)})
        batch = mod.echo.submit_many([{"value": i} for i in range(3)])
    w1 = workers(pg, broker, module=APP, conf=CONF, extra_env={**ENV, "CL_TEST_SPANS": str(traces.path)})
    os.kill(pid_in(marker_dir / "start-1-0"), signal.SIGKILL)  # the pool child running it
    wait_done(mod, [lost.id, flaky.id, killed.id, *(j.id for j in batch)])
    assert mod.leases.get(killed.id).attempt >= 2 and "start-1-0" in os.listdir(marker_dir)

    here = traces.here()
    producers = ours(here, "PRODUCER")
    assert len(producers) == 4  # one per submit call: submit_many included
    trace_id = f"{caller.get_span_context().trace_id:032x}"
    caller_id = f"{caller.get_span_context().span_id:016x}"
    assert all(p["trace_id"] == trace_id and p["parent_id"] == caller_id for p in producers)
    single = {p["attributes"]["messaging.message.id"]: p for p in producers if "messaging.message.id" in p["attributes"]}
    assert set(single) == {lost.id, flaky.id, killed.id}
    (many,) = [p for p in producers if "messaging.message.id" not in p["attributes"]]
    assert many["attributes"]["messaging.batch.message_count"] == 3
    for p in producers:
        assert p["attributes"]["messaging.operation.name"] == "submit"
        assert p["attributes"]["messaging.operation.type"] == "send"
        assert p["attributes"]["celery_lease.kind"] in ("echo", "flaky", "steps")
    submit_of = {**{i: s["span_id"] for i, s in single.items()}, **{j.id: many["span_id"] for j in batch}}

    attempts = attempts_by_job(traces.workers())
    assert set(attempts) == set(submit_of)
    for job_id, spans in attempts.items():
        job = mod.leases.get(job_id)
        for s in spans:
            assert s["trace_id"] == trace_id and s["parent_id"] == submit_of[job_id], (job_id, s)
            a = s["attributes"]
            assert a["messaging.operation.name"] == "process" and a["messaging.operation.type"] == "process"
            assert a["messaging.destination.name"] == "celery"
            assert a["messaging.message.id"] == a["celery_lease.job_id"] == job_id
            assert a["celery_lease.kind"] == job.kind
        generations = [s["attributes"]["celery_lease.lease_generation"] for s in spans]
        assert generations == sorted(set(generations))
        assert spans[-1]["attributes"]["celery_lease.attempt"] == job.attempt
        assert spans[-1]["attributes"]["celery_lease.outcome"] == "succeeded"
        assert spans[-1]["attributes"]["celery_lease.lease_generation"] == job.lease_generation
    assert [s["attributes"]["celery_lease.outcome"] for s in attempts[flaky.id]] == ["retried", "succeeded"]
    assert attempts[flaky.id][0]["status"] == "ERROR"
    # The killed attempt's span died with its process; the next one has the submit's parent.
    assert attempts[killed.id][-1]["attributes"]["celery_lease.attempt"] >= 2
    w1.kill()


@pytest.mark.timeout(120)
def test_beside_celerys_instrumentation_no_span_is_duplicated_or_orphaned(pg, broker, client_app, workers, traces):
    """opentelemetry-instrumentation-celery in this process (its apply_async spans) and
    in the workers (its run spans): Celery's spans join the tree instead of starting
    their own, and each attempt has exactly one Celery run span, its child."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    env = {**ENV, "CL_TEST_SPANS": str(traces.path), "CL_TEST_OTEL_CELERY": "1"}
    # A wakeup per job, each the Celery task of its one attempt: the spans of a claim of
    # many (one Celery run span for its delivery's job) are test_every_job_of_a_batch_...'s.
    conf = {**CONF, "lease_coalesce_wakeups": False}
    mod = client_app(pg, broker, conf=conf, extra_env=ENV, module=APP)
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument()
    try:
        workers(pg, broker, module=APP, conf=conf, extra_env=env)
        with traces.tracer.start_as_current_span("caller"):
            one = mod.echo.submit({"value": 1})
            flaky = mod.flaky.submit({"ok_at": 2})
            batch = mod.echo.submit_many([{"value": i} for i in range(2)])
        ids = [one.id, flaky.id, *(j.id for j in batch)]
        wait_done(mod, ids)
        # The last attempt's span ends in task_postrun, just after its success is read back.
        wait_for(lambda: len(ours(traces.workers(), "CONSUMER")) == 5, timeout=20, what="5 attempt spans")
    finally:
        instrumentor.uninstrument()

    spans = traces.here() + traces.workers()
    by_id = {s["span_id"]: s for s in spans}
    orphans = [s for s in spans if s["parent_id"] is not None and s["parent_id"] not in by_id]
    assert orphans == []
    # Roots: the caller's, and Celery's publish of the wakeup the sweeper sent for the
    # retry (the sweeper runs outside any trace; the attempt it woke still joins the
    # submit's trace, through the row).
    roots = [s for s in spans if s["parent_id"] is None]
    assert sorted(r["name"] for r in roots if r["name"] != "caller") == ["apply_async/tests.apps.app.flaky"]
    assert [r["attributes"]["messaging.message.id"] for r in roots if r["name"] != "caller"] == [flaky.id]

    producers = ours(spans, "PRODUCER")
    assert len(producers) == 3
    # Celery's publish spans are the wakeups, each (but the sweeper's) under its submit.
    publishes = [s for s in spans if s["name"].startswith("apply_async/") and s["parent_id"] is not None]
    assert len(publishes) == 4 and all(by_id[s["parent_id"]] in producers for s in publishes)
    # One Celery run span per attempt, the attempt's child: no second span per attempt
    # beside ours, none hanging from the wakeup message.
    attempts = ours(spans, "CONSUMER")
    runs = [s for s in spans if s["name"].startswith("run/")]
    assert len(attempts) == 5  # flaky twice
    assert sorted(by_id[r["parent_id"]]["span_id"] for r in runs) == sorted(a["span_id"] for a in attempts)
    for a in attempts:
        assert by_id[a["parent_id"]] in producers
        assert a["trace_id"] == by_id[a["parent_id"]]["trace_id"]


@pytest.mark.timeout(120)
def test_jobs_submitted_in_a_transaction_by_a_handler_or_by_a_chain_carry_a_context(pg, broker, client_app, workers, traces):
    """A submit inside the caller's transaction stores its span's context like any
    other; a job a handler creates (ctx.submit) or a chain's next step is a child of
    the attempt that created it, in the same trace."""
    from celery import chain

    mod = client_app(pg, broker, module=APP)
    workers(pg, broker, module=APP, extra_env={"CL_TEST_SPANS": str(traces.path)})
    engine = sa.create_engine(pg)
    try:
        with traces.tracer.start_as_current_span("caller") as caller:
            with engine.begin() as conn:
                in_tx = mod.echo.submit({"value": "tx"}, connection=conn)
            parent = mod.parent.submit({"children": [1, 2]})
            first = chain(mod.echo.s({"value": "first"}), mod.echo.s()).apply_async().parent
        with engine.connect() as conn:
            wait_for(lambda: len(ours(traces.workers(), "CONSUMER")) == 6, timeout=60, what="6 attempt spans")
            children = {str(r[0]) for r in conn.execute(sa.select(jobs.c.id).where(jobs.c.parent_id == parent.id))}
    finally:
        engine.dispose()

    producers = {p["attributes"]["messaging.message.id"]: p for p in ours(traces.here(), "PRODUCER")}
    attempts = {s["attributes"]["celery_lease.job_id"]: s for s in ours(traces.workers(), "CONSUMER")}
    assert len(attempts) == 6 and len(children) == 2
    assert {s["trace_id"] for s in attempts.values()} == {f"{caller.get_span_context().trace_id:032x}"}
    assert attempts[in_tx.id]["parent_id"] == producers[in_tx.id]["span_id"]
    assert attempts[parent.id]["parent_id"] == producers[parent.id]["span_id"]
    for child in children:
        assert attempts[child]["parent_id"] == attempts[parent.id]["span_id"]
    (second,) = set(attempts) - children - {in_tx.id, parent.id, first.id}
    assert attempts[first.id]["parent_id"] == producers[first.id]["span_id"]
    assert attempts[second]["parent_id"] == attempts[first.id]["span_id"]


@pytest.mark.timeout(120)
def test_instrumented_before_celery_lease_the_attempt_links_to_celerys_run_span(pg, broker, client_app, workers, traces):
    """Celery's instrumentation set up before CeleryLease(app): its run span exists at
    the claim (a child of the wakeup's publish span). The attempt span stays the
    submit's child and links to Celery's span; still one of each per delivery."""
    env = {**ENV, "CL_TEST_SPANS": str(traces.path), "CL_TEST_OTEL_CELERY": "early"}
    # A wakeup per job, as in test_beside_celerys_instrumentation_...: coalesced, the three
    # could be claimed by two deliveries, so two Celery run spans (seen once, under load).
    conf = {"lease_coalesce_wakeups": False}
    mod = client_app(pg, broker, conf=conf, module=APP)
    workers(pg, broker, module=APP, conf=conf, extra_env=env)
    with traces.tracer.start_as_current_span("caller"):
        jobs_ = mod.echo.submit_many([{"value": i} for i in range(3)])
    wait_done(mod, [j.id for j in jobs_])
    wait_for(lambda: len(ours(traces.workers(), "CONSUMER")) == 3, timeout=20, what="3 attempt spans")

    spans = traces.here() + traces.workers()
    (submit,) = ours(spans, "PRODUCER")
    attempts = ours(spans, "CONSUMER")
    runs = {s["span_id"]: s for s in spans if s["name"].startswith("run/")}
    assert len(runs) == 3
    for a in attempts:
        assert a["parent_id"] == submit["span_id"] and a["trace_id"] == submit["trace_id"]
        (linked,) = a["links"]
        assert linked in runs
    assert sorted(a["links"][0] for a in attempts) == sorted(runs)


@pytest.mark.timeout(120)
def test_every_job_of_a_batch_has_an_attempt_span_of_its_own(pg, broker, client_app, workers, traces):
    """A batched kind (batch=4): one message brings a batch, whose delivery's job gets
    the span task_prerun starts; every other job of it gets its own attempt span too,
    a child of its submit, with its own outcome (worker/many_claim.py)."""
    mod = client_app(pg, broker, module=APP)
    with traces.tracer.start_as_current_span("caller"):
        ids = [j.id for j in mod.b_note.submit_many([{"n": i} for i in range(4)] + [{"nul": True}] + [{"n": 5}] * 3)]
    w1 = workers(pg, broker, module=APP, concurrency=1, extra_env={"CL_TEST_SPANS": str(traces.path)})
    wait_for(
        lambda: all(mod.leases.get(i).status in (Status.SUCCEEDED, Status.FAILED) for i in ids),
        timeout=60,
        interval=0.25,
        what="the batches to end",
    )
    (many,) = ours(traces.here(), "PRODUCER")
    spans = wait_for(
        lambda: (found := attempts_by_job(traces.workers())) and set(found) == set(ids) and found,
        timeout=30,
        interval=0.25,
        what="an attempt span per job",
    )
    assert "claimed a batch of 4" in w1.log()  # (two messages for eight jobs)
    for job_id in ids:
        job = mod.leases.get(job_id)
        (span,) = spans[job_id]
        assert (span["parent_id"], span["trace_id"]) == (many["span_id"], many["trace_id"])
        assert span["attributes"]["celery_lease.lease_generation"] == job.lease_generation
        assert span["attributes"]["celery_lease.outcome"] == ("failed" if job_id == ids[4] else "succeeded")  # (unstorable)
    w1.kill()
