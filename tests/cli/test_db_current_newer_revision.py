"""`packbench db current` on a database a newer packbench migrated.

Bug caught: it printed "(head is ...: run `packbench db upgrade`)" for a revision this packbench
does not know, and `db upgrade` then refuses that database (a newer packbench wrote it), so the
fix it named was a dead end. Now it names the real one: install the newer packbench."""

from __future__ import annotations

import sqlite3

from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.db.store import Store


def test_a_newer_revision_is_not_told_to_upgrade(tmp_path):
    path = tmp_path / "newer.db"
    url = f"sqlite:///{path}"
    store = Store(url)
    store.upgrade()
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    out = CliRunner().invoke(app, ["db", "current", "--db", url])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("9999_from_the_future (unknown to this packbench")
    assert "db upgrade" not in out.output and "install that version" in out.output
    refused = CliRunner().invoke(app, ["db", "upgrade", "--db", url])  # what the old advice led to
    assert refused.exit_code != 0


def test_an_older_revision_is_still_told_to_upgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'older.db'}"
    store = Store(url)
    store.upgrade("0010_screen_labels")
    store.close()
    out = CliRunner().invoke(app, ["db", "current", "--db", url])
    assert out.exit_code == 0 and out.output.startswith("0010_screen_labels (head is ")
    assert f"run `packbench --db {url} db upgrade`" in out.output  # the database typed, not the default
