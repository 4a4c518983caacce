"""An honest CUDA screen audits AGREE, and the readers show its GPU-only figures.

The CPU test archives hold none of what only a CUDA worker measures (an NVML energy reading and
sampled peak with its memory trace, the allocator's peaks, pinned and context bytes, copy waits,
device "cuda:0"), so an auditor that mishandled any of them passed every test: the database's
`energy_j` once compared against a record the auditor had dropped it from, and every GPU screen
audited DISAGREE. Here the fake pool answers as a CUDA worker (tests/service/fake_pool.py
`cuda=True`), the dispatcher stores what it stores for one, and the audit, `db reconcile`,
`results`, `compare` and `report` read it."""

from __future__ import annotations

import sqlite3

import pytest
import yaml

from packbench.core.archive import ArchiveReader
from packbench.service.audit import audit_screens
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool
from tests.service.screens import dispatcher, protocol_file

# Every gate a CUDA record feeds: resources reads the three peaks, capacity the start's allowance.
GATES = {"faithfulness": {}, "resources": {}, "capacity": {},
         "acquisition": [{"control": "dense-stream", "max_ratio": 0.5}],
         "runtime": {"control": "dense-stream", "max_ratio": 0.9}}


@pytest.fixture
def cuda_screen(store, tmp_path):
    """(store, database file, screen id, attempt) of a screen run on a fake CUDA worker."""
    path = protocol_file(tmp_path, prompts=2)
    body = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**body, "repetitions": 2, "gates": GATES}))
    (screen_id,) = submit(store, path)
    (outcome,) = dispatcher(store, tmp_path, FakePool(cuda=True)).run()
    assert outcome.status == "done"
    return store, tmp_path / "packbench.db", screen_id, store.latest_attempt(screen_id)


def test_an_honest_cuda_screen_audits_agree_with_every_gpu_figure_stored(cuda_screen):
    """Bug caught: the auditor compared the database's energy_j (an NVML reading only a CUDA
    worker records) with a record it had dropped the field from: every GPU screen audited DISAGREE
    ("database episode 0 energy_j 12.5 != archive None"), and no CPU test archive held a reading."""
    store, _, screen_id, attempt = cuda_screen
    rows = store.episodes(attempt.id)
    assert all(e.energy_j is not None and e.peak_sampled_bytes is not None and e.peak_allocated_bytes is not None
               for e in rows)  # the figures are there to be compared
    with ArchiveReader(attempt.archive_path) as archive:
        assert archive.read_json("worker.json")["start"]["device"] == "cuda:0"
        assert archive.read_array("traces/00000.npy").shape == (3, 2)
    (audit,) = audit_screens(store, [screen_id])
    assert audit.result == "agree", audit.report.problems
    resources = [v for v in audit.report.record["verdicts"] if v["gate"] == "resources"]
    assert resources and all(v["passed"] for v in resources)  # judged on the sampled peaks, not failed closed


def test_a_cuda_rows_gpu_figures_edited_disagree(cuda_screen):
    store, db, screen_id, attempt = cuda_screen
    with sqlite3.connect(db) as connection:
        energy, sampled = connection.execute("SELECT energy_j, peak_sampled_bytes FROM episodes WHERE attempt_id = ? "
                                             "AND plan_index = 3", (attempt.id,)).fetchone()
        connection.execute("UPDATE episodes SET energy_j = ?, peak_sampled_bytes = ? WHERE attempt_id = ? AND "
                           "plan_index = 3", (energy + 1, sampled - 1, attempt.id))
    (audit,) = audit_screens(store, [screen_id])
    assert audit.report.problems == [f"database episode 3 peak_sampled_bytes {sampled - 1} != archive {sampled}",
                                     f"database episode 3 energy_j {energy + 1} != archive {energy}"]


def test_rows_reconciled_from_a_cuda_archive_audit_agree(cuda_screen):
    """`db reconcile` inserts an archived episode's row from its record: a CUDA record's energy and
    peaks go in as the dispatcher would have stored them."""
    from packbench.service.reconcile import reconcile

    store, db, screen_id, attempt = cuda_screen
    with sqlite3.connect(db) as connection:
        connection.execute("DELETE FROM episodes WHERE attempt_id = ? AND plan_index IN (4, 5)", (attempt.id,))
    reconcile(store, attempt_ids=[attempt.id])
    assert {e.plan_index for e in store.episodes(attempt.id) if e.energy_j is not None} >= {4, 5}
    (audit,) = audit_screens(store, [screen_id])
    assert audit.result == "agree", audit.report.problems


def test_results_compare_and_report_show_a_cuda_screens_figures(cuda_screen, packbench_cli, tmp_path):
    store, db, screen_id, attempt = cuda_screen
    env = {"PACKBENCH_DB_URL": f"sqlite:///{db}"}
    energy = sorted(e.energy_j for e in store.episodes(attempt.id))
    r = packbench_cli("results", "--sort", "energy_j", "--desc", "--limit", "1", env=env)
    assert r.returncode == 0 and f" {energy[-1]}" in r.stdout.splitlines()[-1], r.stdout + r.stderr
    r = packbench_cli("compare", str(screen_id), str(screen_id), env=env)
    assert r.returncode == 0, r.stderr
    assert any(line.split()[2:3] == ["energy_j_per_episode"] for line in r.stdout.splitlines()), r.stdout
    assert any(line.split()[2:3] == ["peak_sampled_bytes"] for line in r.stdout.splitlines()), r.stdout
    r = packbench_cli("report", str(screen_id), "--out", str(tmp_path / "r.html"), env=env)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text()
    assert "Sampled GPU memory against the allowance" in page and "NVML counter" in page


def test_results_sorted_by_the_sampled_peak_shows_it(cuda_screen, packbench_cli):
    """Bug caught: `results --sort peak_sampled_bytes` (NVML's peak, which only a GPU run has)
    ranked the table by a column it did not show: the rows read as ordered by nothing shown, the
    allocator's peak beside them."""
    store, db, _, attempt = cuda_screen
    top = max(e.peak_sampled_bytes for e in store.episodes(attempt.id))
    r = packbench_cli("results", "--sort", "peak_sampled_bytes", "--desc", "--limit", "1",
                      env={"PACKBENCH_DB_URL": f"sqlite:///{db}"})
    header, row = r.stdout.splitlines()[-2:]
    assert header.split()[-1] == "peak_sampled_bytes" and row.split()[-1] == str(top), r.stdout + r.stderr
