"""`packbench dispatch` when the archive disk is full: the screen that hit it fails, nothing more
is claimed, exit 74 (not 2, which is bad input), and no line names an archive that was never
created. The real dispatcher runs on the in-process fake pool (tests/service/fake_pool.py)."""

from __future__ import annotations

import errno
import sys
from types import SimpleNamespace

from typer.testing import CliRunner

import packbench.core.archive.writer
from packbench.cli.main import app
from packbench.db.store import Store
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool
from tests.service.screens import protocol_file


def test_a_full_archive_disk_exits_74_and_names_no_archive_it_never_made(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'packbench.db'}"
    with Store(url) as store:
        store.upgrade()
        first, second = submit(store, protocol_file(tmp_path), replicas=2, max_attempts=1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packbench.core.archive.writer, "_write_at", full)
    monkeypatch.setitem(sys.modules, "packbench.cluster.pool", SimpleNamespace(RayPool=lambda settings: FakePool()))
    out = CliRunner().invoke(app, ["dispatch", "--db", url, "--archive-dir", str(tmp_path / "archives"),
                                   "--workers", "1"])
    assert out.exit_code == 74, out.output
    assert f"screen {first}: failed; no archive" in out.output and "archive: " not in out.output
    last = out.output.strip().splitlines()[-1]
    assert last.startswith("error: the archive storage failed: could not create archive ")
    assert last.endswith("; every other screen stays queued: free space (or fix the mount) under "
                         + str(tmp_path / "archives") + ", then run `packbench dispatch` again")
    with Store(url) as store:
        assert store.screen(second).status == "queued" and store.attempts(second) == []
