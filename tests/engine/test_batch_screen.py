"""A batch-2 screen on the CPU through the driver (service/screen.py ScreenRun) and a real SQLite
database: every exact loader decodes two prompts together, bit for bit as dense-stream does,
each episode archives every sequence's tokens and logits, the database row counts every
sequence's tokens, and the archive audits AGREE against the database (the auditor checks every
sequence). A low-bit competitor at batch 2 is teacher-forced per sequence and its fidelity
recomputed by the auditor."""

from pathlib import Path

import numpy as np
import pytest

from packbench.core.audit import audit_archive
from packbench.core.plan import episode_input, prompts
from packbench.core.protocol import freeze
from packbench.db.store import Store
from packbench.engine.worker import Worker
from packbench.service.audit import episode_dicts, verdict_dicts
from packbench.service.screen import ScreenRun

CONTINUATION = 4


def batch_protocol(model: Path, **changes) -> dict:
    raw = {"name": "batch-2", "model": {"path": str(model)}, "dtype": "float32", "batch": 2,
           "prompts": {"generator": {"seed": 0, "count": 3}}, "prefix_tokens": 12,
           "continuation_tokens": CONTINUATION,
           "conditions": [{"policy": "dense-stream"}, {"policy": "packet"},
                          {"name": "packet-device", "policy": "packet", "params": {"gather": "device"}},
                          {"policy": "phase-switched"}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
           "gates": {"faithfulness": {}, "acquisition": {"control": "dense-stream", "max_ratio": 1.0}}, **changes}
    return freeze(raw).body


def run_screen(store: Store, body: dict, model: Path, archive: Path) -> tuple[ScreenRun, object, int]:
    """The driver's steps for one attempt, the worker in this process; returns the run, its
    outcome and the attempt id."""
    from packbench.core.canonical import canonical_json, sha256_hex

    text = canonical_json(body).decode()
    protocol_id = store.put_protocol(sha256=sha256_hex(canonical_json(body)), name=body["name"], canonical_json=text)
    screen_id = store.create_screen(protocol_id=protocol_id, submitter="test", model_dir=str(model))
    attempt = store.start_attempt(screen_id=screen_id, worker="w", node="n", gpu_name="cpu", gpu_index=0,
                                  machine_id=None, source_freeze={}, archive_path=str(archive))
    worker = Worker(device="cpu")
    start = worker.load(body, str(model))
    ids = prompts(body, vocab=start.pop("vocab"))
    run = ScreenRun(store, screen=store.screen(screen_id), attempt=attempt, protocol=body, archive_path=archive,
                    freeze={})
    run.begin(worker.describe())
    for entry in run.loaded(start, ids):
        run.record(worker.run(entry, episode_input(ids, entry)))
    return run, run.finish(), attempt.id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(f"sqlite:///{tmp_path_factory.mktemp('db') / 'batch.db'}")
    s.upgrade()
    yield s
    s.close()


@pytest.fixture(scope="module")
def screen(tmp_path_factory, store, checkpoints):
    body = batch_protocol(checkpoints["float32"])
    run, outcome, attempt_id = run_screen(store, body, checkpoints["float32"],
                                          tmp_path_factory.mktemp("batch") / "screen.zip")
    return body, run, outcome, attempt_id


def test_a_batch_freezes_as_schema_6_and_plans_consecutive_prompts(screen):
    body, run, _, _ = screen
    assert body["schema"] == 6 and body["batch"] == 2
    scored = [e for e in run.entries if e["role"] == "scored"]
    assert {e["prompt"]: e["prompts"] for e in scored} == {0: [0, 1], 1: [1, 2], 2: [2, 0]}


def test_every_episode_holds_each_sequence_and_every_verdict_passes(screen):
    _, run, outcome, _ = screen
    assert outcome.status == "done"
    for e in run.episodes:
        assert e["status"] == "ok", e.get("error")
        assert e["logits"].shape[:2] == (2, CONTINUATION) and len(e["tokens"]) == 2
        assert e["prompts"] == run.entries[e["plan_index"]]["prompts"]
        assert [c["tokens"] for c in e["calls"]] == [24] + [2] * (CONTINUATION - 1)
    verdicts = {(v["gate"], v["condition"]): v for v in outcome_verdicts(run)}
    assert all(v["passed"] for v in verdicts.values()), [v for v in verdicts.values() if not v["passed"]]
    assert verdicts["faithfulness", "packet-device"]["value"] == 0.0


def outcome_verdicts(run: ScreenRun) -> list[dict]:
    return run._sealed[0]


def test_the_database_counts_every_sequences_tokens(screen, store):
    _, run, _, attempt_id = screen
    rows = {r.plan_index: r for r in store.episodes(attempt_id)}
    for e in run.episodes:
        assert list(rows[e["plan_index"]].tokens) == e["tokens"]
        assert rows[e["plan_index"]].n_tokens == 2 * CONTINUATION


def test_the_screen_audits_agree_against_the_database(screen, store):
    _, _, outcome, attempt_id = screen
    report = audit_archive(outcome.archive_path, expected_sha256=outcome.archive_sha256,
                           db_verdicts=verdict_dicts(store.verdicts(attempt_id)),
                           db_episodes=episode_dicts(store.episodes(attempt_id)))
    assert report.agrees, report.problems


def test_the_auditor_checks_every_sequence(screen, tmp_path):
    """A second sequence's token changed in the archive (the record rewritten, the manifest
    resealed over it): the audit names that sequence."""
    from tests.core.test_audit import reseal

    _, _, outcome, _ = screen

    def bump(record: dict) -> None:
        record["tokens"][1][2] += 1

    bad = reseal(outcome.archive_path, tmp_path / "bad.zip", replace={"episodes/00002.json": bump})
    report = audit_archive(bad)
    assert not report.agrees
    assert any("episodes/00002.json sequence 1: tokens are not the argmax" in p for p in report.problems), \
        report.problems


def test_a_competitor_batch_is_teacher_forced_per_sequence(tmp_path, store):
    """int8 weight-only (torchao) at batch 2, in mode eager (what a batch runs competitors in):
    every sequence is forced on its own reference tokens, and the auditor recomputes the fidelity."""
    pytest.importorskip("torchao")
    from packbench.engine.synth import synth_checkpoint

    model = synth_checkpoint(tmp_path / "tiny-opt", shape="tiny", dtype="float32", seed=0, profile="opt")
    body = batch_protocol(model, conditions=[
        {"policy": "dense-stream"}, {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}}],
        gates={"faithfulness": {}, "fidelity": {"max_mean_kl": 0.05}})
    assert body["conditions"][1]["params"]["mode"] == "eager"
    run, outcome, attempt_id = run_screen(store, body, model, tmp_path / "q.zip")
    scored = [e for e in run.episodes if e["condition"] == "int8" and e["role"] == "scored"]
    assert scored and all(e["fidelity"]["positions"] == 2 * CONTINUATION for e in scored)
    assert all(np.asarray(e["forced_logits"]).shape[:2] == (2, CONTINUATION) for e in scored)
    report = audit_archive(outcome.archive_path, db_verdicts=verdict_dicts(store.verdicts(attempt_id)),
                           db_episodes=episode_dicts(store.episodes(attempt_id)))
    assert report.agrees, report.problems
