"""The stored error of a handler's exception (worker/incident.py): its type and a
reference, and with the operator's opt-in its text, redacted and capped."""

from __future__ import annotations

import re

import pytest

from celery_lease.payload import MAX_ERROR_BYTES
from celery_lease.worker.incident import DETAIL_CHARS, incident, redact


class VendorError(Exception):
    pass


def test_default_names_the_type_and_a_reference_never_the_text():
    found = incident(TimeoutError("read timed out: password=hunter2"))
    assert re.fullmatch(r"internal error: TimeoutError \(ref [0-9a-f]{8}\)", found.error)
    assert found.error.endswith(f"(ref {found.ref})")
    assert "hunter2" not in found.error
    assert incident(VendorError("x")).error.startswith(f"internal error: {__name__}.VendorError (ref ")
    assert incident(ValueError()).ref != incident(ValueError()).ref


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("could not connect to postgresql://app:hunter2@db.internal/shop", "hunter2"),
        ("redis://:hunter2@cache:6379/0 refused", "hunter2"),
        ("host=db user=app password=hunter2 dbname=shop", "hunter2"),
        ("GET /v1?api_key=hunter2&page=2 failed", "hunter2"),
        ("{'client_secret': 'hunter2 with spaces', 'id': 3}", "hunter2 with spaces"),
        ('{"token": "hunter2"}', "hunter2"),
        ("401 for header Authorization: Bearer abcdefhunter2.x-y", "abcdefhunter2"),
        ("sent eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "eyJhbGciOiJIUzI1NiJ9"),
    ],
)
def test_redact_removes_secrets_of_known_shapes(text, secret):
    redacted = redact(text)
    assert secret not in redacted and "***" in redacted


def test_redact_keeps_what_is_not_a_secret():
    text = "duplicate key value violates unique constraint orders_pkey (id)=(42)"
    assert redact(text) == text


def test_opt_in_includes_the_redacted_text_capped():
    found = incident(ValueError("bad row; password=hunter2"), detail=True)
    assert found.error == f"internal error: ValueError: bad row; password=*** (ref {found.ref})"
    long = incident(ValueError("é" * 1000), detail=True).error
    assert long.count("é") == DETAIL_CHARS and re.search(r"\.\.\. \(ref [0-9a-f]{8}\)$", long)
    assert len(long.encode()) <= MAX_ERROR_BYTES
    assert incident(ValueError(), detail=True).error.startswith("internal error: ValueError (ref ")
