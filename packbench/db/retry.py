"""Re-running a Store write while the database is briefly unavailable.

A dispatcher's writes survive a short outage: a transient failure (`db.session.is_transient`)
re-runs the whole transaction with backoff; if the database stays down, `DatabaseUnavailable`
says for how long it tried and how to recover. A retried write whose first commit did land
is harmless: the upserts are idempotent, and a claim the caller never saw expires and is
requeued.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from packbench.db.errors import DatabaseLocked, DatabaseUnavailable

# Backoff between tries of a dispatcher write while the database is unavailable: 8 tries
# over about 12.7 s, long enough for a PostgreSQL restart or a pooled connection to be
# replaced, short against a lease of a minute.
RETRY_DELAYS_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)

_T = TypeVar("_T")


def retried(method: Callable[..., _T]) -> Callable[..., _T]:
    """Re-run a one-transaction method of an object with `_retry_delays` (the `Store`) while
    the database is unavailable.

    Only `DatabaseUnavailable` (a broken or refused connection, a server restart, a
    serialization failure) is retried; the rolled-back transaction runs again from the start.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> _T:
        started = time.monotonic()
        delays = self._retry_delays
        for tries, delay in enumerate((*delays, None), start=1):
            try:
                return method(self, *args, **kwargs)
            except DatabaseLocked:
                raise  # SQLite's busy handler has waited its timeout already
            except DatabaseUnavailable as exc:
                if delay is None:
                    failing = time.monotonic() - started
                    raise DatabaseUnavailable(
                        f"{exc}; gave up on {method.__name__} after {tries} tries over "
                        f"{failing:.1f} s. Once the database is back, run the "
                        f"command again: committed records are kept, a screen whose lease "
                        f"expired meanwhile is requeued (see `packbench status`), and "
                        f"`packbench db reconcile` inserts any archived episode that has no row",
                        cause=exc.cause, failing_s=failing,
                    ) from exc
                time.sleep(delay)
        raise AssertionError("unreachable")

    return wrapper
