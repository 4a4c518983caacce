"""`passes: separate` (schema 7) on the CPU through the driver (service/screen.py ScreenRun) and a
real SQLite database: every episode runs a timing pass (ledger and sampler off) and a recording
pass (both on); the record's times are the timing pass's, its counts the recording pass's, and
`passes` keeps both walls. The archive audits AGREE against the database and through the command
line, the report states the recording's cost, a forged or stripped `passes` is caught, and
passes that differ fail the episode."""

from pathlib import Path

import numpy as np
import pytest

import packbench.engine.worker
from packbench.core.audit import audit_archive
from packbench.core.plan import episode_input, plan, prompts
from packbench.core.protocol import freeze
from packbench.db.store import Store
from packbench.engine.worker import Worker
from packbench.service.audit import episode_dicts, verdict_dicts
from tests.core.test_audit import reseal
from tests.engine.test_batch_screen import run_screen

CONTINUATION = 4
DATA = Path(__file__).resolve().parents[1] / "data"


def passes_protocol(model: Path, **changes) -> dict:
    raw = {"name": "passes", "model": {"path": str(model)}, "dtype": "float32", "passes": "separate",
           "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 12,
           "continuation_tokens": CONTINUATION,
           # row-retention keeps an LRU across calls: its recording pass must start as its timing pass did
           "conditions": [{"policy": "dense-stream"}, {"policy": "packet"},
                          {"name": "lru", "policy": "row-retention", "params": {"rows_per_layer": 16}}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
           "gates": {"faithfulness": {}, "acquisition": {"control": "dense-stream", "max_ratio": 1.0},
                     "runtime": {"control": "dense-stream", "max_ratio": 100.0, "resamples": 200}}, **changes}
    return freeze(raw).body


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(f"sqlite:///{tmp_path_factory.mktemp('db') / 'passes.db'}")
    s.upgrade()
    yield s
    s.close()


@pytest.fixture(scope="module")
def screen(tmp_path_factory, store, checkpoints):
    body = passes_protocol(checkpoints["float32"])
    run, outcome, attempt_id = run_screen(store, body, checkpoints["float32"],
                                          tmp_path_factory.mktemp("passes") / "screen.zip")
    return body, run, outcome, attempt_id


def test_every_episode_carries_both_passes(screen):
    body, run, outcome, _ = screen
    assert body["schema"] == 7 and outcome.status == "done"
    for e in run.episodes:
        assert e["status"] == "ok", e.get("error")
        p = e["passes"]
        assert p["timing_wall_s"] == e["wall_s"] and p["recording_wall_s"] > 0
        assert len(p["recording_call_s"]) == len(e["calls"]) == CONTINUATION
        assert p["recording_wall_s"] >= sum(p["recording_call_s"]) and e["wall_s"] >= e["call_s"]
    packet = next(e for e in run.episodes if e["condition"] == "packet")
    assert packet["h2d_weight_bytes"] > 0 and packet["calls"][0]["active_rows"][0] is not None  # the recording pass counted
    verdicts = run._sealed[0]
    assert all(v["passed"] for v in verdicts), [v for v in verdicts if not v["passed"]]


def test_the_recording_pass_counts_what_one_pass_together_counts(screen, checkpoints):
    """The same episodes with passes together: the same tokens, logits and ledger counts (the
    bytes do not depend on whether they are counted), the LRU's included."""
    body, run, _, _ = screen
    together = {k: v for k, v in body.items() if k != "passes"} | {"schema": 6}
    worker = Worker(device="cpu")
    ids = prompts(together, vocab=worker.load(together, str(checkpoints["float32"]))["vocab"])
    count_keys = ("active_rows", "rows_copied", "h2d_weight_bytes", "h2d_index_bytes", "d2h_bytes", "rows_wasted")
    for entry in plan(together)[:5]:
        one = worker.run(entry, episode_input(ids, entry))
        two = run.episodes[entry["index"]]
        assert "passes" not in one and one["tokens"] == two["tokens"]
        assert np.array_equal(one["logits"], two["logits"])
        assert [[c[k] for k in count_keys] for c in one["calls"]] == [[c[k] for k in count_keys] for c in two["calls"]]


def test_the_database_stores_the_timing_pass(screen, store):
    _, run, _, attempt_id = screen
    rows = {r.plan_index: r for r in store.episodes(attempt_id)}
    for e in run.episodes:
        row = rows[e["plan_index"]]
        assert row.wall_s == e["passes"]["timing_wall_s"] and row.call_s == e["call_s"]
        assert row.h2d_weight_bytes == e["h2d_weight_bytes"]


def test_the_screen_audits_agree_against_the_database_and_on_the_command_line(screen, store, packbench_cli):
    _, _, outcome, attempt_id = screen
    report = audit_archive(outcome.archive_path, expected_sha256=outcome.archive_sha256,
                           db_verdicts=verdict_dicts(store.verdicts(attempt_id)),
                           db_episodes=episode_dicts(store.episodes(attempt_id)))
    assert report.agrees, report.problems
    r = packbench_cli("audit", "--archive", str(outcome.archive_path))
    assert r.returncode == 0 and "AGREE" in r.stdout, r.stdout + r.stderr


def test_the_report_states_the_recordings_cost(screen, packbench_cli, tmp_path):
    from packbench.core.report import measurement_cost, read_screen

    _, _, outcome, _ = screen
    cost = measurement_cost(read_screen(outcome.archive_path))
    assert cost["passes"] == "separate" and [r["condition"] for r in cost["conditions"]] == ["dense-stream", "packet", "lru"]
    assert all(r["n"] == 2 and r["ratio"] > 0 and r["recording_decode_s"] > 0 for r in cost["conditions"])
    r = packbench_cli("report", str(outcome.archive_path), "--out", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text()
    assert 'id="passes-separate"' in page and "recording / timing" in page


def test_a_together_screen_says_its_timings_include_the_recording():
    from packbench.cli.report_page import cost_section
    from packbench.core.report import read_screen

    section = cost_section(read_screen(DATA / "gates-v2.zip"))
    assert 'id="passes-together"' in section and "includes the in-call recording" in section


@pytest.mark.parametrize("edit, line", [
    (lambda r: r.pop("passes"), "episodes/00004.json: separate passes but no recording pass figures"),
    (lambda r: r["passes"].update(timing_wall_s=r["passes"]["recording_wall_s"] + 1.0),
     "episodes/00004.json: passes.timing_wall_s"),
    (lambda r: r["passes"]["recording_call_s"].pop(), "episodes/00004.json: separate passes but passes.recording_call_s"),
    (lambda r: r["passes"].update(recording_wall_s=0.0), "episodes/00004.json: passes.recording_wall_s 0.0 is below"),
])
def test_a_forged_pass_record_is_caught(screen, tmp_path, edit, line):
    """The record rewritten and the manifest resealed over it: only the pass checks can see it."""
    _, _, outcome, _ = screen
    report = audit_archive(reseal(outcome.archive_path, tmp_path / "bad.zip", replace={"episodes/00004.json": edit}))
    assert not report.agrees
    assert [p for p in report.problems if p.startswith(line)], report.problems


def test_passes_on_a_together_archive_are_caught(tmp_path):
    def claim(record: dict) -> None:
        record["passes"] = {"timing_wall_s": record["wall_s"], "recording_wall_s": record["wall_s"],
                            "recording_call_s": [0.0] * len(record["calls"])}

    report = audit_archive(reseal(DATA / "gates-v2.zip", tmp_path / "bad.zip", replace={"episodes/00003.json": claim}))
    assert not report.agrees
    assert "episodes/00003.json: passes figures on an episode of a protocol whose passes run together" in report.problems


def test_passes_that_differ_fail_the_episode(checkpoints, monkeypatch):
    """A recording pass whose second call's logits moved by one ulp: the episode fails with the
    call named and both walls kept; the next episode runs."""
    real = packbench.engine.worker.run_episode

    def drifting(model, prompt, **kw):
        out = real(model, prompt, **kw)
        if model.recorder.enabled and kw.get("forced") is None:  # the recording pass
            out.logits[1, 0] = np.nextafter(out.logits[1, 0], np.float32(np.inf))
        return out

    body = passes_protocol(checkpoints["float32"])
    worker = Worker(device="cpu")
    ids = prompts(body, vocab=worker.load(body, str(checkpoints["float32"]))["vocab"])
    entries = plan(body)
    monkeypatch.setattr(packbench.engine.worker, "run_episode", drifting)
    failed = worker.run(entries[0], episode_input(ids, entries[0]))
    assert failed["status"] == "failed" and failed["logits"] is None
    assert failed["error"] == "PassMismatch: call 1: logits differ between the timing and recording passes"
    assert set(failed["passes"]) == {"timing_wall_s", "recording_wall_s", "recording_call_s"}
    monkeypatch.setattr(packbench.engine.worker, "run_episode", real)
    assert worker.run(entries[1], episode_input(ids, entries[1]))["status"] == "ok"


def test_a_competitor_runs_both_passes_and_is_teacher_forced_once(tmp_path, store):
    """int8 weight-only (torchao), tier approximate: both passes agree bit for bit, the
    teacher-forced logits come after them, and the auditor recomputes its fidelity."""
    pytest.importorskip("torchao")
    from packbench.engine.synth import synth_checkpoint

    model = synth_checkpoint(tmp_path / "tiny-opt", shape="tiny", dtype="float32", seed=0, profile="opt")
    body = passes_protocol(model, conditions=[
        {"policy": "dense-stream"},
        {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only", "mode": "eager"}}],
        gates={"faithfulness": {}, "fidelity": {"max_mean_kl": 0.05}})
    run, outcome, attempt_id = run_screen(store, body, model, tmp_path / "q.zip")
    scored = [e for e in run.episodes if e["condition"] == "int8" and e["role"] == "scored"]
    assert scored and all(e["status"] == "ok" and e["passes"]["timing_wall_s"] == e["wall_s"] for e in scored)
    assert all(e["forced_logits"] is not None and e["fidelity"] is not None for e in scored)
    report = audit_archive(outcome.archive_path, db_verdicts=verdict_dicts(store.verdicts(attempt_id)),
                           db_episodes=episode_dicts(store.episodes(attempt_id)))
    assert report.agrees, report.problems
