"""Publishing wakeups: one Celery task message per job, whose task id is the job id.

A wakeup carries no payload (the row has it); losing, duplicating or delaying one
never loses, duplicates or corrupts a job, because the claim decides who runs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery import Celery

#: Short retries: a broker that is down must not hold up submit; the sweeper delivers.
RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


def publish(app: Celery, wakeups: list[tuple[str, str, str | None]]) -> None:
    """Publish (job_id, task name, queue) wakeups; raises when the broker fails.

    Several wakeups go through the producer's batch (kombu >= 5.7), which the Redis
    transport sends as one pipelined round trip per 1000 messages instead of one per
    message. On an error nothing is known to be delivered, so the caller treats every
    wakeup as lost; re-sending one that did arrive is harmless.
    """
    with app.producer_or_acquire() as producer:
        batch = getattr(producer, "batch", None)
        if batch is None or len(wakeups) == 1:
            _send_all(app, producer, wakeups)
            return
        with batch():
            _send_all(app, producer, wakeups)


def _send_all(app: Celery, producer, wakeups: Iterable[tuple[str, str, str | None]]) -> None:
    declared: set[tuple[str, str | None]] = set()
    for job_id, task, queue in wakeups:
        # The first message to a destination declares its queue and binding (the Redis
        # transport routes through them); repeating that per message only costs time.
        options: dict[str, Any] = {} if (task, queue) not in declared else {"declare": []}
        declared.add((task, queue))
        app.send_task(
            task, task_id=job_id, queue=queue, producer=producer, add_to_parent=False, retry_policy=RETRY_POLICY, **options
        )
