"""pgqueuer, run as its docs suggest: one asyncio process on asyncpg.

Entrypoints must be async; the 1 ms and 10 ms bodies are the same blocking sleeps, moved to a
thread with asyncio.to_thread as pgqueuer's error message advises, at most 2 at a time
(a semaphore) to match Celery's two pool processes. pgqueuer's own per-entrypoint
``concurrency_limit=2`` is not used: with it the worker picks two jobs and then waits
for its 0.1 s poll interval, about 20 jobs/s, which would misrepresent it. Batch size
and the rest are pgqueuer's defaults. Run as ``python -m bench.apps.pgqueuer_app``.
"""

import asyncio
import os
import signal

import asyncpg
from pgqueuer import PgQueuer

from bench.apps import BODIES, SLEEP_SECONDS, body, mark_ready


def dsn(url: str) -> str:
    return url.replace("postgresql+psycopg2://", "postgresql://")


async def main() -> None:
    conn = await asyncpg.connect(dsn(os.environ["BENCH_DB"]))
    pgq = PgQueuer.from_asyncpg_connection(conn)

    threads = asyncio.Semaphore(2)

    def entrypoint(name: str) -> None:
        if not SLEEP_SECONDS[name]:

            @pgq.entrypoint(name)
            async def inline(job):
                body(name)

            return

        @pgq.entrypoint(name)
        async def in_thread(job):
            async with threads:
                await asyncio.to_thread(body, name)

    for name in BODIES:
        entrypoint(name)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, pgq.shutdown.set)
    loop.add_signal_handler(signal.SIGINT, pgq.shutdown.set)
    mark_ready()
    await pgq.run()
    await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
