"""Options and helpers shared by the command modules."""

import contextlib
import dataclasses
import tempfile
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Optional

import typer

from packbench.core.errors import PackbenchError
from packbench.core.settings import ARCHIVE_DIR_ENV, DB_URL_ENV, DEFAULT_DB_URL, MAX_SECONDS, RAY_ADDRESS_ENV, Settings


def _db_given_first(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """A command's --db, unless it came from the environment while `packbench --db URL` was given:
    the command line beats the environment wherever on the line --db stands."""
    top = ctx.obj.db_url if isinstance(ctx.obj, Settings) else None
    if top is not None and getattr(ctx.get_parameter_source(param.name), "name", None) != "COMMANDLINE":
        return top
    return value


def db_not_empty(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """`--db ''` (an unset variable in a script, say) is refused, not read as "the default"."""
    if value is not None and not value.strip():
        raise typer.BadParameter(f"is empty; give a database URL such as {DEFAULT_DB_URL}, or leave --db out")
    return value


# The sources ("COMMANDLINE", "ENVIRONMENT", ...) of this command line's --db options, noted by
# their callbacks as the line is parsed: the one moment an option's source is known (db_setting).
_DB_SOURCES: ContextVar[tuple[str | None, ...]] = ContextVar("db_sources", default=())


def note_db_source(ctx: typer.Context, param: typer.CallbackParam) -> None:
    """Note where this --db came from; the top-level one (parsed first) starts a fresh line."""
    source = getattr(ctx.get_parameter_source(param.name), "name", None)
    _DB_SOURCES.set((() if ctx.parent is None else _DB_SOURCES.get()) + (source,))


def db_setting() -> str:
    """How this command was given its database URL, as a refusal names the thing to fix: "--db"
    when typed (before or after the command's name), PACKBENCH_DB_URL when only the environment
    set it, both when neither did (the default URL)."""
    sources = _DB_SOURCES.get()
    if "COMMANDLINE" in sources:
        return "--db"
    return DB_URL_ENV if "ENVIRONMENT" in sources else f"--db (or {DB_URL_ENV})"


def top_db(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """`packbench --db URL COMMAND`'s callback."""
    note_db_source(ctx, param)
    return db_not_empty(ctx, param, value)


def _db_option(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    note_db_source(ctx, param)
    return db_not_empty(ctx, param, _db_given_first(ctx, param, value))


# Integers the database stores are PostgreSQL `integer` columns (32-bit, SQLite takes 64):
# a value beyond them is refused where it is read, not by the driver (an OverflowError on SQLite).
DB_INT_MAX = 2**31 - 1
DB_INT_MIN = -(2**31)

def finite(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
    """A float option's callback: nan and +-inf are refused (click's ranges pass nan)."""
    import math

    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def seconds(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
    """A duration option's callback: a finite number of seconds > 0, at most MAX_SECONDS (the bound
    Settings.from_environ holds the same variables to)."""
    value = finite(ctx, param, value)
    if value is not None and not 0 < value <= MAX_SECONDS:
        raise typer.BadParameter(f"{value} is not a number of seconds in (0, {MAX_SECONDS}]")
    return value


DB_HELP = f"Database URL (default {DEFAULT_DB_URL}); also `packbench --db URL COMMAND`."
DbUrl = Annotated[Optional[str], typer.Option("--db", envvar=DB_URL_ENV, callback=_db_option, help=DB_HELP)]
# metavar "": typer 0.29 prints a flag as `--wait <bool>`, though a flag takes no value (`--wait true` is
# refused), so every packbench flag declares an empty one.
Json = Annotated[bool, typer.Option("--json", metavar="", help="Print the result as one JSON document on stdout.")]
Address = Annotated[Optional[str], typer.Option(
    envvar=RAY_ADDRESS_ENV, help="Join this Ray cluster (host:port of the head) instead of an embedded local one.")]
ArchiveDir = Annotated[Path, typer.Option("--archive-dir", envvar=ARCHIVE_DIR_ENV, help="Where raw archives are written.")]


def settings_of(ctx: typer.Context, **per_command) -> Settings:
    """The shared settings with this command's own options (--db, --address, --archive-dir)."""
    base = ctx.obj if isinstance(ctx.obj, Settings) else Settings()
    return dataclasses.replace(base, **{k: v for k, v in per_command.items() if v is not None})


def echo_json(document) -> None:
    """One JSON document on stdout (sorted keys; dates and paths as strings)."""
    import json

    typer.echo(json.dumps(document, sort_keys=True, default=str))


def open_store(url: str | None, *, at_head: bool = True, must_exist: bool | None = None):
    """The results store; refuses a database that is not at the migration head unless told not to
    (a SQLite file that does not exist is refused without being created, unless `must_exist` is
    False: `db upgrade` creates it; by default it must exist when it must be at the head)."""
    from packbench.db.session import sqlite_file, sqlite_in_memory, upgrade_command
    from packbench.db.store import Store

    setting = db_setting()
    if sqlite_in_memory(url, setting=setting):  # `db upgrade` migrated it and said so, then the next command found it empty
        raise PackbenchError("an in-memory SQLite database (sqlite://) ends with the command that opened it, so "
                             f"nothing it stores outlives that command; give {setting} a file, e.g. {DEFAULT_DB_URL}")
    missing = sqlite_file(url, setting=setting) if (at_head if must_exist is None else must_exist) else None
    if missing is not None and not missing.exists():  # SQLite would create an empty file, then refuse it
        raise PackbenchError(f"no database at {missing} (no such file here); run "
                             f"{upgrade_command(str(url), setting=setting)} to create it, or give {setting} the "
                             f"database that holds your screens")
    store = Store(url, setting=setting)
    if at_head:
        store.check_head()
    return store


def output_dir(path: Path, option: str) -> Path:
    """`path` as a directory to write into, created if missing; one line naming `option` if it
    cannot be (a file there, no permission, a read-only or virtual file system). An existing
    directory is written to once (a temporary file, removed): a read-only mount or a directory
    without write permission is found here, before a screen is queued or weights are drawn,
    not by the first write after them."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if path.exists() or isinstance(e, (FileExistsError, NotADirectoryError)) \
            else e.strerror or type(e).__name__
        raise PackbenchError(f"{option} {path}: cannot create that directory ({why}); "
                             f"give {option} a writable directory") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise PackbenchError(f"{option} {path}: cannot write into that directory ({e.strerror or type(e).__name__}); "
                             f"give {option} a writable directory") from None
    return path


def write_output(path: Path, text: str, option: str) -> None:
    """Write `text` to `path` (UTF-8) whole or not at all: through a temporary file beside it, so
    a failure (no such directory, a full disk) leaves no partial file and any old one as it was;
    one line naming `option` if it cannot be written."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        hint = "create that directory or" if not path.parent.is_dir() else "free space, check permissions, or"
        raise PackbenchError(f"{option} {path}: cannot write it ({e.strerror or type(e).__name__}); "
                             f"{hint} choose another {option}") from None


def not_a_file(path: Path) -> str | None:
    """What `path` is when it is no regular file to read ("a directory", "a FIFO (named pipe)",
    "a device", "a socket", "missing"), None when it is one; from its status, never opened (a
    FIFO's open waits for a writer)."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return "missing"
    for test, kind in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a device"
