"""Alembic environment for packbench.

Normally run through `db.migrate`, which passes an open Connection in
`config.attributes["connection"]`: the connection carries its own settings (SQLite pragmas,
a PostgreSQL `search_path`), so Alembic's version table and the tables land in the same
schema the application uses. Without one (the `alembic` command line), an engine is made
from `sqlalchemy.url` or, failing that, `$PACKBENCH_DB_URL`.
"""

from alembic import context
from sqlalchemy.engine import Connection

from packbench.db.models import Base
from packbench.db.session import default_url, make_engine

config = context.config
target_metadata = Base.metadata


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead. Note that
        # dropping a table referenced by foreign keys inside a rebuild needs care, because
        # our connections run with PRAGMA foreign_keys=ON.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade --sql`) instead of touching a database."""
    url = config.get_main_option("sqlalchemy.url") or default_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url") or default_url())
    try:
        with engine.begin() as connection:
            _configure_and_run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
