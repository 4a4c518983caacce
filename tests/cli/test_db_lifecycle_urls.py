"""Database URLs the `packbench db ...` commands and `packbench.connect` refuse, and what they
leave behind (nothing)."""

from __future__ import annotations

import pytest

MEMORY_URLS = ["sqlite://", "sqlite:///:memory:", "sqlite:///file:pb?mode=memory&uri=true"]


@pytest.mark.parametrize("url", MEMORY_URLS)
@pytest.mark.parametrize("command", [["db", "upgrade"], ["db", "current"], ["results"]])
def test_an_in_memory_sqlite_url_is_refused_in_one_line(packbench_cli, tmp_path, url, command):
    """Bug caught: `packbench db upgrade --db sqlite://` printed `database at <head> (head)` and
    exited 0, and every command after it found that database empty and said to run `packbench db
    upgrade`, the command just run: an in-memory database ends with its process, and each command
    is one. Every command now refuses it in one line naming a file URL (exit 2)."""
    ran = packbench_cli(*command, "--db", url, cwd=tmp_path)
    assert ran.returncode == 2, ran
    assert ran.stdout == ""
    assert ran.stderr.count("\n") == 1 and "in-memory SQLite database" in ran.stderr
    assert "sqlite:///packbench.db" in ran.stderr and "db upgrade" not in ran.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_directory_as_the_sqlite_path_is_named_as_one(packbench_cli, tmp_path):
    """Bug caught: `--db sqlite:///SOME_DIR` said "unable to open database file; create its
    directory, fix its permissions", for a directory that exists and is writable: the fix named
    was no fix. It now says the path is a directory and names a file in it."""
    folder = tmp_path / "results"
    folder.mkdir()
    for command in (["db", "upgrade"], ["db", "current"]):
        ran = packbench_cli(*command, "--db", f"sqlite:///{folder}", cwd=tmp_path)
        assert ran.returncode == 2, ran
        assert ran.stderr == (f"error: cannot open sqlite database {folder}: it is a directory; name a file in it "
                              f"(sqlite:///{folder}/packbench.db) or set --db\n")
    assert list(folder.iterdir()) == []


def test_a_fifo_as_the_sqlite_path_is_named_as_one(packbench_cli, tmp_path):
    """Bug caught: `--db sqlite:///A_FIFO` (or /dev/null) said "disk I/O error; check the disk and
    retry", a fix that does nothing: the path names no file. It now says what the path is."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for command in (["db", "upgrade"], ["db", "current"]):
        ran = packbench_cli(*command, "--db", f"sqlite:///{fifo}", cwd=tmp_path)
        assert ran.returncode == 2, ran
        assert ran.stderr == (f"error: cannot use sqlite database {fifo}: it is a FIFO (named pipe), not a database "
                              f"file; point --db at a file\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
