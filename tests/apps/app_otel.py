"""The tests' app with OpenTelemetry on (tests/e2e/test_tracing.py).

Run by workers as ``celery -A tests.apps.app_otel worker`` with CL_TEST_SPANS set: the
process then sets an SDK TracerProvider whose exporter appends one JSON line per ended
span to that file (every pool child appends to the same file, one write per batch).
CL_TEST_OTEL_CELERY=1 also sets up opentelemetry-instrumentation-celery, the way its
documentation says for prefork: in each pool child, at ``worker_process_init``;
CL_TEST_OTEL_CELERY=early sets it up before the app and its CeleryLease exist (so its
signal handlers run before celery-lease's).
Without CL_TEST_SPANS (the test process) it configures nothing: the test sets its own
provider.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from celery import signals
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict:
    """What the tests read of a span, as plain JSON."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": None if span.parent is None else f"{span.parent.span_id:016x}",
        "links": [f"{link.context.span_id:016x}" for link in span.links],
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "pid": os.getpid(),
    }


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with open(self.path, "a") as fh:
            fh.write(text)
        return SpanExportResult.SUCCESS


if os.environ.get("CL_TEST_SPANS"):
    provider = TracerProvider(resource=Resource.create({"service.name": "worker"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ["CL_TEST_SPANS"])))
    trace.set_tracer_provider(provider)

    if os.environ.get("CL_TEST_OTEL_CELERY") == "early":
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument()
    elif os.environ.get("CL_TEST_OTEL_CELERY"):

        @signals.worker_process_init.connect(weak=False)
        def instrument_celery(**_):
            from opentelemetry.instrumentation.celery import CeleryInstrumentor

            CeleryInstrumentor().instrument()


# (After the instrumentation: "early" means before CeleryLease connects its signals.)
from tests.apps.app import app, echo, flaky, leases, parent, steps  # noqa: E402, F401  (celery -A finds the app here)
from tests.apps.app_batch import b_note  # noqa: E402, F401  (a batched kind: batch=4)
