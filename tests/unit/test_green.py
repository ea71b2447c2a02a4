"""celery_lease.db.green in fresh interpreters: what a gevent / eventlet worker process gets
before any statement runs (worker_init calls cooperate())."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
{patch}
from psycopg2 import extensions
from celery_lease.db import green
before = extensions.get_wait_callback()
print(green.cooperate(), before is None, getattr(extensions.get_wait_callback(), "__module__", None))
"""


def _probe(patch: str) -> list[str]:
    command = [sys.executable, "-W", "ignore", "-c", PROBE.format(patch=patch)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize(
    "patch, expected",
    [
        ("", ["None", "True", "None"]),  # not green: psycopg2 left alone
        # gevent does not patch psycopg2: ours is installed
        ("from gevent import monkey; monkey.patch_all()", ["gevent", "True", "celery_lease.db.green"]),
        # eventlet's monkey_patch() installs its own: kept
        ("import eventlet; eventlet.monkey_patch()", ["eventlet", "False", "eventlet.support.psycopg2_patcher"]),
    ],
)
def test_cooperate_makes_psycopg2_green_only_in_a_green_process(patch, expected):
    assert _probe(patch) == expected


SLEEPS = """
import sys
sys.argv = ["celery", "-A", "tests.apps.app", "worker", "-P", "gevent"]
import celery
celery.maybe_patch_concurrency()  # what `celery worker -P gevent` does first
import time
import kombu.utils.functional as functional
blocking_before = functional.sleep is not time.sleep
from celery_lease.db import green
green.cooperate()
print(blocking_before, functional.sleep is time.sleep)
"""


def test_cooperate_makes_kombus_reconnect_sleep_green():
    """Issue #27 item 6: kombu bound the blocking time.sleep before Celery patched it, and
    Celery's consumer sleeps in it while it reconnects to a lost broker: every greenlet
    of a gevent worker, the heartbeat too, stood still, and leases lapsed."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", SLEEPS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
