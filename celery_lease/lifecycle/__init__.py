"""The life of a job: every state change as one named :class:`Transition`, executed by
:meth:`Pipeline.execute`. docs/lifecycle.md walks a job through all of them."""
