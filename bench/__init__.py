"""Side-by-side benchmarks of celery-lease against plain Celery, procrastinate and
pgqueuer (``python -m bench``; see bench/README.md)."""
