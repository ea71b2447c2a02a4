"""What goes through Celery's broker: never the truth (the job row is), only its shortcuts.

* :mod:`.routing` — the queue a job belongs to, resolved once at submit;
* :mod:`.wakeups` — one wakeup message per job (:mod:`.redis_direct`: straight to
  kombu's Redis lists); :mod:`.waking` — coalesced wakeups; :mod:`.resends` — which of
  the sweeper's re-sends are published;
* :mod:`.cancel_notice` — faster cancel notices (:mod:`.notice_amqp` on RabbitMQ).
"""
