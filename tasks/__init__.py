"""The example application: a small data pipeline run as celery-lease jobs.

``celery -A tasks.app worker`` runs it. Job kinds (tasks/pipeline.py):

=============  ==========================================================================
``test``       check that a source database answers
``discover``   list the tables of a source database; optionally extract each of them
``preview``    the first rows of one table
``extract``    copy a table to the staging area in checkpointed chunks (resumable);
               on success submits its ``load``, atomically with that success
``load``       append the staged rows to the destination table, exactly once
=============  ==========================================================================

The source is any database SQLAlchemy can reach (a URL in the payload). The staging
area and the destination tables live in the job database itself: ``load`` writes
through ``ctx.effect``, inside the transaction that records its success, and that is
only possible on the database that holds the job row (tasks/warehouse.py).
"""
