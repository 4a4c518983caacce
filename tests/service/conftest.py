"""What the dispatcher's tests share: one migrated SQLite database copied per test, and a fixed
source freeze (hashing the engine and asking git costs tens of ms per dispatcher, and is not
what these tests check). Helpers to build screens and dispatchers: tests/service/screens.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from packbench.db.store import Store


@pytest.fixture(scope="session")
def migrated(tmp_path_factory) -> Path:
    """One database at head, copied for each test (migrating costs more than most of the tests)."""
    path = tmp_path_factory.mktemp("template") / "packbench.db"
    with Store(f"sqlite:///{path}") as s:
        s.upgrade()
    return path


@pytest.fixture
def store(migrated, tmp_path):
    path = tmp_path / "packbench.db"
    shutil.copy(migrated, path)
    with Store(f"sqlite:///{path}", retry_delays=(0.01,)) as s:
        yield s


@pytest.fixture(autouse=True)
def _fixed_freeze(monkeypatch):
    import packbench.service.dispatcher.loop

    monkeypatch.setattr(packbench.service.dispatcher.loop, "source_freeze", lambda: {"git_commit": "test"})
