"""`db reconcile` of an attempt whose recorded archive path holds another screen's archive.

Bug caught: reconcile inserted the episodes of whatever archive lay at the recorded path, so an
attempt pointed (by a hand edit, a faulty tool or a copied file) at another screen's archive got
that screen's episodes as its own rows, and `db reconcile` said it had reconciled them (exit 0);
only a later audit called the screen DISAGREE. Now the archive's protocol (and a sealed
archive's screen and attempt) must be the attempt's, or nothing is inserted and it is refused."""

from __future__ import annotations

import sqlite3

from packbench.service.reconcile import reconcile
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool
from tests.service.screens import dispatcher, protocol_file, rows


def two_screens(store, tmp_path, *, same_protocol: bool):
    (a,) = submit(store, protocol_file(tmp_path, prompts=2))
    (b,) = submit(store, protocol_file(tmp_path, prompts=2 if same_protocol else 3))
    outcomes = dispatcher(store, tmp_path, FakePool(), workers=1).run()
    assert [o.status for o in outcomes] == ["done", "done"]
    (attempt_a,), (attempt_b,) = store.attempts(a), store.attempts(b)
    with sqlite3.connect(tmp_path / "packbench.db") as db:  # B's rows lost, its path naming A's archive
        db.execute("DELETE FROM episodes WHERE attempt_id = ?", (attempt_b.id,))
        db.execute("UPDATE attempts SET archive_path = ? WHERE id = ?", (attempt_a.archive_path, attempt_b.id))
    return attempt_b


def test_another_protocols_archive_is_refused(store, tmp_path):
    attempt_b = two_screens(store, tmp_path, same_protocol=False)
    report = reconcile(store)
    assert report.inserted == 0 and report.refused == 1 and rows(store, attempt_b.id) == []
    (done,) = report.attempts
    assert "it is another screen's archive; nothing was inserted" in done.refused[0]


def test_another_screens_sealed_archive_of_the_same_protocol_is_refused(store, tmp_path):
    attempt_b = two_screens(store, tmp_path, same_protocol=True)
    report = reconcile(store)
    assert report.inserted == 0 and report.refused == 1 and rows(store, attempt_b.id) == []
    (done,) = report.attempts
    assert f"not screen {attempt_b.screen_id} attempt 1's" in done.refused[0]


def test_the_attempts_own_archive_still_reconciles(store, tmp_path):
    (a,) = submit(store, protocol_file(tmp_path, prompts=2))
    (outcome,) = dispatcher(store, tmp_path, FakePool(), workers=1).run()
    with sqlite3.connect(tmp_path / "packbench.db") as db:
        db.execute("DELETE FROM episodes WHERE attempt_id = ? AND plan_index > 2", (outcome.attempt_id,))
    report = reconcile(store)
    assert report.refused == 0 and report.inserted > 0
