"""``shared_job``: Celery's ``shared_task`` for leased jobs, for reusable apps (a Django
app's ``tasks.py``) that must not import the project's ``CeleryLease``.

``@shared_job(kind=..., **options)`` takes ``@leases.job``'s options. The handler is
registered on every ``CeleryLease`` that exists now and on each one made later; the name
it is bound to is a proxy for the task of the *current* Celery app's ``CeleryLease``
(``task.submit(p)``, ``task.delay(p)``, ``task.s(p)`` as with ``@leases.job``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from celery import current_app
from celery.local import Proxy

#: Every shared job declared in this process: (handler, kind, @leases.job options).
_DECLARED: list[tuple[Callable, str, dict[str, Any]]] = []
#: Every CeleryLease made in this process (each registers the declared jobs).
_INSTANCES: weakref.WeakSet[Any] = weakref.WeakSet()


def shared_job(kind: str | None = None, **options: Any) -> Callable[[Callable], Any]:
    """Declare ``fn(ctx, payload)`` as the handler of ``kind`` (default: its name) for
    every CeleryLease; returns a proxy for the current app's task of that kind."""

    def decorate(fn: Callable) -> Any:
        name = kind or fn.__name__
        _DECLARED.append((fn, name, options))
        for leases in list(_INSTANCES):
            _register(leases, fn, name, options)
        return Proxy(lambda: _current_leases(name).task_for(name))

    return decorate


def attach(leases: Any) -> None:
    """Called by each new CeleryLease: register every shared job declared so far."""
    _INSTANCES.add(leases)
    for fn, name, options in _DECLARED:
        _register(leases, fn, name, options)


def _register(leases: Any, fn: Callable, name: str, options: dict[str, Any]) -> None:
    if name not in leases.kinds:
        leases.job(kind=name, **options)(fn)


def _current_leases(kind: str) -> Any:
    leases = getattr(current_app._get_current_object(), "lease", None)
    if leases is None:
        raise LookupError(f"shared job {kind!r}: the current Celery app has no CeleryLease (create CeleryLease(app))")
    return leases
