"""What the docs promise, checked against the code: JobContext's reference in
docs/guide.md, and that external side effects may repeat, said where the promise is made."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_lease.worker.context import JobContext

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_member_of_jobcontext_is_documented():
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## What a handler gets (`JobContext`)", 1)[1].split("\n## ", 1)[0]
    public = [name for name in vars(JobContext) if not name.startswith("_")]
    assert "submit" in public and "fencing_token" in public
    for name in public:
        assert f"`ctx.{name}" in section, name
        assert (getattr(JobContext, name).__doc__ or "").strip(), name
    assert "`ctx.staged`" in section  # an instance attribute: not in vars(JobContext)


@pytest.mark.parametrize("page", ["README.md", "docs/coming-from-celery.md", "docs/fencing.md"])
def test_the_docs_say_external_side_effects_may_repeat_where_the_promise_is_made(page):
    text = " ".join((ROOT / page).read_text().split())
    assert "may repeat" in text and "at least once" in text.lower(), page
    # ...with what the receiver uses to make them idempotent.
    assert "`ctx.job_id`" in text and ("idempotency key" in text or "idempotent" in text), page
