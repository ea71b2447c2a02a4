"""The statement catalogue: every SQL statement celery-lease runs, each named after what
it does, one module per subject:

* :mod:`.common`: the database's clock, the guards and column sets statements share;
* :mod:`.submit`: inserting jobs (idempotency keys, retried inserts), their wakeups, runs;
* :mod:`.claim`: pending -> running, every form of claim;
* :mod:`.attempt`: lease renewal and an attempt's fenced writes (checkpoint, progress,
  success, failure, retry, handoff, snooze);
* :mod:`.cancel`, :mod:`.maintenance` (reap, restart recovery, sweep, prune),
  :mod:`.lost`: revoking and the beat's work;
* :mod:`.events`: the run event log; :mod:`.canvas`: chords and results;
* :mod:`.reads`, :mod:`.metrics`, :mod:`.dashboard`: reads;
* :mod:`.landing`: a transaction's fate after a lost reply.

* :mod:`.flow`: flow control (limits, pauses, held jobs, rate windows);
  :mod:`.fair`: fair share's order keys and tenants' weights.

Statements are SQLAlchemy Core constructs with bound parameters; statuses come from
:class:`Status`. Each state transition is exactly one guarded statement:

* writes of an attempt (progress, checkpoint, success, failure, retry, handoff) match
  ``id``, ``status = 'running'`` and the ``lease_generation`` the attempt claimed;
  zero rows means the lease is lost and the caller discards the write;
* revoking statements (cancel, reap, recovery) bump ``lease_generation``, so any
  attempt still running holds a stale token from that moment on; like the claims,
  they are marked durable (celery_lease.db.durability);
* nothing ever matches a terminal status, so a finished job never changes again.

Statements with no arguments are built once (``functools.cache``): a construct is
immutable, and building one costs more Python time than running it on a warm
connection.

Time is the database's clock (``now()`` on PostgreSQL), so lease expiry does not
depend on the clocks of the worker and beat hosts agreeing.
"""
