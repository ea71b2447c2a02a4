"""Flow control: concurrency limits, rate limits, priority and pause, fleet-wide.

* :mod:`.limits` — what ``@leases.job`` declares (plain values, checked at import);
* :mod:`.control` — :class:`FlowControl`: the claim of each delivery, ``release(rows)``
  (every way a job ends calls it), pause and resume, the sweeper's recovery, the view;
* :mod:`.store` — its transactions; :mod:`.statements` — their SQL. The claims
  themselves are the claim family of :mod:`celery_lease.db.statements.claim`.
"""
