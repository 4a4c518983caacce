"""Fixtures of the API tests (the helpers live in screens.py, which tests/cli imports too)."""

import shutil
from pathlib import Path

import pytest

from db.store import Store
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
