"""``celery-lease demo``: the example pipeline (tasks/) end to end, with a worker killed.

What it does, in order:

1. builds a small shop database (tasks/sample.py) as the source, in ``.demo/``;
2. starts real ``celery worker`` processes (prefork) on the job database and broker:
   by default a SQLite file and Celery's filesystem transport, so no server is needed;
3. submits one run: ``test`` the source, ``preview`` a table, ``discover`` its tables,
   which chains an ``extract`` per table, each chaining its ``load``;
4. draws the extracts' progress live; when one is a third done, SIGKILLs the worker
   running it (main process and pool, no warning, as the OOM killer would);
5. plays beat's part itself (reap and sweep twice a second): once the dead worker's
   lease elapses the reaper requeues its jobs and the surviving worker resumes them
   from their last checkpoint;
6. prints every job of the run and checks that each destination table holds exactly
   the source's rows, once.

The lease is 3 s (``--lease-seconds``) instead of the usual minute: a killed worker's
job waits for its lease to elapse before the reaper may requeue it, and nobody wants
to watch a minute of nothing. Heartbeats renew it every second meanwhile.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A worker is killed when one extract it runs is past this share of its table.
KILL_AT = 0.33
#: The source checkout holding the ``tasks`` package.
CHECKOUT = Path(__file__).resolve().parent.parent
#: Seconds between the demo's reap and sweep calls (beat's job in production).
MAINTENANCE_EVERY = 0.5
#: The whole demo gives up after this long.
TIMEOUT = 150.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="celery-lease", description="celery-lease tools")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run the example pipeline end to end, killing a worker mid-extract",
        description=__doc__.split("\n\n")[0],
    )
    demo.add_argument(
        "--database-url", help="job database (default: SQLite file in --dir); e.g. postgresql+psycopg2://user@127.0.0.1/db"
    )
    demo.add_argument(
        "--broker-url", help="Celery broker (default: filesystem transport in --dir); e.g. redis://127.0.0.1:6379/0"
    )
    demo.add_argument("--dir", default=".demo", help="working directory for the demo's files (default: .demo)")
    demo.add_argument("--rows", type=int, default=40_000, help="rows in the source database (default: 40000)")
    demo.add_argument("--workers", type=int, default=2, help="worker processes, 2 or more (default: 2)")
    demo.add_argument("--lease-seconds", type=int, default=3, help="lease of the pipeline's jobs (default: 3)")
    args = parser.parse_args(argv)
    if args.rows < 1000 or args.rows > 5_000_000:
        parser.error("--rows must be from 1000 to 5000000")
    if args.workers < 2:
        parser.error("--workers must be at least 2: one is killed, another resumes its job")
    if not 1 <= args.lease_seconds <= 600:
        parser.error("--lease-seconds must be from 1 to 600")
    try:
        import rich  # noqa: F401
    except ImportError:
        print("celery-lease demo needs rich: pip install 'celery-lease[demo]'", file=sys.stderr)
        return 2
    return Demo(args).run()


@dataclass
class Worker:
    """One `celery worker` subprocess (its own process group, so a kill takes the pool)."""

    node: str
    log_path: Path
    proc: subprocess.Popen | None = None
    killed: bool = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def ready(self) -> bool:
        return "ready." in self.log()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """Warm shutdown, then a kill if it does not come."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Watch:
    """What the live view has already told about each job."""

    bars: dict[str, Any] = field(default_factory=dict)
    told: set[tuple[str, str]] = field(default_factory=set)


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        from rich.console import Console

        self.args = args
        console = Console(highlight=False)
        # Piped output (CI, a log file) gets room for the summary table, not 80 columns.
        self.console = console if console.is_terminal else Console(highlight=False, width=110)
        self.dir = Path(args.dir).resolve()
        self.workers: list[Worker] = []
        self.killed: Worker | None = None
        self.killed_at = 0.0
        self.victims: dict[str, dict] = {}  # job id -> what the killed worker was doing
        self.run_id = str(uuid.uuid4())

    # --- setup -----------------------------------------------------------------------

    def prepare(self) -> dict[str, int]:
        """Fresh files for this run; the environment the workers and this process share."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm", "source.sqlite3"):
            (self.dir / name).unlink(missing_ok=True)
        for name in ("broker", "logs"):
            shutil.rmtree(self.dir / name, ignore_errors=True)
        (self.dir / "logs").mkdir()
        self.database_url = self.args.database_url or f"sqlite:///{self.dir / 'jobs.sqlite3'}"
        self.broker_url = self.args.broker_url or "filesystem://"
        self.source_url = f"sqlite:///{self.dir / 'source.sqlite3'}"
        os.environ.update(
            {
                "CELERY_LEASE_DATABASE_URL": self.database_url,
                "CELERY_BROKER_URL": self.broker_url,
                "TASKS_BROKER_FOLDER": str(self.dir / "broker"),
                "TASKS_LEASE_SECONDS": str(self.args.lease_seconds),
                # The example app is not installed with the library: workers import it
                # from the checkout this module lives in.
                "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")])),
            }
        )
        # Library warnings (reaped leases, ...) go to a file: the screen is the live view.
        logging.basicConfig(
            filename=self.dir / "logs" / "demo.log",
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        from tasks import sample

        return sample.build(self.source_url, rows=self.args.rows)

    def connect(self) -> None:
        """Open the job database (migrating it) and the broker, or say why not."""
        from celery_lease import LeaseError

        try:
            from tasks.app import leases

            # The demo plays beat: re-send a wakeup lost with the killed worker (it had
            # reserved it, unacknowledged work dies with it) after 2 s, not 30 s.
            leases.app.conf.lease_sweep_stale_seconds = 2.0
            leases.create_schema()
        except LeaseError as exc:
            raise DemoError(str(exc)) from None
        self.leases = leases
        try:
            with leases.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=2, interval_start=0.2, interval_step=0.2)
        except Exception as exc:  # kombu raises the transport's own errors
            raise DemoError(f"cannot reach the broker {self.broker_url} ({type(exc).__name__})") from None

    def start_workers(self) -> None:
        for i in range(1, self.args.workers + 1):
            worker = Worker(node=f"w{i}@demo", log_path=self.dir / "logs" / f"w{i}.log")
            with open(worker.log_path, "w") as log:
                worker.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "celery",
                        "-A",
                        "tasks.app",
                        "worker",
                        "-n",
                        worker.node,
                        "-P",
                        "prefork",
                        "-c",
                        "2",
                        "-l",
                        "INFO",
                        "--without-mingle",
                        "--without-gossip",
                        "--without-heartbeat",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.workers.append(worker)
            if self.broker_url.startswith("filesystem"):
                # kombu's filesystem transport creates an exchange's file, then locks it
                # to write it: a worker binding the same exchange in between read it
                # empty and exited (JSONDecodeError). One at a time, each worker finds
                # the files written and takes the lock around its read and write.
                self.wait_for_workers()

    def wait_for_workers(self) -> None:
        deadline = time.monotonic() + 90
        while not all(w.ready for w in self.workers):
            for w in self.workers:
                if w.proc.poll() is not None:
                    raise DemoError(f"worker {w.node} exited; its log ends:\n{w.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise DemoError("workers did not get ready in 90 s; see " + str(self.dir / "logs"))
            time.sleep(0.1)

    # --- the run ---------------------------------------------------------------------

    def run(self) -> int:
        console = self.console
        started = time.monotonic()
        console.rule("[bold]celery-lease demo")
        try:
            counts = self.prepare()
            self.connect()
            self.start_workers()
            from tasks import pipeline

            console.print(f"job database  {self.leases.store.display_url}")
            console.print(
                f"broker        {self.broker_url}"
                + (f"  (files in {self.dir / 'broker'}: no server)" if self.broker_url.startswith("filesystem") else "")
            )
            console.print(
                f"source        {self.source_url}  " + ", ".join(f"{name} {n:,}" for name, n in counts.items()) + " rows"
            )
            console.print(
                f"workers       {', '.join(w.node for w in self.workers)} (prefork, 2 processes each); "
                f"lease {self.args.lease_seconds} s, heartbeat every {self.args.lease_seconds / 3:.1f} s\n"
                "              (a short lease: a dead worker's job is reaped once its lease elapses)"
            )
            with console.status("starting workers..."):
                self.wait_for_workers()
            console.print(f"[green]workers ready[/] after {time.monotonic() - started:.1f} s\n")

            # A pace that makes an extract take a few seconds: long enough to watch,
            # and to kill a worker in the middle of one.
            chunk_rows = max(200, self.args.rows // 80)
            pipeline.check_source.submit({"source": self.source_url}, run_id=self.run_id)
            pipeline.preview.submit({"source": self.source_url, "table": "orders", "limit": 3}, run_id=self.run_id)
            pipeline.discover.submit(
                {"source": self.source_url, "extract": True, "chunk_rows": chunk_rows, "pause": 0.25}, run_id=self.run_id
            )
            jobs = self.watch()
            self.stop_workers()
            ok = self.summary(jobs, counts)
        except DemoError as exc:
            print(f"celery-lease demo: {exc}", file=sys.stderr)
            ok = False
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]")
            ok = False
        finally:
            for w in self.workers:
                w.kill()
        console.print(
            f"\n{'[green]demo passed' if ok else '[red]demo FAILED'}[/] in {time.monotonic() - started:.1f} s"
            f" (worker logs: {self.dir / 'logs'})"
        )
        return 0 if ok else 1

    def watch(self) -> list:
        """Live view until every job of the run is terminal; returns the jobs."""
        from rich.live import Live
        from rich.progress import BarColumn, Progress, TextColumn

        progress = Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(bar_width=36),
            TextColumn("{task.completed:>7,.0f}/{task.total:<7,.0f}"),
            TextColumn("{task.fields[note]}"),
            console=self.console,
        )
        watch = Watch()
        deadline = time.monotonic() + TIMEOUT
        next_maintenance = 0.0
        with Live(progress, console=self.console, refresh_per_second=8, transient=False):
            while True:
                jobs = sorted(self.leases.store.list_jobs(run_id=self.run_id, limit=1000), key=lambda j: j.created_at)
                for job in jobs:
                    self.show(job, progress, watch)
                if self.killed is None:
                    self.maybe_kill(jobs)
                if time.monotonic() >= next_maintenance:
                    next_maintenance = time.monotonic() + MAINTENANCE_EVERY
                    self.maintain(jobs)
                if jobs and all(j.terminal for j in jobs) and any(j.kind == "discover" for j in jobs):
                    return jobs
                if time.monotonic() > deadline:
                    raise DemoError(f"the run did not finish in {TIMEOUT:.0f} s")
                time.sleep(0.15)

    def say(self, watch: Watch, job, what: str, text: str) -> None:
        if (job.id, what) not in watch.told:
            watch.told.add((job.id, what))
            self.console.print(text)

    def show(self, job, progress, watch: Watch) -> None:
        from celery_lease import Status

        name = _label(job)
        if job.kind in ("extract", "load"):
            p = job.progress or {}
            if job.id not in watch.bars:
                watch.bars[job.id] = progress.add_task(name, total=p.get("of") or 1, note="")
            bar = watch.bars[job.id]
            if job.kind == "extract":
                done, total = p.get("rows", 0), p.get("of") or 1
            else:
                total = (job.payload or {}).get("rows") or 1
                done = total if job.status is Status.SUCCEEDED else 0
            note = job.status.value + (f" (attempt {job.attempt})" if job.attempt > 1 else "")
            if job.kind == "extract" and p.get("resumed_from"):
                note += f", resumed at {p['resumed_from']:,}"
            if job.status is Status.RUNNING and job.lease_owner:
                note += f" on {job.lease_owner.split('/')[0]}"
            progress.update(bar, completed=done, total=total, note=note)
        if job.status is Status.SUCCEEDED:
            result = job.result or {}
            if job.kind == "test":
                self.say(
                    watch,
                    job,
                    "done",
                    f"[green]✓[/] test      source answers ({result.get('dialect')}, {result.get('tables')} tables)",
                )
            elif job.kind == "preview":
                rows = result.get("rows", [])
                self.say(
                    watch,
                    job,
                    "done",
                    f"[green]✓[/] preview   {result.get('table')}: "
                    f"{', '.join(result.get('columns', []))}; first row {rows[0] if rows else None}",
                )
            elif job.kind == "discover":
                found = ", ".join(f"{t['table']} ({t['rows']:,})" for t in result.get("tables", []))
                self.say(watch, job, "done", f"[green]✓[/] discover  {found} -> one extract each")
        elif job.terminal:
            self.say(watch, job, "done", f"[red]✗[/] {name} {job.status.value}: {job.error}")
        victim = self.victims.get(job.id)
        if victim is not None and job.status is Status.RUNNING and job.attempt > victim["attempt"]:
            where = job.lease_owner.split("/")[0] if job.lease_owner else "?"
            resumed = (job.progress or {}).get("resumed_from")
            if job.kind == "extract" and resumed is not None:
                self.say(
                    watch,
                    job,
                    "resumed",
                    f"[cyan]▶[/] {name} resumed on {where}, attempt {job.attempt}, from its checkpoint at "
                    f"row {resumed:,} (rows 1..{resumed:,} are not read again)",
                )
            elif job.kind != "extract":
                self.say(watch, job, "resumed", f"[cyan]▶[/] {name} runs again on {where}, attempt {job.attempt}")

    def maybe_kill(self, jobs: list) -> None:
        """SIGKILL the worker running the first extract that is a third done."""
        from celery_lease import Status

        for job in jobs:
            p = job.progress or {}
            if job.kind != "extract" or job.status is not Status.RUNNING or not job.lease_owner:
                continue
            if not p.get("of") or p.get("rows", 0) < KILL_AT * p["of"]:
                continue
            node = job.lease_owner.split("/")[0]
            worker = next((w for w in self.workers if w.node == node), None)
            if worker is None:
                continue
            held = [j for j in jobs if j.status is Status.RUNNING and j.lease_owner and j.lease_owner.startswith(node + "/")]
            worker.kill()
            worker.killed = True
            self.killed_at = time.monotonic()
            self.killed = worker
            self.victims = {j.id: {"attempt": j.attempt, "label": _label(j), "reaped": False} for j in held}
            self.console.print(
                f"[red bold]✗ SIGKILL[/] worker {node} (main pid {worker.proc.pid} and its pool) while "
                f"{_label(job).strip()} was at {p['rows']:,}/{p['of']:,} rows. It was running: "
                + ", ".join(_label(j).strip() for j in held)
                + "."
            )
            self.console.print(
                f"  nobody tells the job table; its lease ({self.args.lease_seconds} s) simply stops being renewed"
            )
            return

    def maintain(self, jobs: list) -> None:
        """What `celery beat` runs in production (every 10 s and 5 s by default)."""
        counts = self.leases.reap()
        if counts.get("requeued") or counts.get("expired"):
            # The killed worker's jobs no longer leased to it: this reap took them back.
            taken = []
            for job_id, victim in self.victims.items():
                owner = self.leases.get(job_id).lease_owner or ""
                if not victim["reaped"] and not owner.startswith(self.killed.node + "/"):
                    victim["reaped"] = True
                    taken.append(victim["label"])
            after = time.monotonic() - self.killed_at if self.killed else 0.0
            self.console.print(
                f"[yellow]⟳ reaper[/]: {after:.1f} s after the kill, lease elapsed -> "
                f"{counts.get('requeued', 0)} requeued, {counts.get('expired', 0)} expired"
                + (f" ({', '.join(taken)})" if taken else "")
            )
        self.leases.sweep()

    def stop_workers(self) -> None:
        for w in self.workers:
            if not w.killed:
                w.stop()

    # --- the end ---------------------------------------------------------------------

    def summary(self, jobs: list, counts: dict[str, int]) -> bool:
        from rich.table import Table

        from celery_lease import Status
        from tasks import warehouse

        table = Table(title=f"run {self.run_id}", title_justify="left")
        for column in ("job", "kind", "table", "status", "attempts", "rows", "resumed from", "lease lost"):
            table.add_column(column, justify="right" if column in ("attempts", "rows", "resumed from") else "left")
        for job in jobs:
            result, payload = job.result or {}, job.payload or {}
            rows = result.get("rows")
            resumed = result.get("resumed_from") if job.kind == "extract" else None
            table.add_row(
                job.id[:8],
                job.kind,
                payload.get("table") or result.get("table") or "",
                ("[green]" if job.status is Status.SUCCEEDED else "[red]") + job.status.value,
                f"{job.attempt}/{job.max_attempts}",
                f"{rows:,}" if isinstance(rows, int) else "",
                f"{resumed:,}" if resumed else ("0" if job.kind == "extract" else ""),
                str(job.lease_losses) if job.lease_losses else "",
            )
        self.console.print()
        self.console.print(table)

        # Exactly once: every source row is in the destination, loaded by this run's
        # load job, once.
        import sqlalchemy as sa

        check = Table(title="destination (in the job database) vs source", title_justify="left")
        for column in ("table", "source rows", "loaded rows", "distinct ids", "exactly once"):
            check.add_column(column, justify="left" if column in ("table", "exactly once") else "right")
        loads = {(j.payload or {}).get("table"): j for j in jobs if j.kind == "load"}
        ok = all(j.status is Status.SUCCEEDED for j in jobs) and set(loads) == set(counts)
        with self.leases.store.durable.connect() as conn:
            for name, expected in counts.items():
                load = loads.get(name)
                loaded = distinct = 0
                if load is not None and load.status is Status.SUCCEEDED:
                    dest = sa.Table(warehouse.destination_name(name), sa.MetaData(), autoload_with=conn)
                    mine = dest.c[warehouse.LOAD_JOB_COLUMN] == load.id
                    loaded = conn.execute(sa.select(sa.func.count()).where(mine)).scalar_one()
                    distinct = conn.execute(sa.select(sa.func.count(sa.distinct(dest.c.id))).where(mine)).scalar_one()
                good = loaded == distinct == expected
                ok = ok and good
                check.add_row(name, f"{expected:,}", f"{loaded:,}", f"{distinct:,}", "[green]yes" if good else "[red]NO")
        self.console.print(check)
        if self.killed is None:
            self.console.print("[red]no worker was killed: the extracts finished before a third of a table[/]")
            return False
        resumed = [j for j in jobs if j.id in self.victims and j.kind == "extract" and (j.result or {}).get("resumed_from")]
        if not resumed:
            self.console.print("[red]no extract resumed from a checkpoint after the kill[/]")
            return False
        return ok


def _label(job) -> str:
    table = (job.payload or {}).get("table")
    return f"{job.kind} {table}" if table else job.kind


class DemoError(Exception):
    """The demo could not run to its end."""


if __name__ == "__main__":
    sys.exit(main())
