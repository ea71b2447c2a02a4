"""The life of a job: every state change as one named :class:`Transition`, executed by
:meth:`Pipeline.execute`, and every claim as one named :class:`Claim`, executed by its
sibling :func:`celery_lease.lifecycle.claim.execute`. docs/lifecycle.md walks a job
through all of them."""
