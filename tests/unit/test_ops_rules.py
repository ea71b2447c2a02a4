"""ops without services: listing cursors and status names, what the API's statements read
and show, what the operator's terminal is shown."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from celery_lease.db.statements import events, reads
from celery_lease.ops import listing
from celery_lease.ops.cli_common import _status, printable
from celery_lease.status import Event


def test_cursor_round_trip_and_malformed_cursors():
    job = SimpleNamespace(
        created_at=datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc), id="6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"
    )
    token = listing.encode_cursor(job)  # type: ignore[arg-type]
    assert listing.decode_cursor(token) == (job.created_at, job.id)
    assert listing.decode_cursor(None) is None
    for bad in ("!!!", "e30", "bm90IGpzb24"):
        with pytest.raises(ValueError):
            listing.decode_cursor(bad)


ID = "6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"


# --- the API reads only what it shows ----------------------------------------------------


def _selected(stmt) -> list[str]:
    return [c.name for c in stmt.selected_columns]


def test_the_api_statements_read_only_the_columns_it_shows():
    # One job's route shows its attempts too (the worker of each: a node name, no pid).
    assert _selected(reads.get_job_view(ID)) == [*listing.API_FIELDS, "attempts"]
    summaries = reads.list_job_summaries(max_value_bytes=1024, tenant="acme", limit=10)
    assert set(_selected(summaries)) == set(listing.API_FIELDS) | {"result_bytes", "progress_bytes"}
    for stmt in (reads.get_job_view(ID, tenant="acme"), summaries):
        assert not {"payload", "checkpoint", "lease_owner"} & set(_selected(stmt))
    # The tenant is in the WHERE clause of a get: another tenant's job reads like a missing one.
    where = str(reads.get_job_view(ID, tenant="acme").whereclause)
    assert "celery_lease_jobs_all.tenant = " in where and "celery_lease_jobs_all.id = " in where
    assert "tenant" not in str(reads.get_job_view(ID).whereclause)


def test_views_and_tenant_events_on_sqlite(store, add_job):
    run = str(uuid.uuid4())
    mine = add_job(tenant="acme", run_id=run, payload={"secret": 1})
    theirs = add_job(tenant="globex", run_id=run)
    view = store.get_view(mine, tenant="acme")
    assert view is not None and set(view) == {*listing.API_FIELDS, "attempts"} and view["created_at"].tzinfo is not None
    assert store.get_view(theirs, tenant="acme") is None and store.get_view(theirs) is not None
    assert store.run_visible(run, tenant="acme") and not store.run_visible(run, tenant="initech")
    with store.durable.begin() as conn:
        for job in (theirs, mine, theirs, mine):
            conn.execute(events.append_events(), [events.event_row(run, job, Event.CLAIMED, 1, "host/1/boot")])
    seqs = [(e["seq"], e["job_id"]) for e in store.tenant_run_events(run, "acme")]
    assert seqs == [(1, mine), (2, mine)]
    assert [e["seq"] for e in store.tenant_run_events(run, "acme", after_seq=1)] == [2]


def test_cursors_are_read_in_utc():
    def cursor(created: str) -> str:
        return listing.encode_cursor({"created_at": datetime.fromisoformat(created), "id": ID})

    created, _ = listing.decode_cursor(cursor("2026-01-01T14:00:00+02:00"))
    assert created == datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc) and created.utcoffset().total_seconds() == 0
    import base64

    for text in ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"):
        token = base64.urlsafe_b64encode(json.dumps([text, ID]).encode()).decode().rstrip("=")
        with pytest.raises(ValueError, match="malformed cursor"):
            listing.decode_cursor(token)


# --- the terminal, and credentials ---------------------------------------------------------


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable("ok é 😀 \\ path") == "ok é 😀 \\ path"
    assert printable("\x1b[2J\x07\r\n\t\x9b\u202e\u2066\ud800") == "\\x1b[2J\\x07\\r\\n\\t\\x9b\\u202e\\u2066\\ud800"


def test_api_fields_match_the_view_columns():
    assert [c.name for c in reads.VIEW_COLUMNS] == list(listing.API_FIELDS)
    assert isinstance(reads.run_visible(ID), sa.Select)


def test_list_status_takes_celery_state_names_in_any_case():
    assert _status("SUCCESS") == "succeeded" and _status("success") == "succeeded"
    assert _status("FAILURE") == "failed" and _status("REVOKED") == "cancelled" and _status("STARTED") == "running"
    assert _status("Expired") == "expired" and _status(None) is None
    assert _status("done") == "done"  # refused by listing.parse_status, with the known names
