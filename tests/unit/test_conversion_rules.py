"""Service-free rules behind the conversion frictions (issue 20)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
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


@pytest.mark.parametrize(
    ("option", "hint"),
    [
        ({"max_retries": 2}, "max_attempts="),
        ({"bind": True}, "JobContext"),
        ({"autoretry_for": (OSError,)}, "every exception is retried"),
        ({"acks_late": True}, "lease"),
    ],
)
def test_celery_task_options_are_refused_with_what_a_leased_job_does_instead(tmp_path, option, hint):
    leases = CeleryLease(Celery("habits", set_as_current=False), f"sqlite:///{tmp_path / 'unused.sqlite3'}", install_beat=False)
    with pytest.raises(TypeError, match=re.escape(hint)) as refused:
        leases.job(kind="habit", **option)
    assert f"{next(iter(option))}=" in str(refused.value)
    assert "habit" not in leases.kinds
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        leases.job(kind="habit", no_such_option=1)


def test_a_leased_task_on_a_queue_raises_no_celery_deprecation_warning(tmp_path):
    app = Celery("queued", set_as_current=False)
    leases = CeleryLease(app, f"sqlite:///{tmp_path / 'unused.sqlite3'}", install_beat=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        @leases.job(kind="queued", queue="reports")
        def queued(ctx, payload):
            return payload

        app.finalize()
        task = app.tasks[queued.name]
    assert [str(w.message) for w in caught if "task attribute" in str(w.message)] == []
    # The kind's queue is still the task's own, as Celery's router reads it.
    assert task.queue == "reports" and task._get_exec_options()["queue"] == "reports"


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", ["README.md", "docs/coming-from-celery.md", "docs/fencing.md"])
def test_the_docs_say_external_side_effects_may_repeat_where_the_promise_is_made(page):
    text = " ".join((ROOT / page).read_text().split())
    assert "may repeat" in text and "at least once" in text.lower(), page
    # ...with what the receiver uses to make them idempotent.
    assert "`ctx.job_id`" in text and ("idempotency key" in text or "idempotent" in text), page


def test_the_latest_django_migration_brings_the_shipped_job_tables():
    # A release that adds an Alembic revision adds a Django migration too, or
    # `manage.py migrate` would never upgrade the job tables of a Django project.
    from celery_lease.db import migrate

    folder = ROOT / "celery_lease" / "django" / "migrations"
    latest = max(path for path in folder.glob("0*.py"))
    assert f'ALEMBIC_HEAD = "{migrate.head()}"' in latest.read_text(), latest.name
