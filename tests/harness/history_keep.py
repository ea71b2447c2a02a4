"""What a failed history run leaves behind to be diagnosed: in
test-artifacts/<name>/ (git-ignored), the workers' and beat's logs, the checker's
report, every op of the run, and the full rows, run events and Redis queue lengths
that tell why a job did not end (held? due later? a wakeup still queued? leased to a
dead owner?). Best effort: a part that cannot be read is noted, never raised."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tests.harness.history import History

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _rows(result) -> list[dict[str, Any]]:
    return [{k: _jsonable(v) for k, v in row.items()} for row in result.mappings()]


def _database(jobs_url: str) -> dict[str, Any]:
    """The jobs that did not end (every column), their run events, and the flow tables."""
    engine = sa.create_engine(jobs_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            open_sql = "SELECT * FROM celery_lease_jobs WHERE status IN ('pending', 'running') ORDER BY created_at"
            open_jobs = _rows(conn.execute(sa.text(open_sql)))
            ids = [row["id"] for row in open_jobs]
            events = _rows(
                conn.execute(
                    sa.text("SELECT * FROM celery_lease_events WHERE CAST(job_id AS text) = ANY(:ids) ORDER BY id"),
                    {"ids": ids},
                )
            )
            out = {"open_jobs": open_jobs, "open_job_events": events}
            for table in ("celery_lease_limits", "celery_lease_pauses"):
                out[table] = _rows(conn.execute(sa.text(f"SELECT * FROM {table}")))
            out["now"] = str(conn.execute(sa.text("SELECT now()")).scalar())
            return out
    finally:
        engine.dispose()


def _queues(redis_url: str) -> dict[str, Any]:
    """Per key its type (a hash: its size), and per queue (list) the messages still in
    it: task, job id, Celery's ``origin`` header (``gen<pid>@host``: a worker's pool
    children publish under their main process's) and eta. Many copies of one pending
    job's wakeup in a queue are the sweeper's re-sends piling up behind a backlog."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        out: dict[str, Any] = {}
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            if kind != b"list":
                out[key.decode()] = kind.decode() if kind != b"hash" else {"hash": client.hlen(key)}
                continue
            messages = []
            for raw in client.lrange(key, 0, -1):
                try:
                    headers = json.loads(raw).get("headers", {})
                    messages.append([headers.get("task"), headers.get("id"), headers.get("origin"), headers.get("eta")])
                except ValueError:
                    messages.append(["?", None, None, None])
            out[key.decode()] = {"length": len(messages), "messages": messages}
        return out
    finally:
        client.close()


def keep(name: str, workdir: Path, jobs_url: str, h: History | None, report: str | None, redis_url: str) -> Path:
    target = ARTIFACTS / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for log in sorted(workdir.glob("*.log")):
        shutil.copy(log, target / log.name)
    if report:
        (target / "violations.txt").write_text(report + "\n")
    if h is not None:
        ops = [{"at": op.at, "op": op.op, "job_id": op.job_id, **{k: _jsonable(v) for k, v in op.detail.items()}} for op in h.ops]
        (target / "ops.json").write_text(json.dumps(ops, indent=1))
    for what, read in (("database", lambda: _database(jobs_url)), ("redis", lambda: _queues(redis_url))):
        try:
            data = read()
        except Exception as exc:  # a failed run may have left a service down: keep the rest
            data = {"unreadable": repr(exc)}
        (target / f"{what}.json").write_text(json.dumps(data, indent=1, default=str))
        if what == "redis":
            (target / "backlog.txt").write_text(backlog(data) + "\n")
    return target


def backlog(queues: dict[str, Any]) -> str:
    """One line per queue left with messages: how many, for how many distinct jobs, and
    the most copies of one job's wakeup."""
    lines = []
    for name, value in sorted(queues.items()):
        if isinstance(value, dict) and value.get("messages"):
            copies = Counter(m[1] for m in value["messages"])
            most = copies.most_common(1)[0][1]
            lines.append(f"{name}: {value['length']} messages left, {len(copies)} distinct jobs, up to {most} copies of one")
    return "\n".join(lines) or "no messages left in any queue"
