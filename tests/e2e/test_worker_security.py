"""Issue 19, worker side: forged chains, signed messages, malformed headers and hostile
cancel notices, sent to real `celery worker` processes with real PostgreSQL and a
private Redis. The broker is inside Celery's trust boundary (docs/operations.md,
"Security model"); these tests pin down what a message from it can still not do.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
import sqlalchemy as sa

from celery_lease import Status
from celery_lease.db.schema import jobs
from tests.conftest import ROOT, _env, wait_for

APP = "tests.apps.app_unstorable"
ECHO = "tests.apps.app.echo"
PARENT = "tests.apps.app.parent"


def _rows(db: str) -> list[dict]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(jobs).order_by(jobs.c.created_at)).mappings()]
    finally:
        engine.dispose()


# --- signed messages (task_serializer = "auth") ------------------------------------------


def _signing_dir(path: Path) -> Path:
    """A private key, its self-signed certificate and a store trusting it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    (path / "store").mkdir(parents=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "celery-lease-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    (path / "key.pem").write_bytes(private)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (path / "cert.pem").write_bytes(pem)
    (path / "store" / "cert.pem").write_bytes(pem)
    return path


def _queued(broker: str, queue: str = "celery") -> list[dict]:
    client = redis.Redis.from_url(broker)
    try:
        return [json.loads(m) for m in client.lrange(queue, 0, -1)]
    finally:
        client.close()


def test_signed_apps_keep_every_wakeup_signed(pg, broker, workers, tmp_path):
    """With task_serializer="auth" a worker accepts only signed messages. The direct
    Redis wakeups reuse one body per route, serialized (so signed: Celery's signature
    covers the body, not the headers) by the app's serializer; every wakeup, the
    submitter's and those of the children a job creates in the worker, must be one the
    worker verifies."""
    keys = _signing_dir(tmp_path / "keys")
    extra = {"CL_TEST_SIGNING_DIR": str(keys)}
    script = (
        "from tests.apps.app_signed import echo, parent\n"
        "print(echo.submit({'value': 7}).id)\n"
        "print(parent.submit({'children': [1, 2]}).id)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=_env(pg, broker, extra=extra), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    echo_id, parent_id = out.stdout.split()
    queued = _queued(broker)
    assert {m["headers"]["id"] for m in queued} == {echo_id, parent_id}
    assert {m["content-type"] for m in queued} == {"application/data"}  # the auth serializer's

    w = workers(pg, broker, module="tests.apps.app_signed", extra_env=extra)

    def finished() -> list[dict]:
        rows = _rows(pg)
        return rows if len(rows) == 4 and all(r["status"] == "succeeded" for r in rows) else []

    rows = wait_for(finished, timeout=60, what="the signed jobs and the children they created to succeed")
    assert {r["id"] for r in rows} >= {echo_id, parent_id}
    assert "ContentDisallowed" not in w.log() and "SecurityError" not in w.log(), w.log()[-3000:]


# --- forged chains (finding 2) -----------------------------------------------------------

SEC_APP = "tests.apps.app_security"


def test_a_refused_beat_tick_stops_the_chain_it_carries(pg, broker, client_app, workers):
    """Before, beat_submit returned normally when it refused a tick, so Celery applied
    the chain the forged message carried: an echo job for tenant "victim" in any run."""
    mod = client_app(pg, broker, module=SEC_APP)
    w = workers(pg, broker, module=SEC_APP, concurrency=1)
    stolen = mod.app.signature(ECHO, args=({"value": "forged"},), options={"tenant": "victim", "priority": 9})
    # Refused for its entry name; then a well-formed, current tick that carries a chain.
    mod.app.send_task("celery_lease.beat_submit", args=("no-such-entry", time.time()), chain=[dict(stolen)])
    mod.app.send_task("celery_lease.beat_submit", args=("bnd-tick", time.time()), link=stolen)
    mod.app.send_task("celery_lease.beat_submit", args=("bnd-tick", time.time()), chain=[dict(stolen)])
    wait_for(lambda: w.log().count("refused: ") >= 3, timeout=30, what="the three ticks refused")
    # A chain applied would have created its job before the next message (one worker
    # process takes them in order); a real tick still submits its slot.
    mod.app.send_task("celery_lease.beat_submit", args=("bnd-tick", time.time()))
    wait_for(lambda: "'key': 'beat:bnd-tick:" in w.log(), timeout=30, what="a real tick to be submitted")
    rows = _rows(pg)
    assert [(r["kind"], r["tenant"], r["idempotency_key"][:14]) for r in rows] == [("echo", None, "beat:bnd-tick:")], rows


def test_leased_jobs_from_a_plain_tasks_message_take_no_tenant_or_run_from_it(pg, broker, client_app, workers):
    """A plain task's message may carry leased signatures (its chain, its callbacks):
    before, the job they created took tenant= and run_id= from the message."""
    mod = client_app(pg, broker, module=SEC_APP)
    workers(pg, broker, module=SEC_APP, concurrency=1)
    options = {"tenant": "victim", "run_id": str(uuid.uuid4())}
    chained = mod.app.signature(ECHO, options=options)  # receives the plain task's result
    linked = mod.app.signature(ECHO, args=({"value": "linked"},), options=options, immutable=True)
    grouped = {"task": "celery.group", "subtask_type": "group", "args": [], "kwargs": {"tasks": [dict(linked)]}, "options": {}}
    mod.app.send_task("tests.plain_pass", args=({"value": "chained"},), chain=[dict(chained)], link=[linked, grouped])

    def three() -> list[dict]:
        rows = _rows(pg)
        return rows if len(rows) == 3 and all(r["status"] == "succeeded" for r in rows) else []

    rows = wait_for(three, timeout=60, what="the three leased jobs the message's signatures create")
    assert sorted(r["result"]["echo"] for r in rows) == ["chained", "linked", "linked"]
    assert {(r["tenant"], r["run_id"]) for r in rows} == {(None, None)}
    # The shop's own code still sets a tenant: a submit (or apply_async) is honoured.
    job = mod.echo.submit({"value": 1}, tenant="acme")
    assert mod.leases.wait(job.id, timeout=30).status is Status.SUCCEEDED
    assert [r["tenant"] for r in _rows(pg) if r["id"] == job.id] == ["acme"]


# --- malformed headers (finding 11) ------------------------------------------------------


def test_a_wakeup_with_a_malformed_root_id_is_refused_and_breaks_nothing(pg, broker, client_app, workers, make_job):
    """Before, a non-string root_id reached the children's wakeups: building them raised
    AttributeError after the parent's success, so its children waited for the sweeper."""
    mod = client_app(pg, broker, module=SEC_APP)
    w = workers(pg, broker, module=SEC_APP)
    job = make_job(pg, kind="parent", task=PARENT, payload={"children": [1, 2]}, woken_at=sa.func.now())
    for root in (12345, ["a", "list"], {"a": "dict"}, "x" * 1000):
        mod.app.send_task(PARENT, task_id=job, root_id=root)
    wait_for(lambda: w.log().count("refused before the claim") >= 4, timeout=30, what="four refusals")
    assert [(r["status"], r["attempt"]) for r in _rows(pg)] == [("pending", 0)]
    mod.app.send_task(PARENT, task_id=job)
    # A plain task's headers are not checked, but a malformed root_id is not handed on:
    # the wakeup of the leased job its chain creates goes out.
    mod.app.send_task("tests.plain_pass", args=({"value": "chained"},), root_id=12345, chain=[dict(mod.app.signature(ECHO))])

    def done() -> list[dict]:
        rows = _rows(pg)
        return rows if len(rows) == 4 and all(r["status"] == "succeeded" for r in rows) else []

    # No beat runs here: a wakeup that was not sent would wait for a sweep forever.
    wait_for(done, timeout=30, what="the parent, its children and the chained job to succeed")
    assert "AttributeError" not in w.log() and "Traceback" not in w.log(), w.log()[-3000:]


# --- hostile cancel notices (finding 7) --------------------------------------------------


def test_the_cancel_notice_listener_outlives_hostile_notices(pg, broker, client_app, workers, marker_dir):
    """Before, a 4 KB notice of nested brackets raised RecursionError in every worker's
    listener thread, which died: from then on a cancel reached a running handler only
    at its next heartbeat (here 10 s). After hostile notices, a real cancel still
    reaches the handler within a couple of seconds."""
    from celery_lease.broker import cancel_notice

    mod = client_app(pg, broker, module=SEC_APP)
    w = workers(pg, broker, module=SEC_APP, concurrency=1)
    job = mod.until_cancelled.submit({"marker_dir": str(marker_dir)}).id
    wait_for(lambda: (marker_dir / f"started-{job}").exists(), timeout=30, what="the handler to start")
    hostile = [
        b"[" * 2000 + b"]" * 2000,  # nested past the JSON parser's recursion limit
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
        os.urandom(4096),  # not UTF-8
        b"\xff\xfe" + "[\u202e]".encode("utf-16-le"),
        b"[" + b'"00000000-0000-4000-8000-000000000000",' * 2000 + b"0]",
        b"x" * (8 * 1024 * 1024),  # far over the size limit
        json.dumps([job] * 5).encode() + b"garbage",
    ]
    client = redis.Redis.from_url(broker)
    try:
        name = cancel_notice.channel(broker, mod.app.main)
        for notice in hostile:
            assert client.publish(name, notice) >= 1  # the worker's listener is subscribed
    finally:
        client.close()
    cancelled_at = time.time()
    assert mod.leases.cancel(job)
    noticed = wait_for(lambda: (marker_dir / f"noticed-{job}").exists(), timeout=30, what="the handler to notice the cancel")
    assert noticed
    delay = float((marker_dir / f"noticed-{job}").read_text()) - cancelled_at
    assert delay < 3.0, f"the cancel took {delay:.1f}s to reach the handler (the heartbeat's 10 s, not the notice)"
    assert "RecursionError" not in w.log(), w.log()[-3000:]


# --- the maintenance queue -----------------------------------------------------------------


def test_an_undecodable_message_on_the_maintenance_queue_is_dropped(pg, broker, client_app, workers, make_job):
    """Found with finding 2 (signed messages): before, a message the app does not accept
    (pickle here; an unsigned one under task_serializer="auth") raised in the maintenance
    consumer, which reconnected and got the same unacked message back first, for ever:
    no reap, sweep or prune ran again on that worker."""
    from kombu import Connection, Exchange, Producer, Queue

    mod = client_app(pg, broker, module=SEC_APP)
    w = workers(pg, broker, module=SEC_APP)
    queue = Queue("celery_lease", Exchange("celery_lease"), routing_key="celery_lease")
    with Connection(broker) as conn:
        producer = Producer(conn)
        producer.publish({"x": 1}, serializer="pickle", exchange=queue.exchange, routing_key="celery_lease", declare=[queue])
    wait_for(lambda: "undecodable message" in w.log() or "reconnecting" in w.log(), timeout=30, what="the message consumed")
    # A lease that elapsed: only a reap tick (no beat runs here) takes it back.
    job = make_job(
        pg, status="running", attempt=1, lease_owner="gone@host/1/boot", lease_expires_at=sa.text("now() - interval '1 minute'")
    )
    mod.app.send_task("celery_lease.reap", queue="celery_lease")
    wait_for(lambda: _rows(pg)[0]["status"] != "running", timeout=30, what="a reap tick to run after it")
    assert [r["id"] for r in _rows(pg)] == [job]
    assert "reconnecting" not in w.log()
