"""``python -m bench profile``: where a celery-lease pool child spends its time per job.

Starts a celery-lease (PostgreSQL) worker as in the side-by-side run, submits no-op
(or ``--body``) jobs from this process one at a time (the end-to-end phase), and
records one pool child with py-spy (``--idle``, so waiting counts: apart from its
background threads, shown apart, the child is single-threaded, so its wall time per
job is what throughput pays). Each sampled stack is put in the first category whose
rule matches, leaf first; the summary divides each category's time by the jobs that child completed in the window
(half of all completed: completed rows no longer name their owner).
Writes results/profile.txt (py-spy's raw collapsed stacks) and profile.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench import harness
from bench.systems import Lease

RATE = 500  # samples per second

# (category, regex on a frame "function (path:line)"): a stack goes to the first rule
# any of its frames matches, so a lease moment owns its time even inside Celery's trace.
M = r"^(?:[\w<>]+\.)*"  # py-spy names frames by qualified name: "Heartbeat._loop (path:line)"
RULES = [
    # Every background thread runs a Drainer's loop (worker/runtime.py) or the cancel notice's.
    ("background thread", r"(Drainer\._run \(.*celery_lease/worker/runtime|_listen \(.*celery_lease/broker/cancel_notice)\.py"),
    (
        "claim (its statement, and the wakeup mark around it)",
        M + r"(begin|_claim|_next_claim|_claim_again|claim_many) \(.*celery_lease/(worker|lifecycle)/(executor|many_claim)\.py",
    ),
    (
        "completion (complete statement / batch flush)",
        M + r"(_succeed|_complete\w*|complete\w*|flush\w*|end|release) \(.*celery_lease/",
    ),
    ("publish (wakeups)", M + r"publish_wakeups "),
    ("handler body + JobContext", r"bench/apps/|celery_lease/worker/context\.py"),
    ("Celery trace (task accounting, signals)", r"celery/app/trace\.py"),
    ("pool IPC: waiting for / reading the next message, sending the result", r"billiard/"),
]
_RULES = [(cat, re.compile(rx)) for cat, rx in RULES]


#: The worker's background threads, told apart by what their loop calls.
THREADS = {
    "completer thread": re.compile(r"celery_lease/worker/completion\.py"),
    "heartbeat thread": re.compile(r"celery_lease/worker/heartbeat\.py"),
    "cancel-notice thread": re.compile(r"celery_lease/broker/cancel_notice\.py"),
    # A Drainer waiting for work shows only its loop: which one it is cannot be told.
    "idle background thread": re.compile(r"."),
}


def categorize(stack: list[str]) -> str:
    for category, rx in _RULES:
        for frame in stack:
            if rx.search(frame):
                if category == "background thread":
                    return next(t for t, trx in THREADS.items() if any(trx.search(f) for f in stack))
                return category
    return "other"


def db_split(stack: list[str]) -> str:
    """Within a lease category: in the driver (round trip + server), in SQLAlchemy, in Redis,
    a holder's pause, or else."""
    joined = ";".join(stack)
    if "psycopg2" in joined or "do_execute" in joined or "do_commit" in joined or "_rollback_impl" in joined:
        return "driver round trip"
    # Prepared statements call the driver's cursor.execute (C code, invisible to py-spy)
    # straight from Prepared.execute: a sample whose innermost frame is that function is
    # waiting in the driver.
    if stack and "(celery_lease/db/prepared.py" in stack[-1] and "Prepared." in stack[-1]:
        return "driver round trip"
    if "sqlalchemy" in joined:
        return "SQLAlchemy (compile, pool, result)"
    if "/redis/" in joined or "redis_direct.py" in joined:
        return "Redis round trip (wakeup mark or push)"
    # time.sleep is C: a holder's pause for submits to gather (HOLD_PAUSE_SECONDS) is
    # sampled in _next_claim itself.
    if stack and stack[-1].startswith("ManyJobClaims._next_claim ("):
        return "pause for submits to gather (holding the mark)"
    return "Python"


def main(args, log) -> int:
    if shutil.which("py-spy") is None and not Path(sys.executable).with_name("py-spy").exists():
        log("py-spy is not installed: pip install py-spy")
        return 2
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    dbs = harness.Databases()
    with tempfile.TemporaryDirectory(prefix="celery-lease-profile-") as tmp:
        out = Path(tmp)
        redis = harness.RedisServer(out)
        redis.start()
        worker = None
        try:
            system = Lease("lease-pg", "celery-lease (PostgreSQL)", dbs.create("profile"), redis.url, True)
            worker = harness.WorkerProcess(system.worker_args(), system.env(redis.url, out), out).start()
            child = worker.children()[0]
            raw = args.results / "profile.txt"
            args.results.mkdir(parents=True, exist_ok=True)
            stop = threading.Event()

            def submit():
                for _ in range(args.n):
                    if stop.is_set():
                        return
                    system.submit_one(args.body)

            submitter = threading.Thread(target=submit, daemon=True)
            submitter.start()
            time.sleep(1.0)  # the e2e run is under way
            before = _completed(system)
            log(f"recording pool child {child} for {args.duration}s")
            subprocess.run(
                [
                    pyspy,
                    "record",
                    "--pid",
                    str(child),
                    "--duration",
                    str(args.duration),
                    "--rate",
                    str(RATE),
                    "--idle",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                ],
                check=True,
                capture_output=True,
            )
            # Completed rows no longer name their owner: the child's share is half the
            # jobs the two pool children completed in the window.
            jobs = (_completed(system) - before) // 2
            stop.set()
            submitter.join()
        finally:
            if worker is not None:
                worker.stop()
            redis.stop()
            dbs.close()
    table = summarize(raw, jobs, args.duration)
    (args.results / "profile.md").write_text(table)
    print(table)
    return 0


def _completed(system: Lease) -> int:
    return system.completed(Path("."))


#: The splits db_split gives to time spent in SQLAlchemy or the driver.
_DATABASE = ("driver round trip", "SQLAlchemy (compile, pool, result)")


def summarize(raw: Path, jobs: int, duration: float) -> str:
    by_cat: Counter = Counter()
    by_split: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text:
            continue
        stack = stack_text.split(";")
        n = int(count)
        total += n
        cat = categorize(stack)
        by_cat[cat] += n
        if cat.startswith(("claim", "completion", "heartbeat", "completer", "cancel", "publish")):
            by_split[(cat, db_split(stack))] += n
    # The background threads are sampled beside the main thread (mostly waiting): their
    # samples are shown apart and not counted in the child's wall time.
    threads = {name: by_cat.pop(name, 0) for name in THREADS}
    main = total - sum(threads.values())
    seconds = main / RATE
    per_job = 1e6 / RATE / max(jobs, 1)
    lines = [
        f"py-spy, one pool child, main thread {seconds:.1f}s sampled at {RATE} Hz (idle included), "
        f"{jobs} jobs completed by it in {duration}s: {per_job * main:,.0f} µs of wall time per job.",
        "",
        "| where (main thread) | µs per job | share |",
        "|---|---:|---:|",
    ]
    for cat, n in by_cat.most_common():
        lines.append(f"| {cat} | {per_job * n:,.0f} | {100 * n / main:.0f}% |")
        for (c, split), m in sorted(by_split.items(), key=lambda kv: -kv[1]):
            if c == cat:
                lines.append(f"| &nbsp;&nbsp;↳ {split} | {per_job * m:,.0f} | {100 * m / main:.0f}% |")
    lines.append("")
    for name, samples in threads.items():
        busy = sum(m for (c, split), m in by_split.items() if c == name and split in _DATABASE)
        lines.append(f"{name}: {samples} samples, {busy} of them in SQLAlchemy or the driver ({per_job * busy:,.1f} µs per job).")
    return "\n".join(lines) + "\n"
