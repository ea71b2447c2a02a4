"""``python -m bench.lone``: how soon a lone job starts on an idle worker (issue #38:
"a lone job on an idle worker starts as fast as today").

For each system (plain Celery and celery-lease on PostgreSQL, by default), one worker
(prefork ``-c 2``) that has drained a warm-up and gone idle; then ``--n`` times: one
``submit()`` (``.delay()`` for Celery) of a no-op job, waiting until it finished and
0.05 s more, so every job meets an idle worker. The figure is submit-to-start: the
job's start (its row's ``started_at``; Celery's body records its own) minus the
instant before the submit call, by this host's clock, p50 and p90 in milliseconds.
Systems alternate job by job, so drift hits them alike. Output on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench import harness


def main() -> int:
    from bench.run import wait_completed
    from bench.systems import make_systems

    parser = argparse.ArgumentParser(prog="python -m bench.lone")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--systems", default="celery,lease-pg")
    args = parser.parse_args()
    dbs = harness.Databases()
    with tempfile.TemporaryDirectory(prefix="bench-lone-") as tmp:
        servers, workers, systems, outs = [], [], [], {}
        try:
            # A Redis of its own per system: both workers consume the queue "celery".
            for name in args.systems.split(","):
                redis = harness.RedisServer(Path(tmp) / name)
                (Path(tmp) / name).mkdir()
                redis.start()
                servers.append(redis)
                (system,) = make_systems([name], dbs, redis.url, Path(tmp))
                systems.append(system)
                out = outs[system.name] = Path(tmp) / name / "out"
                out.mkdir()
                system.reset(out)
                worker = harness.WorkerProcess(system.worker_args(hold=False), system.env(redis.url, out), out).start()
                workers.append(worker)
                for _ in range(20):  # warm-up: imports, connections, a measured body
                    system.submit_one("noop")
                wait_completed(system, out, 20, 60, print, "warm-up jobs")
            waits: dict[str, list[float]] = {s.name: [] for s in systems}
            for i in range(args.n):
                for system in systems:
                    out = outs[system.name]
                    time.sleep(0.05)
                    before = time.time()
                    system.submit_one("noop")
                    wait_completed(system, out, 21 + i, 30, print, "a lone job")
                    start = max(s for s, _ in system.records(out))
                    waits[system.name].append((start - before) * 1000)
            for system in systems:
                w = sorted(waits[system.name])
                p90 = w[int(0.9 * (len(w) - 1))]
                print(f"{system.label:40} submit-to-start p50 {statistics.median(w):6.2f} ms  p90 {p90:6.2f} ms  (n={len(w)})")
        finally:
            for worker in workers:
                worker.stop()
            for redis in servers:
                redis.stop()
            dbs.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
