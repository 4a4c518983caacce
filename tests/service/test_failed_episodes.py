"""A screen whose every episode failed ends its attempt `failed`, not `done`; one where only some
failed ends `done` with its failures counted and said; one where none failed ends `done` as
before (core/outcome.py sealed_status). The dispatcher runs on the fake pool, whose records
mirror the real worker's (ok, or failed with its cause), and once end to end on real CPU workers
(tests/cpu_screen.py CpuPool) with a condition kind that raises in every episode."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.core.archive import ArchiveReader
from packbench.db.store import Store
from packbench.service.audit import audit_screens
from packbench.core.outcome import sealed_status
from packbench.service.submit import submit
from tests.service.fake_pool import EpisodeFails, FakePool
from tests.service.screens import dispatcher, protocol_file, rows

CAUSE = "IndexError: index out of range in self"


def every(worker, entry):
    return EpisodeFails(CAUSE)


def packet_only(worker, entry):
    return EpisodeFails(CAUSE) if entry["condition"] == "packet" else None


def test_sealed_status_is_done_unless_every_episode_failed():
    ok, bad = {"status": "ok"}, {"status": "failed", "plan_index": 4, "condition": "packet", "error": "E: x\ny"}
    assert sealed_status([ok, ok], screen_id=1) == ("done", None)
    assert sealed_status([bad, ok], screen_id=1) == ("done", None)  # one ok episode: the screen ran
    status, error = sealed_status([bad, {**bad, "plan_index": 5}], screen_id=7)
    assert status == "failed"
    assert error == ("every episode failed (2 of 2); the first, episode 4 (packet): E: x; fix that cause (each "
                     "episode's error: `packbench screens show 7 --json`) and submit the corrected protocol")
    assert sealed_status([], screen_id=1)[0] == "failed"  # nothing measured is not done


def test_every_episode_failing_fails_the_attempt_keeps_its_sealed_archive_and_is_not_requeued(store, tmp_path):
    # Bug caught: the attempt ended `done` (screen `done`) with nothing measured.
    (screen_id,) = submit(store, protocol_file(tmp_path), max_attempts=3)
    (outcome,) = dispatcher(store, tmp_path, FakePool(fault=every)).run()
    assert (outcome.status, outcome.screen_status, outcome.requeued) == ("failed", "failed", False)
    assert (outcome.failed_episodes, outcome.episodes) == (4, 4)
    (attempt,) = store.attempts(screen_id)  # one attempt of 3 allowed: an episode's error is not retried
    assert attempt.status == "failed" and store.screen(screen_id).status == "failed"
    assert attempt.error.startswith(f"every episode failed (4 of 4); the first, episode 0 (dense-stream): {CAUSE}; ")
    assert attempt.error == outcome.error
    assert rows(store, attempt.id) == [0, 1, 2, 3]  # every failed episode is recorded
    reader = ArchiveReader(Path(attempt.archive_path))
    assert reader.complete and reader.verify() == []  # sealed and kept
    assert attempt.archive_sha256 == outcome.archive_sha256 is not None
    verdicts = store.verdicts(attempt.id)
    assert verdicts and not any(v.passed for v in verdicts)  # stored as sealed, every one failed closed
    (audit,) = audit_screens(store, [screen_id])
    assert audit.result == "agree", audit.report.problems  # the failed attempt's evidence is consistent


def test_some_episodes_failing_is_done_with_the_failures_counted(store, tmp_path):
    (screen_id,) = submit(store, protocol_file(tmp_path))
    (outcome,) = dispatcher(store, tmp_path, FakePool(fault=packet_only)).run()
    assert (outcome.status, outcome.screen_status) == ("done", "done")
    stored = store.episodes(outcome.attempt_id)
    failed = [e.plan_index for e in stored if e.status == "failed"]
    assert failed == [e.plan_index for e in stored if e.condition == "packet"] and len(failed) == 2  # its warmup too
    assert (outcome.failed_episodes, outcome.episodes) == (2, 4)
    assert outcome.first_failure == f"episode {failed[0]} (packet): {CAUSE}"
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "done" and attempt.error is None
    assert not all(v.passed for v in store.verdicts(attempt.id))  # packet's faithfulness fails closed


def test_no_episode_failing_is_done_as_before(store, tmp_path):
    (screen_id,) = submit(store, protocol_file(tmp_path))
    (outcome,) = dispatcher(store, tmp_path, FakePool()).run()
    assert (outcome.status, outcome.error, outcome.failed_episodes, outcome.episodes) == ("done", None, 0, 4)
    assert store.latest_attempt(screen_id).status == "done"
    assert all(v.passed for v in store.verdicts(outcome.attempt_id))  # the fake's exact logits pass faithfulness


def wait_cli(tmp_path, monkeypatch, fault):
    """`packbench submit --wait` on the fake pool: (result, db url)."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    with Store(url) as s:
        s.upgrade()
    monkeypatch.setitem(sys.modules, "packbench.cluster.pool",
                        SimpleNamespace(RayPool=lambda settings: FakePool(fault=fault)))
    monkeypatch.setattr("packbench.service.dispatcher.loop.source_freeze", lambda: {"git_commit": "test"})
    out = CliRunner().invoke(app, ["submit", str(protocol_file(tmp_path)), "--wait", "--db", url,
                                   "--archive-dir", str(tmp_path / "archives")])
    return out, url


def test_submit_wait_exits_1_with_one_line_naming_the_first_episodes_error(tmp_path, monkeypatch):
    out, url = wait_cli(tmp_path, monkeypatch, every)
    assert out.exit_code == 1, out.output  # was 1 for failed verdicts of a `done` screen: now the screen failed
    errors = [line for line in out.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: screen 1 failed: every episode failed (4 of 4); the first, episode 0 (dense-stream): "
                      f"{CAUSE}; fix that cause (each episode's error: `packbench screens show 1 --json`) and "
                      f"submit the corrected protocol"]
    assert "screen 1: failed; archive: " in out.output
    show = CliRunner().invoke(app, ["screens", "show", "1", "--db", url])
    assert show.exit_code == 0, show.output
    assert show.output.splitlines()[0].endswith(", failed, submitted by " + show.output.splitlines()[0].split(
        ", submitted by ")[1])
    attempts = show.output.split("\nattempts\n")[1].split("\n\n")[0]
    row = attempts.splitlines()[-1]
    assert " failed " in row and "every episode failed (4 of 4)" in row and " 4 " in row  # status, error, failed


def test_submit_wait_with_some_failed_episodes_exits_1_and_says_how_many(tmp_path, monkeypatch):
    out, url = wait_cli(tmp_path, monkeypatch, packet_only)
    assert out.exit_code == 1, out.output  # every verdict may pass; a failed episode is not silent
    assert "screen 1: done; archive: " in out.output
    (line,) = [line for line in out.output.splitlines() if line.startswith("error:")]
    assert line.startswith("error: screen 1: 2 of 4 episodes failed; the first, episode ")
    assert f"(packet): {CAUSE} (each episode's error: `packbench screens show 1 --json`)" in line


def test_submit_wait_with_every_episode_ok_exits_0(tmp_path, monkeypatch):
    out, _ = wait_cli(tmp_path, monkeypatch, None)
    assert out.exit_code == 0, out.output
    assert "screen 1: done; archive: " in out.output and "error:" not in out.output


# -- the real engine on the CPU: a condition kind whose every episode raises


class Broken:
    """A loader policy that fails every forward call: the engine raises inside the episode."""

    name = "broken"
    starts_early = False

    def activate(self, host, device, recorder) -> None:
        pass  # broken: nothing to prepare

    def deactivate(self) -> None:
        pass  # broken: nothing held

    def before_layer(self, layer: int) -> None:
        pass  # broken: nothing to start early

    def fetch(self, layer: int, h):
        raise RuntimeError(f"broken kind: layer {layer} has no weights to give")

    def device_bytes(self) -> int:
        return 0

    def pinned_bytes(self) -> int:
        return 0


@pytest.fixture
def broken_kind():
    from packbench.core.conditions import CONDITIONS
    from packbench.core.conditions.base import ConditionKind
    from packbench.engine.conditions import RUNTIMES
    from packbench.engine.conditions.base import LoaderRuntime

    kind = ConditionKind(name="broken", summary="fails every call", params={}, h2d_bytes=lambda p, call: call.dense())
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CONDITIONS, "broken", kind)
        mp.setitem(RUNTIMES, "broken", LoaderRuntime(policy=Broken))
        yield


def cpu_protocol(folder: Path, tiny: Path, conditions: list[str]) -> Path:
    import yaml

    body = {"name": "cpu-" + "-".join(conditions), "model": {"path": str(tiny)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8, "continuation_tokens": 2,
            "conditions": [{"policy": c} for c in conditions], "reference": conditions[0], "allowance_mib": 64,
            "warmups": 1, "gates": {"faithfulness": {}}}
    path = folder / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_a_real_cpu_screen_whose_every_episode_fails_ends_failed(store, tmp_path, tiny, broken_kind):
    from cpu_screen import CpuPool

    (screen_id,) = submit(store, cpu_protocol(tmp_path, tiny, ["broken"]))
    (outcome,) = dispatcher(store, tmp_path, CpuPool()).run()
    (attempt,) = store.attempts(screen_id)
    assert (outcome.status, attempt.status, store.screen(screen_id).status) == ("failed", "failed", "failed")
    episodes = store.episodes(attempt.id)
    assert episodes and all(e.status == "failed" for e in episodes)
    assert attempt.error.startswith("every episode failed (2 of 2); the first, episode 0 (broken): "
                                    "RuntimeError: broken kind: layer 0 has no weights to give; fix that cause")
    reader = ArchiveReader(Path(attempt.archive_path))
    assert reader.complete and reader.verify() == [] and attempt.archive_sha256 == outcome.archive_sha256


def test_a_real_cpu_screen_with_one_failing_condition_is_done_with_it_counted(store, tmp_path, tiny, broken_kind):
    from cpu_screen import CpuPool

    (screen_id,) = submit(store, cpu_protocol(tmp_path, tiny, ["dense-stream", "broken"]))
    (outcome,) = dispatcher(store, tmp_path, CpuPool()).run()
    assert (outcome.status, outcome.failed_episodes, outcome.episodes) == ("done", 2, 4)
    stored = store.episodes(outcome.attempt_id)
    assert [e.status for e in stored] == ["ok" if e.condition == "dense-stream" else "failed" for e in stored]
    first = min(e.plan_index for e in stored if e.condition == "broken")
    assert outcome.first_failure == f"episode {first} (broken): RuntimeError: broken kind: layer 0 has no weights to give"
