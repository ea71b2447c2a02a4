"""Declaring a job kind, without services: shared_job on every CeleryLease, Celery task
options refused with what a leased job does instead, and a kind's queue."""

from __future__ import annotations

import re
import warnings

import pytest
from celery import Celery, current_app

from celery_lease import CeleryLease, shared_job


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
