"""Fixtures of the API tests (the helpers live in screens.py, which tests/cli imports too)."""

import shutil
from pathlib import Path

import pytest

from packbench.db.store import Store
from screens import QUICKSTART, ingest_archive


@pytest.fixture
def results_dir(tmp_path) -> Path:
    """A folder holding packbench.db (one screen: the quickstart archive) and archives/."""
    (tmp_path / "archives").mkdir()
    archive = tmp_path / "archives" / QUICKSTART.name
    shutil.copy(QUICKSTART, archive)
    with Store(f"sqlite:///{tmp_path / 'packbench.db'}") as store:
        store.upgrade()
        ingest_archive(store, archive)
    return tmp_path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """An empty database only this test uses, on each backend (PostgreSQL: a fresh schema on the
    server `PACKBENCH_TEST_PG_URL` names, which CI sets; without it that case is reported skipped)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'p.db'}"
        return
    import os
    import uuid

    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    base = os.environ.get("PACKBENCH_TEST_PG_URL")
    if not base:
        pytest.skip("PACKBENCH_TEST_PG_URL is not set; set it (CI does) to e.g. "
                    "postgresql+psycopg://postgres@127.0.0.1:5432/test to run the PostgreSQL cases")
    schema = f"pb_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, poolclass=NullPool)
    with admin.begin() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.begin() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()
