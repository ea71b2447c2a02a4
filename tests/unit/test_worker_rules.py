"""The worker's rules that need no service: an attempt judges its lease by its own clock;
the worker's threads (one fork-safe skeleton) and the heartbeat's timing; retry backoff;
what signatures and headers a message may carry into a job (worker/message_signatures.py)."""

from __future__ import annotations

import os
import queue
import random
import time
import warnings
from types import SimpleNamespace

import pytest

from celery_lease.worker import message_signatures
from celery_lease.worker.attempt import LAPSE_SHARE, Attempt
from celery_lease.worker.heartbeat import Heartbeat
from celery_lease.worker.outcome import backoff
from celery_lease.worker.runtime import Drainer
from tests.conftest import attempt_for


def _attempt(lease_seconds: int, renewed_ago: float) -> Attempt:
    job_id = "00000000-0000-0000-0000-000000000001"
    return attempt_for(job_id, lease_seconds=lease_seconds, renewed_at=time.monotonic() - renewed_ago)


class _NoStore:
    """A store that must not be reached: a lapsed attempt writes nothing."""

    def guarded(self, *args, **kwargs):
        raise AssertionError("a lapsed attempt reached the database")


def test_an_attempt_with_no_confirmed_renewal_for_most_of_its_lease_is_lost():
    assert not _attempt(10, renewed_ago=10 * LAPSE_SHARE - 1).is_lost
    lapsed = _attempt(10, renewed_ago=10 * LAPSE_SHARE + 0.01)
    assert lapsed.is_lost and lapsed.lost.is_set()


def test_a_lapsed_attempt_writes_nothing():
    lapsed = _attempt(3, renewed_ago=3)
    assert lapsed.write(_NoStore(), object()) is False


def test_the_lapse_counts_from_when_the_claim_was_sent():
    sent_at = time.monotonic() - 2.5
    row = {
        "lease_generation": 1,
        "attempt": 1,
        "max_attempts": 1,
        "lease_seconds": 3,
        "run_id": None,
        "parent_id": None,
        "tenant": None,
        "payload": {},
        "checkpoint": None,
    }
    assert Attempt.from_claim("j", row, sent_at=sent_at).is_lost
    assert not Attempt.from_claim("j", row).is_lost


def test_each_claiming_thread_owns_its_leases_under_its_own_name_and_the_process_is_known():
    """A threads pool's threads claim at once; a lost claim reply adopts the row under
    its own thread's owner (worker/executor.py), and a dead process's owners are all
    found by their pid (worker/dead_processes.py)."""
    import os
    import threading

    from celery_lease.lifecycle.owner import BOOT_ID, owner_of, owner_pid

    main = owner_of("w@h")
    assert main == f"w@h/{os.getpid()}/{BOOT_ID}"
    seen: list[str] = []
    threads = [threading.Thread(target=lambda: seen.extend([owner_of("w@h"), owner_of("w@h")])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 3 and all(seen[i] == seen[i + 1] for i in range(0, 6, 2))  # one name a thread
    assert {owner_pid(o) for o in [main, *seen]} == {os.getpid()}
    assert owner_pid("no-owner") is None and owner_pid("w/x.1/b") is None


# --- the worker's threads: one fork-safe skeleton (worker/runtime.py) --------------------


class _Echo(Drainer):
    """Hands each batch to ``drained``; a batch holding "boom" fails."""

    def __init__(self) -> None:
        super().__init__("celery-lease-test-echo")
        self.queued: list[str] = []
        self.drained: queue.Queue[list[str]] = queue.Queue()

    def submit(self, *items: str) -> None:
        with self._cond:
            self._start()
            self.queued.extend(items)
            self._cond.notify()

    def _next(self):
        batch, self.queued = self.queued, []
        return batch or None, None

    def _drain(self, batch):
        self.drained.put(batch)
        if "boom" in batch:
            raise RuntimeError("boom")


def test_a_worker_thread_outlives_a_failing_round():
    echo = _Echo()
    echo.submit("boom")
    assert echo.drained.get(timeout=5) == ["boom"]
    echo.submit("after")
    assert echo.drained.get(timeout=5) == ["after"]


def test_a_forked_child_starts_its_own_worker_thread():
    """Celery's prefork pool forks children after the parent may have started the
    thread; it does not survive fork, so the child's first submit starts another."""
    echo = _Echo()
    echo.submit("parent")
    assert echo.drained.get(timeout=5) == ["parent"] and echo.running
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: report by exit code, never return into pytest
        code = 1
        try:
            if not echo.running:
                echo.submit("child")
                code = 0 if echo.drained.get(timeout=5) == ["child"] and echo.running else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    echo.submit("parent again")  # the parent's thread still drains
    assert echo.drained.get(timeout=5) == ["parent again"]


class _Renewals:
    """A store whose renewals hold every lease and are timed."""

    def __init__(self) -> None:
        self.at: list[float] = []

    def renew(self, leases):
        self.at.append(time.monotonic())
        return {key: True for key in leases}


def test_an_arriving_attempt_only_re_times_the_heartbeat_and_a_wake_renews_at_once():
    store = _Renewals()
    heartbeat = Heartbeat(store, None)  # type: ignore[arg-type]
    long = _attempt(lease_seconds=300, renewed_ago=0)
    heartbeat.add(long)
    time.sleep(0.3)
    assert store.at == []  # due in 100 s: a renewal right after the claim is wasted
    woken = time.monotonic()
    heartbeat.wake()  # a cancel notice: renew now
    deadline = time.monotonic() + 5
    while not store.at and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.at and store.at[0] - woken < 1.0
    added = time.monotonic()
    short = attempt_for("00000000-0000-0000-0000-000000000002", lease_seconds=3, renewed_at=added)
    heartbeat.add(short)  # due in 1 s, far sooner than the loop's own wake-up: re-timed
    while short.renewed_at == added and time.monotonic() < added + 10:
        time.sleep(0.01)
    assert 0.9 < short.renewed_at - added < 2.4 and not short.is_lost
    heartbeat.remove(long)
    heartbeat.remove(short)


@pytest.mark.parametrize("attempt", [1, 2, 5, 30])
def test_backoff_grows_is_capped_and_jittered(attempt):
    random.seed(attempt)
    base, cap = 1.0, 60.0
    delays = [backoff(attempt, base, cap) for _ in range(200)]
    nominal = min(cap, base * 2 ** (attempt - 1))
    assert all(0.5 * nominal <= d <= 1.5 * nominal for d in delays)
    assert len(set(delays)) > 1


def _leased(name) -> bool:
    return name == "leased"


def test_leased_signatures_a_message_carries_lose_tenant_and_run():
    sig = {"task": "leased", "args": [], "kwargs": {}, "options": {"tenant": "victim", "run_id": "r", "priority": 3}}
    plain = {"task": "plain", "options": {"tenant": "kept"}}
    group = {"task": "celery.group", "options": {}, "kwargs": {"tasks": [dict(sig, options=dict(sig["options"]))]}}
    chain = [dict(sig, options=dict(sig["options"])), group]
    request = SimpleNamespace(chain=chain, callbacks=[plain], errbacks=None, chord=None)
    assert message_signatures.scrub(request, _leased) == 4
    assert request.chain[0]["options"] == {"priority": 3}
    assert request.chain[1]["kwargs"]["tasks"][0]["options"] == {"priority": 3}
    assert request.callbacks == [plain] and plain["options"] == {"tenant": "kept"}  # not a leased task


def test_signatures_nested_past_the_limit_are_dropped():
    deep: dict = {"task": "leased", "options": {"tenant": "victim"}}
    for _ in range(message_signatures.MAX_DEPTH + 5):
        deep = {"task": "celery.chain", "options": {}, "kwargs": {"tasks": [deep]}}
    request = SimpleNamespace(chain=[deep], callbacks=None, errbacks=None, chord=None)
    message_signatures.scrub(request, _leased)
    assert request.chain is None  # Celery applies nothing


@pytest.mark.parametrize("value", [12345, ["a"], {"a": 1}, "x" * 300, "line\nbreak", b"bytes"])
def test_a_lineage_header_must_be_a_task_id(value):
    assert "root_id" in message_signatures.malformed_lineage(SimpleNamespace(root_id=value, parent_id=None, group=None))
    assert message_signatures.malformed_lineage(SimpleNamespace(root_id="9f1c...-uuid", parent_id=None, group=None)) is None
