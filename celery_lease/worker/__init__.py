"""The worker side: Celery signals around each leased task's body (claim, heartbeat,
run, complete) and warm-shutdown handoff."""
