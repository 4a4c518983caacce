"""The episode timeout (Settings.episode_timeout_s, `--episode-timeout`): a worker that owes an
episode's reply past it is hung; it is lost as a dead worker is (killed, replaced, its attempt
`failed` with a cause saying it timed out, the screen queued again while it has attempts left),
on the fake pool (tests/service/fake_pool.py). Without it a hung episode (a deadlocked CUDA call,
a plugin that never returns) held its screen `running` for ever: each test here would hang,
and pytest-timeout stops it."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from packbench.core.archive import ArchiveReader
from packbench.core.errors import PackbenchError
from packbench.core.settings import DEFAULT_EPISODE_TIMEOUT_S, DEFAULT_LOAD_TIMEOUT_S, MAX_SECONDS, Settings
from packbench.service.dispatcher.rules import overdue
from packbench.service.dispatcher.state import Active, Slot
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool, Slow
from tests.service.screens import dispatcher, protocol_file, rows


def first_worker_hangs_at(index: int):
    return lambda worker, entry: "hang" if worker.index == 0 and entry["index"] == index else None


@pytest.mark.timeout(30)
def test_a_hung_episode_times_out_its_attempt_is_kept_and_the_next_attempt_runs(store, tmp_path):
    """Bug caught: an episode that never replied held its screen `running` with no end."""
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=3))  # 8 episodes
    pool = FakePool(fault=first_worker_hangs_at(3))
    d = dispatcher(store, tmp_path, pool, workers=1, episode_timeout_s=0.3)
    t0 = time.monotonic()
    outcomes = d.run()
    assert time.monotonic() - t0 >= 0.3  # not before the limit
    first, second = store.attempts(screen_id)
    cause = (f"worker worker-1 (pid 1000, node node-0) timed out: no reply to episode 3 (packet) of screen {screen_id} "
             "within 0.3 s (--episode-timeout); the worker was killed")
    assert (first.status, first.error) == ("failed", cause)
    assert rows(store, first.id) == [0, 1, 2]  # what came back before the timeout stays recorded
    assert [e.index for e in ArchiveReader(Path(first.archive_path)).episodes()] == [0, 1, 2]  # its archive kept
    assert second.status == "done" and rows(store, second.id) == list(range(8))
    assert [(o.status, o.screen_status) for o in outcomes] == [("failed", "queued"), ("done", "done")]
    assert pool.workers[0].killed and len(pool.workers) == 2 and pool.workers[1].episodes == list(range(8))


@pytest.mark.timeout(30)
def test_a_screen_that_hangs_in_every_attempt_fails_when_its_attempts_are_spent(store, tmp_path):
    """The retry rules of a dying worker hold: each timed-out attempt is kept, and the screen
    ends `failed` after max_attempts instead of hanging or running again for ever."""
    (screen_id,) = submit(store, protocol_file(tmp_path), max_attempts=2)
    pool = FakePool(fault=lambda worker, entry: "hang" if entry["index"] == 1 else None)
    outcomes = dispatcher(store, tmp_path, pool, workers=1, episode_timeout_s=0.2).run()
    attempts = store.attempts(screen_id)
    assert [a.status for a in attempts] == ["failed", "failed"]
    assert [a.error.split(" timed out: ")[1] for a in attempts] == [
        f"no reply to episode 1 (packet) of screen {screen_id} within 0.2 s (--episode-timeout); the worker was killed"] * 2
    assert [rows(store, a.id) for a in attempts] == [[0], [0]]
    assert store.screen(screen_id).status == "failed"
    assert [o.screen_status for o in outcomes] == ["queued", "failed"]


class DeliversLateReplies(FakePool):
    """A transport that hands over a killed worker's reply already on its way (the fake's own
    `kill` drops them, as RayPool's does)."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.late: list = []  # replies of killed workers handed to the dispatcher

    def kill(self, worker) -> None:
        worker.killed = True

    def wait(self, timeout, *, every=False):
        for reply in super().wait(timeout, every=every):
            if reply.tag.slot.worker.killed:
                self.late.append(reply)
            yield reply


@pytest.mark.timeout(30)
def test_a_reply_that_comes_after_the_timeout_is_not_recorded(store, tmp_path):
    """An episode that answers after its attempt timed out is no result: neither the timed-out
    attempt nor the one that runs the screen again records it."""
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=3))  # 8 episodes
    # Worker 0's episode 1 takes 0.6 s (timed out at about 0.25 s); worker 1 takes 8 x 0.15 s, so
    # both late replies of worker 0 (episodes 1 and 2) come while the second attempt runs.
    pool = DeliversLateReplies(episode_s=0.05, fault=lambda worker, entry: Slow(0.6) if worker.index == 0 and
                               entry["index"] == 1 else Slow(0.15) if worker.index == 1 else None)
    outcomes = dispatcher(store, tmp_path, pool, workers=1, episode_timeout_s=0.2).run()
    first, second = store.attempts(screen_id)
    assert first.status == "failed" and f" timed out: no reply to episode 1 (packet) of screen {screen_id} within 0.2 s" in first.error
    assert [r.tag.kind.value for r in pool.late] == ["episode", "episode"]  # the late replies did come
    assert rows(store, first.id) == [0]
    assert [e.index for e in ArchiveReader(Path(first.archive_path)).episodes()] == [0]
    assert second.status == "done" and rows(store, second.id) == list(range(8))  # each once, none of worker 0's
    assert [o.status for o in outcomes] == ["failed", "done"]


def test_which_episode_is_overdue_is_a_pure_decision():
    slot = Slot(name="w", worker=None)
    entries = [{"index": i, "condition": "c"} for i in range(4)]
    # Episodes 0 and 1 back, 2 running and 3 waiting behind it since t = 10.
    slot.owed, slot.since = entries[2:], 10.0
    assert overdue([slot], now=12.0, limit_s=2.0, load_limit_s=99.0) == []  # at the limit: not yet
    assert overdue([slot], now=12.001, limit_s=2.0, load_limit_s=99.0) == [(slot, entries[2])]
    slot.active = None  # its screen ended (failed) with the episodes still on the worker: still owed
    assert overdue([slot], now=12.001, limit_s=2.0, load_limit_s=99.0) == [(slot, entries[2])]
    slot.owed = []  # every call back: nothing owed (an idle worker is not hung)
    slot.active = Active(slot=slot, run=None, protocol=None, inflight=1)
    assert overdue([slot], now=1e9, limit_s=2.0, load_limit_s=2.0) == []
    load = {"load": True, "screen": 7}  # a load in flight is owed, by its own limit
    slot.owed, slot.since = [load], 20.0
    assert overdue([slot], now=25.0, limit_s=2.0, load_limit_s=5.0) == []
    assert overdue([slot], now=25.001, limit_s=2.0, load_limit_s=5.0) == [(slot, load)]


@pytest.mark.timeout(30)
def test_a_hung_load_times_out_and_the_next_attempt_runs(store, tmp_path):
    """Bug caught: only episodes were timed, so a load that never returned (a read from a hung
    network file system, a conversion stuck in a library) held its screen `running` for ever."""
    (screen_id,) = submit(store, protocol_file(tmp_path))
    pool = FakePool(load_fault=lambda worker: "hang" if worker.index == 0 else None)
    t0 = time.monotonic()
    outcomes = dispatcher(store, tmp_path, pool, workers=1, load_timeout_s=0.3).run()
    assert time.monotonic() - t0 >= 0.3
    first, second = store.attempts(screen_id)
    assert (first.status, first.error) == ("failed", f"worker worker-1 (pid 1000, node node-0) timed out: no reply to "
                                                     f"the load of screen {screen_id} within 0.3 s (--load-timeout); "
                                                     "the worker was killed")
    assert rows(store, first.id) == []
    assert second.status == "done" and pool.workers[0].killed and pool.workers[1].episodes == list(range(4))
    assert [o.status for o in outcomes] == ["failed", "done"]


@pytest.mark.timeout(30)
def test_a_load_longer_than_an_episode_may_be_is_timed_by_its_own_limit(store, tmp_path):
    """A load of 0.5 s under a 0.8 s load limit, with episodes limited to 0.4 s (each 0.25 s, the
    first right after the load), ends `done` in one attempt. Bugs caught: a load judged by the
    episode limit (a real checkpoint's read takes minutes where an episode takes seconds), a
    clock that ran from the load through the first episode, or one never reset after the load."""
    (screen_id,) = submit(store, protocol_file(tmp_path))
    pool = FakePool(load_s=0.5, fault=lambda worker, entry: Slow(0.25) if entry["index"] == 0 else None)
    dispatcher(store, tmp_path, pool, workers=1, episode_timeout_s=0.4, load_timeout_s=0.8).run()
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "done" and rows(store, attempt.id) == list(range(4)) and len(pool.workers) == 1


@pytest.mark.timeout(30)
def test_a_load_queued_behind_episodes_is_timed_from_when_the_worker_begins_it(store, tmp_path):
    """The second screen's load waits on the worker behind the first screen's last episodes; it
    hangs: the cause names that load and that screen, and the first screen is done."""
    first_id, second_id = (*submit(store, protocol_file(tmp_path)), *submit(store, protocol_file(tmp_path)))
    loads = []

    def load_fault(worker):
        loads.append(worker.index)
        return "hang" if len(loads) == 2 else None  # the first worker's second load

    pool = FakePool(load_fault=load_fault)
    outcomes = dispatcher(store, tmp_path, pool, workers=1, load_timeout_s=0.3).run()
    assert store.attempts(first_id)[0].status == "done"
    timed_out, second = store.attempts(second_id)
    assert timed_out.status == "failed" and timed_out.error.endswith(
        f"timed out: no reply to the load of screen {second_id} within 0.3 s (--load-timeout); the worker was killed")
    assert second.status == "done" and [o.status for o in outcomes] == ["done", "failed", "done"]


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("what", ["episode", "load"])
def test_the_setting_refuses_what_is_not_a_time(value, what):
    with pytest.raises(ValueError, match=f"{what} timeout .* must be a finite number > 0"):
        Settings(**{f"{what}_timeout_s": value})


@pytest.mark.parametrize("what, default", [("episode", DEFAULT_EPISODE_TIMEOUT_S), ("load", DEFAULT_LOAD_TIMEOUT_S)])
def test_the_setting_from_the_environment(what, default):
    field, variable = f"{what}_timeout_s", f"PACKBENCH_{what.upper()}_TIMEOUT_S"
    assert getattr(Settings(), field) == getattr(Settings.from_environ({}), field) == default
    assert getattr(Settings.from_environ({variable: "0.5"}), field) == 0.5
    for text in ("0", "-3", "ten", "inf", "nan"):
        with pytest.raises(PackbenchError) as e:
            Settings.from_environ({variable: text})
        assert str(e.value) == (f"{variable}={text!r} is not a number of seconds in "
                                f"(0, {MAX_SECONDS}]; set it to one or unset it")


@pytest.mark.timeout(60)
def test_submit_wait_takes_the_option_and_says_the_attempt_timed_out(tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from packbench.cli.main import app
    from packbench.db.store import Store

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    with Store(url) as s:
        s.upgrade()
    monkeypatch.setitem(sys.modules, "packbench.cluster.pool",
                        SimpleNamespace(RayPool=lambda settings: FakePool(fault=first_worker_hangs_at(2))))
    monkeypatch.setattr("packbench.service.dispatcher.loop.source_freeze", lambda: {"git_commit": "test"})
    out = CliRunner().invoke(app, ["--episode-timeout", "0.25", "submit", str(protocol_file(tmp_path)), "--wait",
                                   "--db", url, "--archive-dir", str(tmp_path / "archives")])
    assert out.exit_code == 0, out.output  # the second attempt, on the replacement worker, ran the screen
    assert ("attempt 1 failed: worker worker-1 (pid 1000, node node-0) timed out: no reply to episode 2 "
            "(dense-stream) of screen 1 within 0.25 s (--episode-timeout); the worker was killed; screen 1 queued for attempt 2"
            in out.output)
    assert "screen 1: done; archive: " in out.output


@pytest.mark.timeout(30)
def test_an_episode_left_on_the_worker_by_a_failed_screen_is_timed(store, tmp_path):
    """Bug caught: the clock was the screen's, so a screen that failed (an episode call raised)
    while its look-ahead episode was still on the worker stopped timing it; that episode hung,
    the next screen's load queued behind it never came back, and that screen stayed `running`
    for ever. The worker owes the episode whatever became of its screen: it is timed."""
    first_id, second_id = (*submit(store, protocol_file(tmp_path)), *submit(store, protocol_file(tmp_path)))

    def fault(worker, entry):
        if worker.index == 0 and entry["index"] == 1:
            return RuntimeError("the episode call raised")
        return "hang" if worker.index == 0 and entry["index"] == 2 else None

    outcomes = dispatcher(store, tmp_path, FakePool(fault=fault), workers=1, episode_timeout_s=0.3).run()
    assert store.attempts(first_id)[0].status == "failed"
    (timed_out, second) = store.attempts(second_id)
    assert (timed_out.status, rows(store, timed_out.id)) == ("failed", [])
    # the episode that hung was the failed screen's, and the cause says whose
    assert f" timed out: no reply to episode 2 (dense-stream) of screen {first_id} within 0.3 s" in timed_out.error
    assert second.status == "done"
    assert [o.status for o in outcomes][-1] == "done"
