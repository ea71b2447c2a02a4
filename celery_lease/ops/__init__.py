"""Operator interfaces: the `celery lease` CLI, the HTTP API, listing, metrics."""
