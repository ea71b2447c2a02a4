"""celery_lease.tracing while it is off: nothing of opentelemetry is imported, and with
the API imported but no provider set, no hook does anything."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

SUBMIT_AND_RUN = """
import sys
from celery import Celery
from celery_lease import CeleryLease

app = Celery("t", broker="memory://")
leases = CeleryLease(app, "sqlite:///{db}")
leases.create_schema()

@leases.job(kind="echo")
def echo(ctx, payload):
    return payload

{before}
job = echo.submit_many([{{"n": 1}}, {{"n": 2}}])[0]
assert echo({{"n": 3}}).status.value == "succeeded"  # claimed, run and recorded in-process
from celery_lease import tracing
assert tracing._tracer is None and tracing.carrier() is None and tracing.clock() is None
import sqlite3
traced = "SELECT count(*) FROM celery_lease_jobs WHERE trace_context IS NOT NULL"
assert sqlite3.connect("{db}").execute(traced).fetchone() == (0,)
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""


def run(tmp_path, before: str = "") -> str:
    code = SUBMIT_AND_RUN.format(db=tmp_path / "jobs.db", before=before)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_submit_and_attempt_import_nothing_of_opentelemetry_while_the_app_does_not(tmp_path):
    assert run(tmp_path) == "[]"


def test_with_the_api_imported_but_no_provider_set_nothing_is_traced(tmp_path):
    # (a span made by the application is current: there is still no provider to record ours)
    before = "from opentelemetry import trace\nspan = trace.get_tracer('app').start_span('x')"
    modules = run(tmp_path, before)
    assert "opentelemetry.trace" in modules and "opentelemetry.sdk" not in modules


TRACED = """
import json
from celery import Celery
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from celery_lease import CeleryLease

memory = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(memory))
trace.set_tracer_provider(provider)
app = Celery("t", broker="memory://")
leases = CeleryLease(app, "sqlite:///{db}")
leases.create_schema()

@leases.job(kind="echo")
def echo(ctx, payload):
    return payload

with provider.get_tracer("t").start_as_current_span("caller"):
    echo.submit_many([{{"n": 1}}, {{"n": 2}}])
    echo({{"n": 3}})  # submitted and run here (eager)
print(json.dumps([
    {{"name": s.name, "kind": s.kind.name, "id": s.context.span_id, "parent": s.parent and s.parent.span_id,
      "attributes": dict(s.attributes)}}
    for s in memory.get_finished_spans()
]))
"""


def test_a_submit_on_sqlite_and_an_eager_attempt_are_traced_like_a_workers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", TRACED.format(db=tmp_path / "jobs.db")], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    spans = json.loads(out.stdout)
    (caller,) = [s for s in spans if s["name"] == "caller"]
    producers = [s for s in spans if s["kind"] == "PRODUCER"]
    assert [p["attributes"].get("messaging.batch.message_count") for p in producers] == [2, None]
    assert all(p["parent"] == caller["id"] and p["attributes"]["messaging.system"] == "celery_lease" for p in producers)
    (attempt,) = [s for s in spans if s["kind"] == "CONSUMER"]
    assert attempt["parent"] == producers[1]["id"]
    assert attempt["attributes"]["celery_lease.job_id"] == producers[1]["attributes"]["messaging.message.id"]
    assert attempt["attributes"]["celery_lease.outcome"] == "succeeded"


def test_span_names_and_attributes_are_capped(tmp_path):
    """Before: routing keys and kinds went uncapped into span names and attributes (a
    tracing backend stores each one with every span)."""
    MAX_CHARS = 128  # celery_lease.tracing.MAX_CHARS
    # A routed queue names the spans (submit <queue>, process <queue>): both long.
    code = TRACED.replace('kind="echo"', 'kind="k" * 200, queue="q" * 190').format(db=tmp_path / "jobs.db")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ours = [s for s in json.loads(out.stdout) if s["kind"] in ("PRODUCER", "CONSUMER")]
    assert len(ours) == 3
    for span in ours:
        assert len(span["name"]) <= MAX_CHARS, span["name"]
        assert span["name"].startswith(("submit qqqq", "process qqqq"))
        assert all(len(v) <= MAX_CHARS for v in span["attributes"].values() if isinstance(v, str)), span["attributes"]
        assert span["attributes"]["celery_lease.kind"].startswith("kkkk")
