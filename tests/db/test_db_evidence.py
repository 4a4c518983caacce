"""0005 evidence columns and tables on every backend: signers, attempt evidence, ingest in one
transaction (nothing partial)."""

import pytest

from packbench.db.errors import Conflict
from packbench.db.store import Store

EPISODE = {"plan_index": 0, "condition": "dense-stream", "role": "warmup", "prompt": 0, "status": "ok",
           "tokens": [1, 2], "wall_s": 1.0, "call_s": 0.5, "energy_j": 3.5}
VERDICT = {"gate": "faithfulness", "condition": "dense-stream", "phase": "all", "passed": True, "value": 0.0,
           "threshold": 0.0, "interval": None, "episodes": [0], "detail": "ok"}


def ingest(store: Store, sha: str, **over):
    kw = dict(protocol_sha256="p" * 64, protocol_name="x", protocol_json='{"name":"x"}',
              machine={"host": "lab-b", "gpu_name": "H200"},
              attempt={"archive_path": "/a.zip", "archive_sha256": sha, "ingested_from": "lab-b",
                       "signer_key_id": "0123456789abcdef", "model_sha256": "m" * 64},
              episodes=[EPISODE], verdicts=[VERDICT])
    kw.update(over)
    return store.ingest_attempt(**kw)


def test_signers_are_registered_once(db_url):
    with Store(db_url) as store:
        store.upgrade()
        first = store.put_signer(key_id="0123456789abcdef", public_key="ab" * 32, name="ours", local=True)
        again = store.put_signer(key_id="0123456789abcdef", public_key="ab" * 32, name="renamed")
        assert first == again and first.local and first.name == "ours"
        assert [s.key_id for s in store.signers()] == ["0123456789abcdef"]


def test_ingest_writes_everything_or_nothing(db_url):
    with Store(db_url) as store:
        store.upgrade()
        row = ingest(store, "a" * 64)
        assert row.status == "done" and row.ingested_from == "lab-b" and row.model_sha256 == "m" * 64
        assert [(e.plan_index, e.energy_j) for e in store.episodes(row.id)] == [(0, 3.5)]  # NVML joules kept
        assert [v.gate for v in store.verdicts(row.id)] == ["faithfulness"]
        with pytest.raises(Conflict, match="already in this database"):
            ingest(store, "a" * 64)
        screens = len(store.list_screens())
        with pytest.raises(Exception):
            ingest(store, "b" * 64, verdicts=[{**VERDICT, "phase": "nonsense"}])  # violates a CHECK
        assert len(store.list_screens()) == screens  # rolled back: no screen without its rows


def test_one_archive_ingested_at_once_by_two_stores_is_recorded_once(pg_url):
    """Bug caught (PostgreSQL): `packbench ingest` of one archive run by several processes at once,
    its signer already registered, recorded it once per process (4 screens for 4 ingests): each
    transaction checked for an attempt with the archive's SHA-256 before any of them committed.
    The second now waits for the first and is refused (`Conflict`)."""
    import threading
    import time

    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from packbench.db import ingest as db_ingest

    with Store(pg_url) as first, Store(pg_url) as second:
        first.upgrade()
        kw = dict(protocol_sha256="p" * 64, protocol_name="x", protocol_json='{"name":"x"}',
                  machine={"host": "lab-b", "gpu_name": "H200"},
                  attempt={"archive_path": "/a.zip", "archive_sha256": "e" * 64, "ingested_from": "lab-b"},
                  episodes=[EPISODE], verdicts=[VERDICT])
        outcome: list[object] = []

        def ingest_again() -> None:
            try:
                outcome.append(second.ingest_attempt(**kw))
            except Conflict as exc:
                outcome.append(exc)

        with Session(first._engine) as session:  # the first ingest, not committed yet
            db_ingest.ingest_attempt(session, clock=first._clock, **kw)
            thread = threading.Thread(target=ingest_again)
            thread.start()
            deadline = time.monotonic() + 60
            # Until the second waits for a lock (the fix's, or before it the protocol row's) or is done;
            # the outcome does not hang on it: the commit below ends any wait.
            with first._engine.connect() as probe:
                while thread.is_alive() and time.monotonic() < deadline and not probe.execute(text(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar():
                    time.sleep(0.01)
            session.commit()
        thread.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], Conflict), outcome
        assert len(first.list_screens()) == 1


def test_attempt_evidence_is_recorded(db_url):
    with Store(db_url) as store:
        store.upgrade()
        row = ingest(store, "c" * 64)
        store.set_attempt_evidence(row.id, model_sha256="d" * 64, signer_key_id="fedcba9876543210")
        got = store.latest_attempt(row.screen_id)
        assert (got.model_sha256, got.signer_key_id) == ("d" * 64, "fedcba9876543210")


def test_ingesting_an_archive_whose_every_episode_failed_records_a_failed_attempt(db_url):
    # Bug caught: ingest recorded a `done` screen for evidence in which nothing ran, where the
    # driver that sealed it ends the attempt `failed` (core/outcome.py).
    with Store(db_url) as store:
        store.upgrade()
        failed = {**EPISODE, "status": "failed", "error": "IndexError: index out of range in self"}
        row = ingest(store, "e" * 64, episodes=[failed, {**failed, "plan_index": 1}])
        assert row.status == "failed" and store.screen(row.screen_id).status == "failed"
        assert row.error.startswith("every episode failed (2 of 2); the first, episode 0 (dense-stream): IndexError: ")
        assert [e.status for e in store.episodes(row.id)] == ["failed", "failed"]  # kept, as sealed
        some = ingest(store, "f" * 64, episodes=[failed, {**EPISODE, "plan_index": 1}])
        assert some.status == "done" and some.error is None
