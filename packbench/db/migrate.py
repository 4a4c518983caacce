"""Alembic, configured in code.

There is no alembic.ini at run time: `alembic_config()` points `script_location` at the
installed `migrations` package and hands Alembic the caller's open Connection, so the
migration runs with the same connection settings as the application (SQLite pragmas,
PostgreSQL `search_path`) and inside the caller's transaction.

Functions taking a Connection do not translate errors; `db.store.Store` wraps them.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from packbench import migrations

MIGRATIONS_DIR = Path(migrations.__file__).parent


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic `Config` for the packbench migrations, bound to `connection` if given."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        url = connection.engine.url.render_as_string(hide_password=False)
        # Config is a ConfigParser: a literal '%' (e.g. a URL-encoded option) must be doubled.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
        config.attributes["connection"] = connection
    return config


@cache
def script_directory() -> ScriptDirectory:
    """The revisions shipped with this packbench (read once per process)."""
    return ScriptDirectory.from_config(alembic_config())


def head() -> str:
    """The single head revision of the shipped migrations."""
    heads = script_directory().get_heads()
    assert len(heads) == 1, f"migrations have {len(heads)} heads: {heads}; merge them"
    return heads[0]


def known_revisions() -> set[str]:
    return {script.revision for script in script_directory().walk_revisions()}


def history() -> list[str]:
    """Every shipped revision, newest first, as 'revision: first line of its docstring'."""
    return [
        f"{script.revision}: {script.longdoc.splitlines()[0] if script.longdoc else ''}"
        for script in script_directory().walk_revisions()
    ]


def not_at_head(url: str, current: str | None, *, upgrade: str = "`packbench db upgrade`") -> str | None:
    """Why a database at revision `current` (None: no packbench schema) cannot be used, as the
    one line `SchemaNotAtHead` says, naming the fix (`upgrade`, the command that migrates this
    database: db/session.py `upgrade_command`); None when it is at head."""
    need = head()
    if current == need:
        return None
    if current is None:
        return f"database {url} has no packbench schema (revision none, need {need}); run {upgrade}"
    if current not in known_revisions():
        return unknown_revision(url, current)
    return f"database {url} is at revision {current} but this packbench needs {need}; run {upgrade}"


def unknown_revision(url: str, current: str) -> str:
    """The refusal for a revision newer than this packbench's migrations."""
    return (f"database {url} is at revision {current}, which this packbench does not know "
            f"(its newest is {head()}); a newer packbench wrote it: install that version")


def current(connection: Connection) -> str | None:
    """The revision the database is at; None for a database Alembic never touched."""
    return MigrationContext.configure(connection).get_current_revision()


def lock_migrations(connection: Connection) -> None:
    """On PostgreSQL, wait for any other migration of this schema to commit (a transaction-scoped
    advisory lock on the schema's name) before reading its revision. Before, two `packbench db
    upgrade` run at once both created the tables; the loser failed with a duplicate-key error
    that called itself a packbench bug. SQLite needs none: its migration transaction takes the
    write lock at BEGIN IMMEDIATE (db/session.py)."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtext('packbench migrate ' || current_schema()))")


def upgrade(connection: Connection, revision: str = "head") -> None:
    command.upgrade(alembic_config(connection), revision)


def downgrade(connection: Connection, revision: str) -> None:
    command.downgrade(alembic_config(connection), revision)
