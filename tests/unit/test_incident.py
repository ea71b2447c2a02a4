"""The stored error of a handler's exception (worker/incident.py): its type and a
reference, and with the operator's opt-in its text, redacted and capped."""

from __future__ import annotations

import re
import subprocess
import sys

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


# Shapes on which a backtracking pattern rescans the same run from every start: each
# would take the old patterns minutes to hours at a megabyte.
ADVERSARIAL = ("a", "pass", "a.", "eyJ-", "a=", "a   ", "a://", "eyJa.", "token ", "pass: 'x")


def timed_in_child(code: str, *args: str) -> dict[str, float]:
    """Run ``code`` in a child process, which prints "<name> <seconds>" lines. In a
    child because a stuck regex holds the GIL: only a kill ends it."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import sys, time\n" + code, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"did not finish; done so far: {exc.stdout!r}")
    return {name: float(seconds) for name, seconds in (line.rsplit(" ", 1) for line in done.stdout.splitlines())}


def test_redact_takes_linear_time_on_adversarial_text():
    # Linear, not a wall-clock bound: four times the text takes about four times as long
    # (a backtracking pattern takes 16 times or more). Each size's best of two runs, in
    # one child, so a slow or busy machine slows both alike.
    took = timed_in_child(
        "from celery_lease.worker.incident import redact\n"
        "for unit in sys.argv[1:]:\n"
        "    best = []\n"
        "    for size in (100_000, 400_000):\n"
        "        text = (unit * (size // len(unit) + 1))[:size]\n"
        "        runs = []\n"
        "        for _ in range(2):\n"
        "            start = time.perf_counter()\n"
        "            redact(text)\n"
        "            runs.append(time.perf_counter() - start)\n"
        "        best.append(min(runs))\n"
        "    print(unit, best[1] / best[0], flush=True)\n",
        *ADVERSARIAL,
    )
    assert set(took) == set(ADVERSARIAL)
    assert all(ratio < 8 for ratio in took.values()), took


def test_opt_in_cuts_a_long_message_before_redacting_it_and_keeps_a_straddling_secret_out():
    took = timed_in_child(
        "from celery_lease.worker.incident import incident\n"
        "start = time.perf_counter()\n"
        "error = incident(ValueError('pass' * 250_000), detail=True).error\n"
        "assert '... (ref ' in error, error\n"
        "print('incident', time.perf_counter() - start)\n"
    )
    assert took["incident"] < 1
    # The userinfo starts before the cap and its "@" lies past it.
    straddling = "x" * 170 + " postgresql://app:hunter2hunter2@db/shop" + "y" * 5000
    shown = incident(ValueError(straddling), detail=True).error
    assert "hunter" not in shown and "***" in shown
