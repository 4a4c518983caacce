"""Engines, sessions and the one place where database exceptions become `DatabaseError`.

Backends: SQLite (the embedded default, one file) and PostgreSQL through psycopg 3 (the
cluster database). Anything else is refused up front, because only these two are tested.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    NoSuchModuleError,
    SQLAlchemyError,
)
from sqlalchemy.orm import Session

from db.errors import DatabaseError, SchemaNotAtHead

ENV_VAR = "PACKBENCH_DB_URL"
DEFAULT_URL = "sqlite:///packbench.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 10

_URL_HINT = "use sqlite:///path/to/packbench.db or postgresql+psycopg://user@host:5432/dbname"


def default_url() -> str:
    """The database URL to use when none is given: `$PACKBENCH_DB_URL`, else `sqlite:///packbench.db`."""
    return os.environ.get(ENV_VAR) or DEFAULT_URL


def make_engine(url: str | None = None) -> Engine:
    """Create an engine for `url` (default: `default_url()`) without connecting yet.

    Raises `DatabaseError` for a URL that cannot be parsed, a backend other than SQLite or
    PostgreSQL, or a missing driver. Connection problems surface on first use, translated by
    `session_scope` / `translate_errors`.
    """
    parsed = _parse(url if url is not None else default_url())
    backend = parsed.get_backend_name()
    try:
        if backend == "sqlite":
            engine = create_engine(parsed)
            _configure_sqlite(engine)
        else:
            connect_args = {}
            if "connect_timeout" not in parsed.query:
                # Without it an unroutable host hangs for minutes before the error appears.
                connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
            # pre_ping: a cluster database restarts; a stale pooled connection should be
            # replaced silently instead of failing the next worker write.
            engine = create_engine(parsed, connect_args=connect_args, pool_pre_ping=True)
    except (NoSuchModuleError, ImportError) as exc:
        raise DatabaseError(
            f"the database driver for {parsed.drivername!r} is not installed ({_first_line(exc)}); "
            f"{_URL_HINT}"
        ) from exc
    return engine


def _parse(text: str) -> URL:
    try:
        parsed = make_url(text)
    except ArgumentError as exc:
        raise DatabaseError(
            f"cannot parse database URL {_redact(text)!r}; set {ENV_VAR}: {_URL_HINT}"
        ) from exc
    if parsed.drivername in ("postgresql", "postgres"):
        # A bare postgresql:// would make SQLAlchemy look for psycopg2, which packbench does
        # not depend on; psycopg 3 is the driver it ships with.
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseError(
            f"unsupported database URL scheme {parsed.drivername!r}; set {ENV_VAR}: {_URL_HINT}"
        )
    return parsed


def _configure_sqlite(engine: Engine) -> None:
    """Per-connection SQLite settings packbench relies on.

    - busy_timeout: concurrent writers wait (up to 30 s) for the lock instead of failing.
    - foreign_keys: SQLite ignores FOREIGN KEY clauses unless asked, per connection.
    - WAL: readers never block the writer and vice versa; the setting persists in the file.
    - BEGIN IMMEDIATE: sqlite3's own transaction handling starts transactions lazily and
      not at all for SELECT, so a transaction that reads then writes can hit SQLITE_BUSY
      without the busy handler ever waiting (a stale WAL snapshot cannot be upgraded).
      Taking the write lock at BEGIN makes every transaction wait its turn and keeps
      read-then-write sequences (e.g. attempt numbering) serializable. Transactions here
      are short, so the serialization costs little.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, see below
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA journal_mode = WAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:  # type: ignore[no-untyped-def]
        connection.exec_driver_sql("BEGIN IMMEDIATE")


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any exception.

    Database exceptions leave as `DatabaseError` (one line, cause and fix); other exceptions
    (e.g. `NotFound`, `ValueError`) propagate unchanged after the rollback. Objects stay
    readable after commit (`expire_on_commit=False`) so they can be turned into records.
    """
    with translate_errors(engine.url):
        with Session(engine, expire_on_commit=False) as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise


@contextmanager
def translate_errors(url: URL) -> Iterator[None]:
    """Turn SQLAlchemy exceptions (which wrap DBAPI ones) raised inside the block into
    `DatabaseError`; any other exception passes through unchanged."""
    try:
        yield
    except DatabaseError:
        raise
    except SQLAlchemyError as exc:
        raise translate(exc, url) from exc


def translate(exc: BaseException, url: URL) -> DatabaseError:
    """Map a database exception to a one-line `DatabaseError` naming the cause and the fix."""
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    detail = _first_line(orig)
    lowered = detail.lower()
    rules: list[tuple[tuple[str, ...], str]]  # (substrings that must all occur, message)
    if url.get_backend_name() == "sqlite":
        where = f"sqlite database {url.database or ':memory:'}"
        rules = [
            (("unable to open database file",),
             f"cannot open {where} (unable to open database file); create its directory, "
             f"fix its permissions or set {ENV_VAR}"),
            (("readonly database",),
             f"{where} is read-only ({detail}); make the file and its directory writable "
             f"or set {ENV_VAR}"),
            (("database is locked",),
             f"{where} stayed locked by another writer for {SQLITE_BUSY_TIMEOUT_MS // 1000} s; "
             f"retry, or use PostgreSQL for many concurrent writers"),
            (("file is not a database",),
             f"{url.database} is not a SQLite database; point {ENV_VAR} at a packbench database"),
            (("disk is full",), f"{where}: the disk is full; free space and retry"),
            (("disk i/o error",), f"{where}: disk I/O error; check the disk and retry"),
        ]
    else:
        where = f"postgresql at {url.host or 'localhost'}:{url.port or 5432}"
        server_says = _after_fatal(detail)
        rules = [
            (("connection refused",),
             f"cannot connect to {where} (connection refused); start the server or set {ENV_VAR}"),
            (("password authentication failed",),
             f"cannot connect to {where} (authentication failed for user {url.username!r}); "
             f"fix the user or password in {ENV_VAR}"),
            (("role ", "does not exist"),
             f"cannot connect to {where} ({server_says}); fix the user in {ENV_VAR} "
             f"or create the role"),
            (('database "', "does not exist"),
             f"cannot connect to {where} ({server_says}); create it (createdb {url.database}) "
             f"or fix {ENV_VAR}"),
            (("resolve host",), f"cannot connect to {where} (unknown host); fix the host in {ENV_VAR}"),
            (("translate host name",),
             f"cannot connect to {where} (unknown host); fix the host in {ENV_VAR}"),
            (("timeout expired",),
             f"cannot connect to {where} (timed out after {PG_CONNECT_TIMEOUT_S} s); check the "
             f"host, port and firewall, or set {ENV_VAR}"),
            (("connection failed",),
             f"cannot connect to {where} ({server_says}); check the server and {ENV_VAR}"),
        ]
    for needles, message in rules:
        if all(needle in lowered for needle in needles):
            return DatabaseError(message)
    if any(text in lowered for text in ("no such table", "no such column")) or type(orig).__name__ in (
        "UndefinedTable",
        "UndefinedColumn",
    ):
        return SchemaNotAtHead(
            f"{where} has no packbench schema or an old one ({detail}); run `packbench db upgrade`"
        )
    if isinstance(exc, IntegrityError):
        return DatabaseError(
            f"{where} refused a write that breaks a constraint ({detail}); this is a packbench "
            f"bug: report it with the command you ran"
        )
    return DatabaseError(
        f"database error on {where} ({type(orig).__name__}: {detail}); check the database "
        f"and {ENV_VAR}, or run `packbench db upgrade` if packbench was updated"
    )


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception message; DBAPI messages span several."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def _after_fatal(detail: str) -> str:
    """psycopg prefixes server messages with 'connection failed: ... failed: FATAL:  '."""
    return re.split(r"FATAL:\s*|failed:\s*", detail)[-1].strip() or detail


def _redact(text: str) -> str:
    """Hide a password in a URL that could not be parsed (and so not rendered safely)."""
    return re.sub(r"(//[^:/@]*):[^@/]*@", r"\1:***@", text)


def display_url(url: URL) -> str:
    """The URL as shown to users: password hidden."""
    return url.render_as_string(hide_password=True)
