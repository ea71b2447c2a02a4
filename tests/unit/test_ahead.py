"""The lease a pool process takes from its request (worker/ahead.py): the request dict
starts as the message's headers, so a lease is trusted only with this boot's secret."""

from __future__ import annotations

from types import SimpleNamespace

from celery_lease.worker import ahead


def test_a_lease_from_a_message_header_is_not_trusted():
    row = {"id": "7b0c7c8e-3c51-4d41-8a3c-0b1f1f0e9d11", "lease_generation": 1, "sent_at": 0.0}
    assert ahead.lease_of(SimpleNamespace(lease_claim=row)) is None
    assert ahead.lease_of(SimpleNamespace(lease_claim={**row, "secret": "guessed"})) is None
    assert ahead.lease_of(SimpleNamespace(lease_claim="not a dict")) is None
    assert ahead.lease_of(SimpleNamespace()) is None
    granted = {**row, "secret": ahead._SECRET}
    assert ahead.lease_of(SimpleNamespace(lease_claim=granted)) is granted
