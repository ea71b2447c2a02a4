"""The tests' app plus handlers that hand ``ctx.fencing_token`` to a second system
(tests/e2e/test_fencing.py; the worked example of docs/fencing.md).

The second system is a Redis hash written only through a compare-and-set script: a
write whose token is lower than the one stored is refused. Each handler waits for the
test to open its gate (a file named ``go-<attempt>``), so the test decides when a stale
holder writes.
"""

from __future__ import annotations

import os
import time

import redis

from celery_lease import JobContext
from tests.apps.app import _marker, app, leases  # noqa: F401  (celery -A finds the app here)

LEASE = int(os.environ.get("CL_TEST_LEASE", "5"))

#: KEYS[1]: the guarded hash; ARGV: fencing token, value. Refuses a token lower than the
#: stored one (a holder may write again with its own token); 1 written, 0 refused.
FENCED_SET = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'token'))
if stored and tonumber(ARGV[1]) < stored then
  return 0
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return 1
"""


def fenced_set(client: redis.Redis, key: str, token: int, value: str) -> bool:
    return bool(client.eval(FENCED_SET, 1, key, token, value))


def _wait_for_gate(payload: dict, attempt: int) -> None:
    gate = os.path.join(payload["marker_dir"], f"go-{attempt}")
    deadline = time.monotonic() + 120
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)


@leases.job(kind="fenced_write", max_attempts=3, lease_seconds=LEASE)
def fenced_write(ctx: JobContext, payload: dict) -> dict:
    """Writes "attempt N" to the guarded hash with its fencing token once its gate opens,
    without checking its lease first (as a handler stalled by a GC pause would)."""
    _marker(payload, f"started-{ctx.attempt}")
    _wait_for_gate(payload, ctx.attempt)
    accepted = fenced_set(redis.Redis.from_url(payload["redis"]), payload["key"], ctx.fencing_token, f"attempt {ctx.attempt}")
    with open(os.path.join(payload["marker_dir"], f"wrote-{ctx.attempt}"), "w") as fh:
        fh.write(f"{ctx.fencing_token} {'accepted' if accepted else 'refused'}\n")
    return {"accepted": accepted}


@leases.job(kind="fence_log", max_attempts=5, lease_seconds=LEASE, retry_backoff=0.1, retry_backoff_max=0.2)
def fence_log(ctx: JobContext, payload: dict) -> dict:
    """Appends "attempt token" to the log at each claim, then (gate open) fails until
    attempt payload["ok_at"]."""
    with open(os.path.join(payload["marker_dir"], "tokens"), "a") as fh:
        fh.write(f"{ctx.attempt} {ctx.fencing_token}\n")
    _wait_for_gate(payload, ctx.attempt)
    if ctx.attempt < payload["ok_at"]:
        raise ConnectionError("not yet")
    return {"token": ctx.fencing_token}
