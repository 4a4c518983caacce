"""Errors raised by the database layer.

Every message is one line naming the cause and the fix, because the CLI prints `str(error)`
as it is (see `core.errors`). Nothing outside `db/` ever sees a SQLAlchemy or DBAPI exception:
`db.session` translates them into `DatabaseError` in one place.
"""

from packbench.core.errors import PackbenchError


class DatabaseError(PackbenchError):
    """The database cannot be reached, opened, written or understood."""


class DatabaseUnavailable(DatabaseError):
    """The server or the connection failed (not the statement): a retry may succeed.

    `Store` retries the writes a dispatcher makes with backoff before raising it; then its
    message says how long it tried and how to recover, and `cause` is the failure alone (one
    line, without the retry account: what `dispatch --follow` says while it waits).
    """

    def __init__(self, message: str, *, cause: str | None = None, failing_s: float = 0.0) -> None:
        super().__init__(message)
        self.cause = cause or message
        self.failing_s = failing_s  # how long it had been failing when raised (the retries' span)


class DatabaseLocked(DatabaseUnavailable):
    """SQLite stayed locked by another connection for the whole busy timeout.

    Not retried by `Store` (the busy handler has already waited); `dispatch --follow` waits it
    out like any other outage.
    """


class SchemaNotAtHead(DatabaseError):
    """The database schema is not the one this packbench was built for.

    The message names the fix: `packbench db upgrade` for an empty or older database; for a
    database written by a newer packbench (an unknown revision), installing that packbench.
    """


class NotFound(PackbenchError):
    """A screen, attempt or protocol the caller named does not exist."""


class Conflict(PackbenchError):
    """The request contradicts stored state, e.g. finishing an attempt twice.

    Finished attempts are history (failed ones included) and are never overwritten.
    """


class InvalidFilter(PackbenchError, ValueError):
    """A query filter names something that cannot exist (an unknown gate, a malformed date).

    Also a `ValueError`, so library callers can treat it as bad arguments; the message lists
    the allowed values.
    """
