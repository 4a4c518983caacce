"""Fixtures for the database tests: one empty database per test, on every backend.

`db_url` is parametrized over SQLite (a file under tmp_path) and PostgreSQL. The PostgreSQL
case needs `PACKBENCH_TEST_PG_URL` (CI always sets it); without it the case is reported as
skipped, never as passed. Each PostgreSQL test gets a fresh schema `pb_<random>` selected
through the connection's `search_path` (so Alembic's version table lands there too), and
the schema is dropped afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from packbench.db.store import Store

PG_ENV = "PACKBENCH_TEST_PG_URL"


def pg_base_url() -> str | None:
    return os.environ.get(PG_ENV) or None


def skip_without_pg() -> str:
    """The PostgreSQL base URL, or skip the test saying how to enable it."""
    base = pg_base_url()
    if base is None:
        pytest.skip(
            f"{PG_ENV} is not set; set it (CI does) to e.g. "
            f"postgresql+psycopg://postgres@127.0.0.1:5432/test to run the PostgreSQL cases"
        )
    return base


@contextmanager
def fresh_pg_schema(base: str) -> Iterator[str]:
    """Create schema pb_<random>, yield a URL whose connections use it, then drop it."""
    schema = f"pb_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, poolclass=NullPool)
    with admin.begin() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as connection:
            # Fail loudly instead of hanging if a test left a transaction open on the schema.
            connection.exec_driver_sql("SET LOCAL lock_timeout = '10s'")
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """The URL of an empty database (no schema) that only this test uses."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'packbench.db'}"
        return
    with fresh_pg_schema(skip_without_pg()) as url:
        yield url


@pytest.fixture
def pg_server_url() -> str:
    """The PostgreSQL base URL from the environment (the shared database, no fresh schema)."""
    return skip_without_pg()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """Like `db_url`, PostgreSQL only."""
    with fresh_pg_schema(skip_without_pg()) as url:
        yield url


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """A `Store` on an empty database upgraded to head."""
    with Store(db_url) as s:
        s.upgrade()
        yield s


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def module_db_url(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[str]:
    """Like `db_url`, but shared by one test module (for read-only tests over seeded data)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('module-db') / 'packbench.db'}"
        return
    with fresh_pg_schema(skip_without_pg()) as url:
        yield url
