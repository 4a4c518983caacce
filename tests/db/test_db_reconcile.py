"""Reconciliation on a real database (SQLite file and PostgreSQL): archived episodes without a
row are checked against the archive's hashes and inserted once; the attempt says so, and so do
`status`, `screens show` and `packbench db reconcile`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from packbench.core.archive import ArchiveReader, ArchiveWriter, PLAN_NAME, episode_member
from packbench.db.store import Store
from packbench.service.reconcile import missing_records, reconcile

FREEZE = {"git": "abc"}
ENTRIES = [{"index": i, "condition": "dense-stream" if i % 2 == 0 else "packet", "role": "scored", "prompt": i // 2}
           for i in range(4)]


def record(i: int) -> dict:
    entry = ENTRIES[i]
    return {"plan_index": i, "condition": entry["condition"], "role": entry["role"], "prompt": entry["prompt"],
            "status": "ok", "tokens": [1, 2, 3], "wall_s": 0.5 + i}


def archive(path: Path, indexes, *, seal: bool) -> ArchiveWriter:
    w = ArchiveWriter(path)
    w.add_json(PLAN_NAME, {"entries": ENTRIES, "prompts": []})
    for i in indexes:
        w.add_episode(record(i), np.zeros((3, 5), dtype=np.float32), np.zeros((2, 2), dtype=np.float64))
    if seal:
        w.seal({"screen_id": 1})
    return w


@pytest.fixture
def attempt(store, tmp_path):
    protocol = store.put_protocol(sha256="a" * 64, name="p", canonical_json="{}")
    store.create_screen(protocol_id=protocol, submitter="t")
    dispatcher = store.register_dispatcher("d", "h")
    claim = store.claim_screen(dispatcher, lease_s=60, archive_dir=str(tmp_path), source_freeze=FREEZE)
    return claim.attempt


def test_rows_are_inserted_once_and_the_attempt_says_so(store, attempt):
    assert store.put_episode(attempt.id, record(0)) is True
    assert store.put_reconciled(attempt.id, [record(0), record(1)], check="manifest") == 1  # row 0 kept
    assert store.put_reconciled(attempt.id, [record(1)], check="manifest") == 0  # idempotent
    assert store.put_reconciled(attempt.id, [record(2)], check="crc32") == 1
    assert [e.plan_index for e in store.episodes(attempt.id)] == [0, 1, 2]
    (row,) = store.attempts(attempt.screen_id)
    # in all 2 rows; the weakest check used is the attempt's
    assert (row.reconciled_episodes, row.reconciled_check) == (2, "crc32") and row.reconciled_at is not None
    (listed,) = store.queue_status().reconciled
    assert (listed.screen_id, listed.attempt, listed.episodes, listed.check) == (attempt.screen_id, 1, 2, "crc32")
    (detail,) = store.screen_detail(attempt.screen_id).attempts
    assert detail.episodes == 3 and detail.attempt.reconciled_episodes == 2
    with pytest.raises(ValueError, match="manifest, writer, crc32"):
        store.put_reconciled(attempt.id, [], check="trust-me")


def test_a_sealed_archive_is_checked_against_its_manifest(store, attempt):
    archive(Path(attempt.archive_path), range(4), seal=True)
    store.put_episode(attempt.id, record(0))
    store.finish_attempt(attempt.id, status="failed", error="the database went away")
    report = reconcile(store)
    (done,) = report.attempts
    assert (done.inserted, done.check, done.refused) == (3, "manifest", ())
    assert [e.plan_index for e in store.episodes(attempt.id)] == [0, 1, 2, 3]
    assert store.episodes(attempt.id)[3].wall_s == 3.5  # the record's values, as put_episode stores them
    assert reconcile(store).attempts == []  # nothing left to do


def test_after_an_outage_only_attempts_ended_since_are_read(store, attempt):
    from datetime import datetime, timedelta, timezone

    archive(Path(attempt.archive_path), range(2), seal=True)
    store.finish_attempt(attempt.id, status="failed", error="x")
    later = datetime.now(timezone.utc) + timedelta(minutes=5)
    report = reconcile(store, finished_since=later)
    assert report.attempts == [] and report.checked == 0 and store.episodes(attempt.id) == []
    (done,) = reconcile(store, finished_since=later - timedelta(minutes=10)).attempts
    assert done.inserted == 2


def test_a_running_attempt_is_left_to_its_dispatcher(store, attempt):
    archive(Path(attempt.archive_path), range(2), seal=False)
    assert reconcile(store).attempts == [] and store.episodes(attempt.id) == []
    (done,) = reconcile(store, attempt_ids=[attempt.id]).attempts  # the dispatcher's own call
    assert (done.inserted, done.check) == (2, "crc32")


def test_members_that_do_not_match_their_hashes_are_refused(tmp_path):
    w = archive(tmp_path / "a.zip", range(3), seal=False)
    table = {name: dict(entry) for name, entry in w.members.items()}
    check, records, refused = missing_records(ArchiveReader(tmp_path / "a.zip"), [0], expected=table)
    assert check == "writer" and [r["plan_index"] for r in records] == [1, 2] and refused == []
    table[episode_member(2)]["sha256"] = "0" * 64
    check, records, refused = missing_records(ArchiveReader(tmp_path / "a.zip"), [0], expected=table)
    assert [r["plan_index"] for r in records] == [1]
    assert refused == ["member episodes/00002.json does not match its SHA-256 entry (altered after it was written)"]


def test_an_episode_cut_off_before_its_logits_gets_no_row(tmp_path):
    w = archive(tmp_path / "a.zip", range(1), seal=False)
    w.add_json(episode_member(1), record(1))  # the record, then the process died before the logits
    check, records, refused = missing_records(ArchiveReader(tmp_path / "a.zip"), [])
    assert check == "crc32" and [r["plan_index"] for r in records] == [0] and refused == []


def test_an_episode_whose_trace_never_landed_gets_no_row(tmp_path, monkeypatch):
    """Bug caught: `add_episode` wrote the record first, so a disk that filled at an episode's
    memory trace (seen with a tmpfs archive directory: `could not append member traces/00007.npy`,
    ENOSPC) left its record and logits, and `db reconcile` inserted a row for an episode the
    driver never recorded; on a GPU, whose trace backs the sampled peak, the audit of that partial
    archive then disagreed. The record now goes last: a cut-off episode has no record, no row."""
    import errno

    from packbench.core.errors import ArchiveError

    w = archive(tmp_path / "a.zip", range(1), seal=False)
    append = ArchiveWriter._append

    def full_at_the_trace(self, name, data, compress_type, **options):
        if name == "traces/00001.npy":
            raise OSError(errno.ENOSPC, "No space left on device")
        return append(self, name, data, compress_type, **options)

    monkeypatch.setattr(ArchiveWriter, "_append", full_at_the_trace)
    sampled = {**record(1), "memory": {"peak_sampled_bytes": 30}, "sampler": {"samples": 2}}
    with pytest.raises((ArchiveError, OSError)):
        w.add_episode(sampled, np.zeros((3, 5), dtype=np.float32), np.array([[0.0, 10.0], [0.5, 30.0]]))
    with ArchiveReader(tmp_path / "a.zip") as reader:
        assert not reader.complete and episode_member(1) not in reader.names  # what landed: logits/00001.npy
        assert "logits/00001.npy" in reader.names
        check, records, refused = missing_records(reader, [])
    assert check == "crc32" and [r["plan_index"] for r in records] == [0] and refused == []


def test_a_record_that_disagrees_with_the_plan_is_refused(tmp_path):
    w = ArchiveWriter(tmp_path / "a.zip")
    w.add_json(PLAN_NAME, {"entries": ENTRIES, "prompts": []})
    w.add_episode({**record(1), "condition": "resident"}, np.zeros((3, 5), dtype=np.float32))
    _, records, refused = missing_records(ArchiveReader(tmp_path / "a.zip"), [])
    assert records == [] and refused == ["episode 1's record does not match plan entry 1"]


def test_the_commands_say_when_rows_were_reconciled(store, attempt, db_url):
    from packbench.cli.main import app

    archive(Path(attempt.archive_path), range(2), seal=True)
    store.finish_attempt(attempt.id, status="failed", error="x")
    runner = CliRunner()
    out = runner.invoke(app, ["db", "reconcile", "--db", db_url])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines() == [
        f"screen {attempt.screen_id} attempt 1: 2 episode rows inserted from its archive, checked against its "
        f"manifest's SHA-256", "reconciled 2 episode rows from 1 archive"]
    again = runner.invoke(app, ["db", "reconcile", "--db", db_url, "--json"])
    assert json.loads(again.output)["inserted"] == 0
    shown = runner.invoke(app, ["screens", "show", str(attempt.screen_id), "--db", db_url])
    assert shown.exit_code == 0 and "2 rows at " in shown.output and "(manifest)" in shown.output
    status = runner.invoke(app, ["status", "--db", db_url])
    assert status.exit_code == 0 and "reconciled (episode rows inserted from archives" in status.output
    line = next(l for l in status.output.splitlines() if l.split()[:2] == [str(attempt.screen_id), "1"])
    assert "failed" in line and "manifest" in line and " 2 " in line


def test_a_refused_episode_makes_db_reconcile_exit_1(store, attempt, db_url):
    from packbench.cli.main import app

    w = ArchiveWriter(Path(attempt.archive_path))
    w.add_json(PLAN_NAME, {"entries": ENTRIES, "prompts": []})
    w.add_episode({**record(0), "prompt": 7}, np.zeros((3, 5), dtype=np.float32))
    store.finish_attempt(attempt.id, status="failed", error="x")
    out = CliRunner().invoke(app, ["db", "reconcile", "--db", db_url])
    assert out.exit_code == 1
    assert out.output.splitlines()[-1] == "reconciled 0 episode rows from 1 archive; 1 refused"
    assert "refused (episode 0's record does not match plan entry 0)" in out.output

