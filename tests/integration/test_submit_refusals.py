"""What submit refuses, against real PostgreSQL and Redis: values the job table cannot
hold, bad keys in a submit_many, and errors that describe the input without quoting it
or the driver's text."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
import sqlalchemy as sa

from celery_lease import InvalidPayload
from celery_lease.db.schema import jobs
from celery_lease.payload import Codec

SECRET = "s3cr3t-payload-7731"


def count_jobs(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar()
    finally:
        engine.dispose()


def queued(broker: str) -> int:
    return redis.Redis.from_url(broker).llen("celery")


def _refused(exc: BaseException) -> str:
    """The text a caller's log would show of an exception, cause and context included."""
    parts, seen = [], exc
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return "\n".join(parts)


# --- submit: values the table cannot hold are refused, without echoing the payload -------


@pytest.mark.parametrize(
    "payload, options, says",
    [
        ({"token": SECRET, "x": "a\x00b"}, {}, "payload contains a NUL character"),
        ({"token": SECRET, "k\x00": 1}, {}, "payload contains a NUL character"),
        ({"token": SECRET, "x": "lone \udc80"}, {}, "payload contains a lone surrogate"),
        ({"token": SECRET}, {"idempotency_key": "k" * 5000}, "idempotency_key is 5000 characters, over the limit of 255"),
        ({"token": SECRET}, {"idempotency_key": f"{SECRET}\x00"}, "idempotency_key contains a NUL character"),
        ({"token": SECRET}, {"idempotency_key": SECRET.encode()}, "idempotency_key must be a string, not bytes"),
        ({"token": SECRET}, {"tenant": 42}, "tenant must be a string, not int"),
        ({"token": SECRET}, {"tenant": ["acme"]}, "tenant must be a string, not list"),
        ({"token": SECRET}, {"tenant": "t" * 201}, "tenant is 201 characters, over the limit of 200"),
        ({"token": SECRET}, {"queue": "q" * 201}, "queue is 201 characters, over the limit of 200"),
        ({"token": SECRET}, {"run_id": SECRET}, "run_id must be a UUID"),
        ({"token": SECRET}, {"run_after": float("nan")}, "run_after is out of range"),
        ({"token": SECRET}, {"run_after": 1e300}, "run_after is out of range"),
        (
            {"token": SECRET, "x": json.loads("[" * 400 + "1" + "]" * 400)},
            {},
            "payload nests lists and objects 401 levels deep, over the limit of 100",
        ),
    ],
)
def test_submit_refuses_what_the_table_cannot_hold_without_echoing_it(pg, broker, client_app, payload, options, says):
    """Before: raw driver errors (DataError, ValueError, UnicodeEncodeError) whose text
    held the whole INSERT, payload included, or a ValueError quoting the run id."""
    mod = client_app(pg, broker)
    with pytest.raises(InvalidPayload) as caught:
        mod.echo.submit(payload, **options)
    text = _refused(caught.value)
    assert says in text and SECRET not in text, text
    assert count_jobs(pg) == 0 and queued(broker) == 0


def test_submit_many_refuses_bad_keys_before_storing_any(pg, broker, client_app):
    mod = client_app(pg, broker)
    for keys, says in (
        (["ok", "x" * 256], "idempotency_key is 256 characters"),
        (["ok", None], "idempotency_key must be a string, not NoneType"),
        ("ab", "must be a list of keys"),  # a string would be two keys of one character
    ):
        with pytest.raises(InvalidPayload, match=says):
            mod.echo.submit_many([{}, {}], idempotency_keys=keys)
    assert count_jobs(pg) == 0
    # Ints and UUIDs are spelt as strings, as before.
    key = uuid.uuid4()
    a, b = mod.echo.submit_many([{}, {}], idempotency_keys=[7, key])
    assert (a.idempotency_key, b.idempotency_key) == ("7", str(key))


def test_validation_errors_describe_the_input_without_quoting_it(pg, broker, client_app):
    """pydantic's own text carries ``input_value=...``: the submitted value itself."""
    mod = client_app(pg, broker)
    with pytest.raises(InvalidPayload) as caught:
        mod.typed_pd.submit({"sku": "A-1", "quantity": SECRET})
    text = _refused(caught.value)
    assert "quantity" in text and "integer" in text and SECRET not in text, text
    assert count_jobs(pg) == 0


def test_a_value_the_database_refuses_is_never_reported_with_the_drivers_text(pg, broker, client_app, monkeypatch):
    """The last line of defence: should a value get past the checks, the driver's
    refusal (its text is the whole INSERT) still reaches the caller as InvalidPayload."""
    mod = client_app(pg, broker)
    monkeypatch.setattr(Codec, "dump_payload", lambda self, payload, max_bytes=0: payload)  # no checks at all
    for prepare in (True, False):
        mod.leases.store._prepared = None if not prepare else mod.leases.store._prepared
        with pytest.raises(InvalidPayload) as caught:
            mod.echo.submit({"token": SECRET, "x": "a\x00b"})
        text = _refused(caught.value)
        assert "the job database refused a value of this job" in text and SECRET not in text, text
    assert count_jobs(pg) == 0
