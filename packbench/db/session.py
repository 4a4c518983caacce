"""Engines, sessions and the one place where database exceptions become `DatabaseError`.

Backends: SQLite (the embedded default, one file) and PostgreSQL through psycopg 3 (the
cluster database). Anything else is refused up front, because only these two are tested.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DataError,
    DBAPIError,
    IntegrityError,
    NoSuchModuleError,
    SQLAlchemyError,
)
from sqlalchemy.orm import Session
from sqlalchemy.pool import QueuePool

from packbench.core.settings import DB_URL_ENV, DEFAULT_DB_URL, environ_db_url
from packbench.db.errors import DatabaseError, DatabaseLocked, DatabaseUnavailable, SchemaNotAtHead

ENV_VAR = DB_URL_ENV
# Every refusal below names how the caller gave the URL as the thing to fix: `setting`, which the
# CLI makes "--db" when the URL was typed (cli/common.py `db_setting`); the variable otherwise.
DEFAULT_URL = DEFAULT_DB_URL
SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 10

_URL_HINT = "use sqlite:///path/to/packbench.db or postgresql+psycopg://user@host:5432/dbname"


def upgrade_command(url: str, *, setting: str = ENV_VAR) -> str:
    """The command that migrates the database at `url` (as shown: a password hidden), as a refusal
    names it. A URL typed as --db is typed again: a bare `packbench db upgrade` migrates the
    environment's or the default database, not the one refused."""
    if setting != "--db":
        return "`packbench db upgrade`"
    import shlex

    return f"`packbench --db {shlex.quote(url)} db upgrade`"


def default_url() -> str:
    """The database URL to use when none is given: `$PACKBENCH_DB_URL`, else `sqlite:///packbench.db`."""
    return environ_db_url()  # core/settings.py reads packbench's environment; the CLI passes --db down


def make_engine(url: str | None = None, *, setting: str = ENV_VAR) -> Engine:
    """Create an engine for `url` (default: `default_url()`) without connecting yet; `setting`
    names where the URL came from in the refusals (`--db`, the variable).

    Raises `DatabaseError` for a URL that cannot be parsed, a backend other than SQLite or
    PostgreSQL, or a missing driver. Connection problems surface on first use, translated by
    `session_scope` / `translate_errors`.
    """
    parsed = _parse(url if url is not None else default_url(), setting)
    backend = parsed.get_backend_name()
    try:
        if backend == "sqlite":
            read_only = _read_only_sqlite(parsed, setting)
            if read_only is not None:  # read it as it is: no WAL files to create, no write lock to take
                import sqlite3  # here: a PostgreSQL URL never imports it

                engine = create_engine("sqlite://", poolclass=QueuePool, creator=lambda: sqlite3.connect(
                    read_only, uri=True, check_same_thread=False))
                engine.url = parsed  # messages name the file, not the URI
            else:
                engine = create_engine(parsed)
            _configure_sqlite(engine, read_only=read_only is not None, setting=setting)
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


def _parse(text: str, setting: str = ENV_VAR) -> URL:
    # An int was a TypeError, a NUL the driver's ValueError; a line ending (a CRLF env file, a
    # newline pasted in) passed into the file name, and SQLite created `packbench.db\r` beside it.
    if not isinstance(text, (str, URL)) or any(ord(c) < 0x20 or c == "\x7f" for c in str(text)):
        raise DatabaseError(f"database URL {_redact(str(text))[:60]!r}: a URL is text without control characters "
                            f"(NUL, a line ending); set {setting}: {_URL_HINT}")
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is no number (`h:abc`, `[::1`)
        raise DatabaseError(
            f"cannot parse database URL {_redact(text)!r}; set {setting}: {_URL_HINT}"
        ) from exc
    if parsed.drivername in ("postgresql", "postgres"):
        # A bare postgresql:// would make SQLAlchemy look for psycopg2, which packbench does
        # not depend on; psycopg 3 is the driver it ships with.
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseError(
            f"unsupported database URL scheme {parsed.drivername!r}; set {setting}: {_URL_HINT}"
        )
    unread = sorted(set(parsed.query) - SQLITE_QUERY) if parsed.get_backend_name() == "sqlite" \
        and "uri" not in parsed.query else []
    if unread:  # the driver warned in three lines and ignored them (and `?mode=ro` opened, or created, the file)
        raise DatabaseError(f"database URL {_redact(text)!r}: SQLite's driver does not read {unread[0]!r}; drop it, "
                            f"or write a SQLite URI (sqlite:///file:PATH?mode=ro&uri=true)")
    return parsed


# The query arguments SQLAlchemy's pysqlite driver reads; any other is SQLite's own, in a URI (`uri=true`).
SQLITE_QUERY = {"uri", "timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements"}


def sqlite_file(url: str | None = None, *, setting: str = ENV_VAR) -> Path | None:
    """The file a SQLite URL names (None: PostgreSQL, or an in-memory database)."""
    parsed = _parse(url if url is not None else default_url(), setting)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:") or "uri" in parsed.query \
            or parsed.database.startswith("file:"):  # a URI (`?uri=true`, `mode=ro`): SQLite's own business
        return None
    return Path(parsed.database)


def sqlite_in_memory(url: str | None = None, *, setting: str = ENV_VAR) -> bool:
    """Whether the URL names an in-memory SQLite database (`sqlite://`, `sqlite:///:memory:`, a
    URI with `mode=memory`): one that lives as long as the process that opened it."""
    parsed = _parse(url if url is not None else default_url(), setting)
    if parsed.get_backend_name() != "sqlite":
        return False
    return parsed.database in (None, "", ":memory:") or parsed.database.startswith("file::memory:") \
        or ("uri" in parsed.query and parsed.query.get("mode") == "memory")


def _read_only_sqlite(parsed: URL, setting: str) -> str | None:
    """A `file:` URI that opens an existing SQLite file read-only when it, or the folder beside
    it that SQLite writes its WAL files into, cannot be written (a read-only mount, say); None
    otherwise. With no WAL file there it is opened immutable (nothing can be changing it); with
    one, read-only, as SQLite allows when the -shm file exists."""
    if parsed.database in (None, "", ":memory:") or parsed.query:
        return None
    path = Path(parsed.database)
    try:
        if not path.is_file() or (os.access(path, os.W_OK) and os.access(path.parent or Path("."), os.W_OK)):
            return None
    except OSError as exc:  # a name longer than the file system allows (ENAMETOOLONG)
        raise DatabaseError(f"cannot use sqlite database {str(path)[:60]}... ({exc.strerror}); set {setting} to a "
                            f"shorter path") from exc
    wal = path.with_name(path.name + "-wal")
    flags = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
    return f"{path.absolute().as_uri()}?{flags}"


def _configure_sqlite(engine: Engine, *, read_only: bool = False, setting: str = ENV_VAR) -> None:
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
    - The file it opened: a connection keeps the file it opened, so once the path names
      another file (removed, moved away, replaced) every write would land in a file no one
      reads again, while the command reported success. Each transaction first checks that
      the path still names the file the engine first opened (one stat), and so does each
      new connection before it opens one, else refuses in one line.
    """
    path = sqlite_file(engine.url) if not read_only else None
    path = path.absolute() if path is not None else None  # a later chdir must not look like a replaced file
    opened: list[tuple[int, int] | None] = []  # the file the engine's first connection opened (and created)

    def check_file() -> None:
        if path is not None and opened and opened[0] is not None and _file_identity(path) != opened[0]:
            raise DatabaseError(
                f"sqlite database {path} was removed or replaced while packbench had it open (its rows since "
                f"then would land in a file nobody reads); put the file back, or point {setting} at the "
                f"database to use, and run the command again (`packbench db reconcile` inserts the rows of "
                f"archived episodes)")

    @event.listens_for(engine, "do_connect")
    def _before_connect(*_args) -> None:  # type: ignore[no-untyped-def]
        check_file()  # a new connection would open (create) whatever the path names now

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, see below
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if not read_only:
                cursor.execute("PRAGMA journal_mode = WAL")
        finally:
            cursor.close()
        if path is not None and not opened:
            opened.append(_file_identity(path))

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:  # type: ignore[no-untyped-def]
        check_file()
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")  # read-only: no write lock to take


def _special_file(database: str | None) -> str | None:
    """What a SQLite path names when it is neither a regular file nor a directory ("a FIFO (named
    pipe)", "a socket", "a device"); None otherwise or when nothing is there. From its status only."""
    import stat

    try:
        mode = os.stat(database).st_mode if database else None
    except (OSError, ValueError):
        return None
    if mode is None or stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def _file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`; None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextmanager
def session_scope(engine: Engine, *, setting: str = ENV_VAR) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any exception.

    Database exceptions leave as `DatabaseError` (one line, cause and fix); other exceptions
    (e.g. `NotFound`, `ValueError`) propagate unchanged after the rollback. Objects stay
    readable after commit (`expire_on_commit=False`) so they can be turned into records.
    """
    with translate_errors(engine.url, setting=setting):
        with Session(engine, expire_on_commit=False) as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise


@contextmanager
def translate_errors(url: URL, *, setting: str = ENV_VAR) -> Iterator[None]:
    """Turn SQLAlchemy exceptions (which wrap DBAPI ones) raised inside the block into
    `DatabaseError`; any other exception passes through unchanged."""
    try:
        yield
    except DatabaseError:
        raise
    except SQLAlchemyError as exc:
        raise translate(exc, url, setting=setting) from exc


# SQLite primary result codes (extended codes carry them in the low byte), from sqlite3.h; the
# sqlite3 module exposes them as sqlite3.SQLITE_* but is not imported for a PostgreSQL URL.
_SQLITE_BUSY, _SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 5, 8, 10, 13, 14, 26

# PostgreSQL SQLSTATEs that mean "the server or the connection failed, not the statement":
# the whole transaction may be retried once the server answers again.
_PG_TRANSIENT_CLASSES = ("08",)  # connection_exception
_PG_TRANSIENT = {
    "57P01",  # admin_shutdown (server restarted or stopped)
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now (starting up, recovering)
    "53300",  # too_many_connections
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
}
_PG_SCHEMA = {"42P01", "42703"}  # undefined_table, undefined_column


def _sqlite_code(orig: BaseException) -> int | None:
    """The primary SQLite result code of a sqlite3 exception (None if it carries none)."""
    code = getattr(orig, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _sqlstate(orig: BaseException) -> str | None:
    """The SQLSTATE the PostgreSQL server sent with a psycopg exception, if any."""
    state = getattr(orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def is_transient(exc: BaseException) -> bool:
    """True for a failure of the database server or the connection rather than of the
    statement: a PostgreSQL connection that broke or could not be made (SQLSTATE class 08,
    a shutdown, no server answering at all) or a serialization failure. The same
    transaction may succeed when retried. SQLite errors never are: its busy handler has
    already waited `SQLITE_BUSY_TIMEOUT_MS` for a lock."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    if _sqlite_code(orig) is not None or type(orig).__module__.startswith("sqlite3"):
        return False
    state = _sqlstate(orig)
    if state is not None:
        return state in _PG_TRANSIENT or state[:2] in _PG_TRANSIENT_CLASSES
    # psycopg raises OperationalError without a SQLSTATE when no server answered (refused,
    # timed out, reset): libpq reports these as text only.
    return _operational(orig) and not _connect_refusal(_first_line(orig).lower())


def _operational(orig: BaseException) -> bool:
    """A DBAPI OperationalError, subclasses included: psycopg raises its ConnectionTimeout (one)
    when connect_timeout expires, which a comparison of the class name alone missed (an unreachable
    server was then a generic "database error", not an outage to wait out)."""
    return any(cls.__name__ == "OperationalError" for cls in type(orig).__mro__)


def _connect_refusal(lowered: str) -> bool:
    """A connection the server answered with a refusal that waiting will not change."""
    return any(text in lowered for text in ("authentication failed", "does not exist", "resolve host",
                                            "translate host name")) or _bad_option(lowered) is not None


def _bad_option(detail: str) -> str | None:
    """libpq's refusal of a connection option the URL gave (`invalid sslmode value: "x"`, `invalid
    port number: "99999"`, `invalid connection option "x"`): what it says, else None."""
    found = re.search(r"invalid (?:[\w ]+ value|port number|connection option|integer value)\b.*", detail,
                      re.IGNORECASE)
    return found.group(0) if found else None


def translate(exc: BaseException, url: URL, *, setting: str = ENV_VAR) -> DatabaseError:
    """Map a database exception to a one-line `DatabaseError` naming the cause and the fix.

    Classified by the driver's error code: sqlite3's result code (`sqlite_errorcode`) and
    psycopg's SQLSTATE (`sqlstate`). Two cases have no code and are read from the message:
    SQLite's "no such table/column" (both are the generic SQLITE_ERROR) and libpq's
    connection failures, which psycopg raises without a SQLSTATE even when the server sent
    one (refused, unknown host, timeout, unknown role or database, bad password).
    A transient failure (`is_transient`) becomes `DatabaseUnavailable`.
    """
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    detail = _first_line(orig)
    lowered = detail.lower()
    if url.get_backend_name() == "sqlite":
        where = f"sqlite database {url.database or ':memory:'}"
        a_folder = bool(url.database) and Path(url.database).is_dir()
        by_code = {
            _SQLITE_CANTOPEN:
                f"cannot open {where}: it is a directory; name a file in it "
                f"(sqlite:///{str(url.database).rstrip('/')}/packbench.db) or set {setting}" if a_folder else
                f"cannot open {where} (unable to open database file); create its directory, "
                f"fix its permissions or set {setting}",
            _SQLITE_READONLY:
                f"{where} is read-only ({detail}); make the file and its directory writable "
                f"or set {setting}",
            _SQLITE_BUSY:
                f"{where} stayed locked by another writer for {SQLITE_BUSY_TIMEOUT_MS / 1000:g} s; "
                f"retry, or use PostgreSQL for many concurrent writers",
            _SQLITE_NOTADB:
                f"{url.database} is not a SQLite database; point {setting} at a packbench database",
            _SQLITE_FULL: f"{where}: the disk is full; free space and retry",
            _SQLITE_IOERR: f"{where}: disk I/O error; check the disk and retry",
        }
        message = by_code.get(_sqlite_code(orig))  # type: ignore[arg-type]
        special = _special_file(url.database)
        if special is not None and _sqlite_code(orig) in (_SQLITE_CANTOPEN, _SQLITE_IOERR, _SQLITE_NOTADB):
            # SQLite called a FIFO or a device a disk I/O error: "check the disk" named no fix
            message = f"cannot use {where}: it is {special}, not a database file; point {setting} at a file"
        if _sqlite_code(orig) == _SQLITE_BUSY:
            return DatabaseLocked(message)  # another connection holds it: it may let go
        if message is not None:
            return DatabaseError(message)
        schema_error = "no such table" in lowered or "no such column" in lowered
    else:
        where = f"postgresql at {url.host or 'localhost'}:{url.port or 5432}"
        state = _sqlstate(orig)
        schema_error = state in _PG_SCHEMA
        if state is None and _operational(orig):
            message = _pg_connect_message(lowered, detail, where, url, setting)
            if message is not None:
                return DatabaseUnavailable(message) if is_transient(exc) else DatabaseError(message)
        if is_transient(exc):
            return DatabaseUnavailable(
                f"{where} failed ({type(orig).__name__}{f' {state}' if state else ''}: {detail}); "
                f"check that the server is up and reachable, then retry"
            )
    if schema_error:
        return SchemaNotAtHead(
            f"{where} has no packbench schema or an old one ({detail}); run "
            f"{upgrade_command(display_url(url), setting=setting)}"
        )
    if isinstance(exc, IntegrityError):
        return DatabaseError(
            f"{where} refused a write that breaks a constraint ({detail}); this is a packbench "
            f"bug: report it with the command you ran"
        )
    state = _sqlstate(orig)
    if isinstance(exc, DataError) or (state or "").startswith("22"):  # data_exception: the value, not the schema
        return DatabaseError(
            f"{where} cannot store a value it was given ({type(orig).__name__}: {detail}); change that value "
            f"(a NUL character in text, a number out of range) and retry"
        )
    if state == "25006":  # read_only_sql_transaction: a standby, or default_transaction_read_only
        return DatabaseError(
            f"{where} accepts no writes here ({detail}); point {setting} at the primary, or make the "
            f"database writable"
        )
    upgrade = state is not None and state.startswith("42")  # syntax or access rule: maybe an old schema
    return DatabaseError(
        f"database error on {where} ({type(orig).__name__}: {detail}); check the database "
        f"and {setting}" + (f", or run {upgrade_command(display_url(url), setting=setting)} if packbench was "
                            f"updated" if upgrade else "")
    )


def _pg_connect_message(lowered: str, detail: str, where: str, url: URL, setting: str) -> str | None:
    """The message for a libpq connection failure (no SQLSTATE: matched on libpq's text)."""
    server_says = _after_fatal(detail)
    rules: list[tuple[tuple[str, ...], str]] = [  # (substrings that must all occur, message)
        (("connection refused",),
         f"cannot connect to {where} (connection refused); start the server or set {setting}"),
        (("password authentication failed",),
         f"cannot connect to {where} (authentication failed for user {url.username!r}); "
         f"fix the user or password in {setting}"),
        (("role ", "does not exist"),
         f"cannot connect to {where} ({server_says}); fix the user in {setting} or create the role"),
        (('database "', "does not exist"),
         f"cannot connect to {where} ({server_says}); create it (createdb {url.database}) "
         f"or fix {setting}"),
        (("resolve host",), f"cannot connect to {where} (unknown host); fix the host in {setting}"),
        (("translate host name",), f"cannot connect to {where} (unknown host); fix the host in {setting}"),
        (("timeout expired",),
         f"cannot connect to {where} (timed out after {url.query.get('connect_timeout', PG_CONNECT_TIMEOUT_S)} s); "
         f"check the "
         f"host, port and firewall, or set {setting}"),
        (("connection failed",),
         f"cannot connect to {where} ({server_says}); check the server and {setting}"),
    ]
    for needles, message in rules:
        if all(needle in lowered for needle in needles):
            return message
    if _bad_option(detail) is not None:  # the server was never asked: waiting or retrying changes nothing
        return f"cannot connect to {where} ({_bad_option(detail)}); fix it in {setting}"
    return None


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
