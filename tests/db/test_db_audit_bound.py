"""An audit of an archive over the reader's size bound is recorded, on every backend: `disagree`,
a null archive SHA-256 (migration 0012) and the one line naming the size, the bound and
`packbench audit SCREEN --max-mib N` (before 0012 the NOT NULL refused the row and the audit was
lost)."""

import json
import platform

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.archive import MAX_JSON_TOTAL_BYTES, file_sha256, mib_to_admit
from packbench.core.archive import reader as archive_reader
from packbench.db.store import Store
from packbench.service.audit import audit_screens


def test_an_over_bound_audit_is_recorded_unhashed(db_url, tmp_path, monkeypatch):
    archive = tmp_path / "screen.zip"
    write_synthetic_screen(archive, synthetic_protocol(prompts_n=1, repetitions=1))
    with Store(db_url) as store:
        store.upgrade()
        protocol_id = store.put_protocol(sha256="ab" * 32, name="p", canonical_json=json.dumps({"name": "p"}))
        machine = store.put_machine(host=platform.node(), gpu_name="cpu", driver="", torch="2", cuda="")
        screen_id = store.create_screen(protocol_id=protocol_id, submitter="t")
        attempt = store.start_attempt(screen_id=screen_id, worker="w", node="n", gpu_name="cpu", gpu_index=0,
                                      machine_id=machine, source_freeze={}, archive_path=str(archive))
        store.finish_attempt(attempt.id, status="done", archive_sha256=file_sha256(archive))
        size = archive.stat().st_size
        monkeypatch.setattr(archive_reader, "MAX_ARCHIVE_BYTES", size - 1)  # one byte over
        (outcome,) = audit_screens(store, [screen_id])
        # Catches the constraint error that lost the audit, and a "SHA-256 None differs" line.
        assert (outcome.recorded, outcome.record_error, outcome.result) == (True, None, "disagree")
        [audit] = store.audits(attempt.id)
    line = (f"the archive is {size} bytes, over the audit bound of {size - 1} bytes, so it was not read; only for an "
            f"archive you trust, audit it with `packbench audit {screen_id} --max-mib {mib_to_admit(size + MAX_JSON_TOTAL_BYTES)}`")
    assert (audit.result, audit.archive_sha256, audit.problems, audit.kind) == ("disagree", None, (line,), "local")
