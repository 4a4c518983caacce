"""`packbench keys init` against a database it cannot register the key in.

Bug caught: the key files were written first and the database refused after (no such file, or a
schema below the head); the message said to create or upgrade the database, and the rerun then
refused because "a key already exists", so that key could never be registered as this
deployment's own. Now the database is checked first and nothing is written."""

from __future__ import annotations

from packbench.db.store import Store
from test_hostile_input import pb as run  # tests/cli/test_hostile_input.py: main() as a terminal sees it


def pb(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `packbench ARGS`."""
    r = run(capsys, *args)
    return r.code, r.out + r.err


def test_no_database_writes_no_key(tmp_path, capsys):
    key = tmp_path / "k.pem"
    url = f"sqlite:///{tmp_path / 'absent.db'}"
    code, out = pb(capsys, "--db", url, "keys", "init", "--key", str(key))
    assert code == 2 and f"packbench --db {url} db upgrade" in out and len(out.splitlines()) == 1, out
    assert not key.exists() and not (tmp_path / "k.pem.pub").exists()


def test_an_older_schema_writes_no_key_and_the_rerun_after_upgrade_registers_it(tmp_path, capsys):
    key = tmp_path / "k.pem"
    url = f"sqlite:///{tmp_path / 'old.db'}"
    store = Store(url)
    store.upgrade("0010_screen_labels")
    store.close()
    code, out = pb(capsys, "--db", url, "keys", "init", "--key", str(key))
    assert code == 2 and f"run `packbench --db {url} db upgrade`" in out and len(out.splitlines()) == 1, out
    assert not key.exists()
    assert pb(capsys, "--db", url, "db", "upgrade")[0] == 0
    code, out = pb(capsys, "--db", url, "keys", "init", "--key", str(key))
    assert code == 0 and "this deployment's own" in out, out
    assert "local" in pb(capsys, "--db", url, "keys", "list")[1]
