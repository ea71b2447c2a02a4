"""Service-free rules behind the conversion frictions (issue 20)."""

from __future__ import annotations

from celery import Celery, current_app

from celery_lease import CeleryLease, shared_job
from celery_lease.ops.cli_common import _status


def test_shared_job_registers_on_every_celery_lease_made_before_or_after(tmp_path):
    url = f"sqlite:///{tmp_path / 'unused.sqlite3'}"  # never opened: registration only
    before = CeleryLease(Celery("before", set_as_current=False), url, install_beat=False)

    @shared_job(kind="conv_shared", max_attempts=5)
    def handler(ctx, payload):
        return payload

    after_app = Celery("after")
    after = CeleryLease(after_app, url, install_beat=False)
    assert "conv_shared" in before.kinds and "conv_shared" in after.kinds
    assert before.task_for("conv_shared").spec.max_attempts == 5
    # The name is a proxy for the current app's task.
    previous = current_app._get_current_object()
    after_app.set_current()
    try:
        assert handler.spec.kind == "conv_shared" and handler.app is after_app
    finally:
        previous.set_current()


def test_list_status_takes_celery_state_names_in_any_case():
    assert _status("SUCCESS") == "succeeded" and _status("success") == "succeeded"
    assert _status("FAILURE") == "failed" and _status("REVOKED") == "cancelled" and _status("STARTED") == "running"
    assert _status("Expired") == "expired" and _status(None) is None
    assert _status("done") == "done"  # refused by listing.parse_status, with the known names
