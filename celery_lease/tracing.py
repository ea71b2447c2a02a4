"""OpenTelemetry traces of submits and attempts (optional: the ``otel`` extra; docs/tracing.md).

Active only once the application has imported ``opentelemetry`` and set a tracer provider
(an SDK's, not the API's no-op default); until then every hook costs one dict lookup and
celery-lease imports nothing of opentelemetry. A PRODUCER span per ``submit`` /
``submit_many`` (``submit <queue>``) stores its context in the job row's
``trace_context``; a CONSUMER span per attempt (``process <queue>``, claim to outcome) is
its child. The rule: the row, not the wakeup, carries the context, so every attempt of a
job is a child of the submit that created it, and a job a handler creates carries its
attempt's context. Beside ``opentelemetry-instrumentation-celery``, Celery's ``run/<task>``
span is made a child of the attempt span (or linked to it, if it already existed).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

#: ``messaging.system`` of our spans. Celery's instrumentation says "celery" for the
#: wakeup messages; ours describe the jobs, whose queue is the job table.
SYSTEM = "celery_lease"


class Attempt(Protocol):
    """What a span reads of an attempt (worker/attempt.py), and its ``span`` slot."""

    job_id: str
    kind: str
    queue: str | None
    attempt: int
    max_attempts: int
    generation: int
    trace_context: Any
    outcome: Any
    lost: Any  # a threading.Event
    span: Any


_NULL: contextlib.nullcontext[None] = contextlib.nullcontext()
_tracer: Any = None


def _active() -> Any:
    """The tracer, or None while no tracer provider is set (or opentelemetry was
    never imported): then nothing is traced and nothing is imported."""
    global _tracer
    if _tracer is not None:
        return _tracer
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    from importlib.metadata import version

    # A provider, once set, is the process's for good (the API refuses another).
    _tracer = provider.get_tracer("celery_lease", version("celery-lease"))
    return _tracer


def _w3c() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def carrier() -> str | None:
    """The current trace context as a job row stores it (JSON of the W3C
    ``traceparent`` / ``tracestate`` headers), or None (tracing off, no span)."""
    if _active() is None:
        return None
    headers: dict[str, str] = {}
    _w3c().inject(headers)
    return json.dumps(headers, separators=(",", ":")) if headers else None


def clock() -> int | None:
    """The start time of an attempt span about to begin with a claim; None when off."""
    return time.time_ns() if _active() is not None else None


#: Characters of a span name or string attribute at most: queue names and kinds come
#: from routing keys and submitters, and a tracing backend stores every one per span.
MAX_CHARS = 128


def _capped(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def _bounded(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: _capped(v) if isinstance(v, str) else v for k, v in attributes.items()}


@contextlib.contextmanager
def _producing(tracer: Any, kind: str | None, queue: str | None, ids: Sequence[str]) -> Iterator[str | None]:
    from opentelemetry.trace import SpanKind

    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "submit",
        "messaging.operation.type": "send",
    }
    if queue is not None:
        attributes["messaging.destination.name"] = queue
    if kind is not None:
        attributes["celery_lease.kind"] = kind
    if len(ids) == 1:
        attributes["messaging.message.id"] = attributes["celery_lease.job_id"] = ids[0]
    else:  # the conventions set the count for a batch only
        attributes["messaging.batch.message_count"] = len(ids)
    name = _capped(f"submit {queue or kind}")
    with tracer.start_as_current_span(name, kind=SpanKind.PRODUCER, attributes=_bounded(attributes)):
        yield carrier()


def producing(wanted: Sequence[tuple[str, str, Any]], columns: Sequence[dict[str, Any]]) -> contextlib.AbstractContextManager:
    """The PRODUCER span of one submit, current while it runs; yields the context to
    store with its jobs (None when off). ``wanted``: (job id, kind, key) of each job;
    ``columns``: the column values they are inserted with (a ``queue`` in each)."""
    tracer = _active()
    if tracer is None:
        return _NULL
    kinds = {kind for _, kind, _ in wanted}
    queues = {values["queue"] for values in columns}
    ids = [job_id for job_id, _, _ in wanted]
    return _producing(tracer, next(iter(kinds)) if len(kinds) == 1 else None, queues.pop() if len(queues) == 1 else None, ids)


def start_attempt(attempt: Attempt, queue: str | None, started: int, request: Any) -> None:
    """Starts the CONSUMER span of a claimed attempt (``attempt.span``), child of the
    context stored with its job, at ``started`` (just before the claim). Its context is
    also written into Celery's ``request``, so Celery's instrumentation, whose
    ``task_prerun`` handler runs after ours, makes its span a child of this one."""
    tracer = _active()
    if tracer is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind

    stored = attempt.trace_context
    parent = _w3c().extract(json.loads(stored)) if stored else None
    current = trace.get_current_span().get_span_context()
    # A span already current here is Celery's (instrumented before our signals).
    links = [Link(current)] if current.is_valid else None
    destination = attempt.queue or queue
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.message.id": attempt.job_id,
        "celery_lease.job_id": attempt.job_id,
        "celery_lease.kind": attempt.kind,
        "celery_lease.attempt": attempt.attempt,
        "celery_lease.lease_generation": attempt.generation,
    }
    if destination is not None:
        attributes["messaging.destination.name"] = destination
    span = attempt.span = tracer.start_span(
        _capped(f"process {destination or attempt.kind}"),
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=_bounded(attributes),
        links=links,
        start_time=started,
    )
    if request is not None:
        headers: dict[str, str] = {}
        _w3c().inject(headers, context=trace.set_span_in_context(span))
        for name, value in headers.items():
            setattr(request, name, value)


def current(attempt: Attempt) -> contextlib.AbstractContextManager:
    """Makes the attempt's span current while its handler runs and its outcome is
    written: the handler's own spans and the jobs it creates are its children."""
    if attempt.span is None:
        return _NULL
    from opentelemetry import trace

    return trace.use_span(attempt.span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def end_attempt(attempt: Attempt) -> None:
    """Ends the attempt's span with its outcome (``celery_lease.outcome``)."""
    span = attempt.span
    if span is None:
        return
    attempt.span = None
    from opentelemetry.trace import Status, StatusCode

    outcome = attempt.outcome
    if outcome is None:
        name = "lease_lost" if attempt.lost.is_set() else "not_recorded"
    elif outcome.value == "error":
        name = "retried" if attempt.attempt < attempt.max_attempts else "failed"
    else:
        name = outcome.value
    span.set_attribute("celery_lease.outcome", name)
    if name in ("failed", "retried", "lease_lost"):
        span.set_status(Status(StatusCode.ERROR, name))
    span.end()
