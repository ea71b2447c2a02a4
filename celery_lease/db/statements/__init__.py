"""The statement catalogue, by subject (the rest is still :mod:`celery_lease.db.queries`)."""
