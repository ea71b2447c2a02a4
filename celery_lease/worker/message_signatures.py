"""What a delivered message carries besides its task: signatures (its chain, callbacks,
errbacks and chord) and lineage headers.

Celery applies those signatures after the task's body, with the options the message gave
them; for a leased job those include ``tenant=`` and ``run_id=``, which decide which API
tokens see the job and which run it joins. The rule: a tenant is ours, not the broker's,
so a leased job created from a signature a message carries inherits its tenant and run from
the job that created it, never from the message. A wakeup carries no signatures at all
(refused before the claim; a leased job's canvas lives in its row), so what remains is a
plain task's message: :func:`scrub` removes its signatures' ``tenant`` and ``run_id``.
Code that calls ``apply_async(tenant=...)`` itself is the shop's code and is honoured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_lease.job import parse_job_id

#: Options of a leased signature that must come from the job that created it.
INHERITED = ("tenant", "run_id")
#: Signatures nest (a chain in a group in a chord): deeper than this, nothing is kept.
MAX_DEPTH = 32

_FIELDS = ("chain", "callbacks", "errbacks", "chord")
#: Headers the children of a job inherit from its wakeup (Celery's task lineage).
LINEAGE_HEADERS = ("root_id", "parent_id", "group")
#: Longer than any task id Celery makes (a UUID is 36).
MAX_HEADER_CHARS = 255


def malformed_lineage(request: Any) -> str | None:
    """Why a lineage header of ``request`` is not a task id, or None. They are handed on
    to the wakeups of the children the job creates: a wakeup with a malformed one is
    refused before its claim."""
    for header in LINEAGE_HEADERS:
        value = getattr(request, header, None)
        if value is not None and not (isinstance(value, str) and len(value) <= MAX_HEADER_CHARS and value.isprintable()):
            return f"its {header} header is not a task id"
    return None


def scrub(request: Any, leased: Callable[[Any], bool]) -> int:
    """Remove INHERITED options from every leased signature ``request`` carries
    (``leased(task_name)`` tells); returns how many signatures were changed. A nesting
    deeper than MAX_DEPTH drops the signatures (Celery then applies none)."""
    changed = 0
    for field in _FIELDS:
        value = getattr(request, field, None)
        if value:
            try:
                changed += _walk(value, leased, 0)
            except RecursionError:
                setattr(request, field, None)
    return changed


def _walk(value: Any, leased: Callable[[Any], bool], depth: int) -> int:
    if depth > MAX_DEPTH:
        raise RecursionError("signatures nested too deeply")
    changed = 0
    if isinstance(value, dict):
        options = value.get("options")
        if isinstance(options, dict) and leased(value.get("task")):
            for name in INHERITED:
                if options.pop(name, None) is not None:
                    changed += 1
        for item in value.values():
            if isinstance(item, (dict, list)):
                changed += _walk(item, leased, depth + 1)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                changed += _walk(item, leased, depth + 1)
    return changed


def wakeup_refusal(request: Any) -> str | None:
    """Why the delivery ``request`` (a task's context) is not a wakeup celery-lease
    sent, or None.

    A wakeup is untrusted input (anything that can write to the broker can send
    one), so it is checked before the claim: a malformed one claims nothing, runs
    nothing and spends no attempt. Whether the job belongs to this task is
    checked by the claim itself (it matches the job's task).
    """
    if request.args or request.kwargs:
        return "it carries arguments (a wakeup has none: the job row holds the payload)"
    if request.callbacks or request.errbacks or request.chain or request.chord:
        # Celery would apply these with the job's result: a forged wakeup could send
        # one job's result to any task. A leased job's canvas lives in its row.
        return "it carries callbacks (a leased job's chain and links live in its row)"
    try:
        parse_job_id(request.id)
    except ValueError:
        return "its task id is not a job id"
    return malformed_lineage(request)
