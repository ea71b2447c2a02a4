"""procrastinate, run as its docs suggest: one worker process, psycopg 3.

Sync task bodies run in threads (procrastinate's sync_to_async), concurrency 2 to match
Celery's two pool processes. Latency comes from procrastinate_events (started ->
succeeded, database time). The bench runs ``main()`` (what ``procrastinate --app=...
worker --concurrency 2`` does) in its own process, importing this module by name so
the app is not the ``__main__`` module.
"""

import os

import procrastinate

from bench.apps import BODIES, body, mark_ready


def conninfo(url: str) -> str:
    """A libpq URL from a SQLAlchemy one."""
    return url.replace("postgresql+psycopg2://", "postgresql://")


def make_app(db: str):
    """(app, {body: task}) for one database."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo(db)))
    return app, {name: _task(app, name) for name in BODIES}


def _task(app, name: str):
    @app.task(name=name)
    def run():
        body(name)

    return run


app, tasks = make_app(os.environ.get("BENCH_DB", "postgresql:///postgres"))


def main() -> None:
    mark_ready()
    app.run_worker(concurrency=2, install_signal_handlers=True)
