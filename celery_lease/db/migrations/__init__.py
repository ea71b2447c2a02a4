"""Alembic environment and revisions of celery-lease's own tables."""
