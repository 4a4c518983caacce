"""The dispatcher (service/dispatcher/) against an in-process fake pool (tests/service/fake_pool.py):
claims, look-ahead, two workers, a worker dying, cancels and lease renewal, on a real SQLite
database and real archives, with no Ray at all. The transport itself runs for real in
tests/cluster/test_dispatch.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from packbench.core.archive import ArchiveReader
from packbench.service.dispatcher.state import Moment, Stop
from packbench.service.submit import submit
from tests.service.screens import dispatcher, protocol_file, rows
from tests.service.fake_pool import FakePool

ROOT = Path(__file__).resolve().parents[2]


def test_the_dispatcher_imports_no_ray():
    """Dispatching is plain Python: importing it and its fake pool brings no ray (nor torch)."""
    code = ("import sys, packbench.service.dispatcher, tests.service.fake_pool; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch', 'cluster')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "[]"


def test_one_screen_is_claimed_and_run_to_completion(store, tmp_path):
    (screen_id,) = submit(store, protocol_file(tmp_path))
    pool = FakePool()
    d = dispatcher(store, tmp_path, pool)
    (outcome,) = d.run()
    assert pool.connected and outcome.status == "done" and outcome.screen_id == screen_id
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "done" and store.screen(screen_id).status == "done"
    assert attempt.model_state == "cold" and attempt.node == "node-0"
    assert rows(store, attempt.id) == [0, 1, 2, 3]  # every planned episode once, in plan order
    reader = ArchiveReader(Path(attempt.archive_path))
    assert reader.complete and reader.verify() == [] and [e.index for e in reader.episodes()] == [0, 1, 2, 3]
    assert pool.workers[0].killed and pool.in_flight() == 0  # the pool is shut down with the dispatcher
    assert "worker-1 ready on fake-host (fake-gpu, node node-0)" in d.said


def test_nothing_queued_starts_no_pool(store, tmp_path):
    pool = FakePool()
    assert dispatcher(store, tmp_path, pool).run() == [] and not pool.connected and not pool.workers


def test_two_workers_two_screens(store, tmp_path):
    ids = submit(store, protocol_file(tmp_path, prompts=2), replicas=2)
    pool = FakePool(gpus=2, episode_s=0.01)
    outcomes = dispatcher(store, tmp_path, pool, look_ahead=False).run()
    assert sorted(o.screen_id for o in outcomes) == ids and {o.status for o in outcomes} == {"done"}
    attempts = [store.latest_attempt(i) for i in ids]
    assert {a.node for a in attempts} == {"node-0", "node-1"}  # one screen per worker, side by side
    assert all(rows(store, a.id) == list(range(6)) for a in attempts)
    assert sorted(len(w.episodes) for w in pool.workers) == [6, 6]


def test_a_worker_claims_its_next_screen_while_its_last_episodes_run(store, tmp_path):
    ids = submit(store, protocol_file(tmp_path), replicas=3)
    events = []
    pool = FakePool(episode_s=0.005)
    outcomes = dispatcher(store, tmp_path, pool, workers=1, observer=events.append).run()
    assert [o.screen_id for o in outcomes] == ids and {o.status for o in outcomes} == {"done"}
    attempts = [store.latest_attempt(i) for i in ids]
    for earlier, later in zip(attempts, attempts[1:]):
        assert later.started_at < earlier.finished_at  # claimed before the previous one ended
        assert later.worker == earlier.worker and not later.shared_node
    assert [state for _, state in pool.loads] == ["cold", "warm", "warm"]  # one worker keeps its model
    assert all(rows(store, a.id) == [0, 1, 2, 3] for a in attempts)
    # The observer hears each attempt's claim, load, first episodes out and every record.
    by_attempt = {}
    for e in events:
        by_attempt.setdefault(e.run.attempt.id, []).append(e.moment)
    assert sorted(by_attempt) == [a.id for a in attempts]
    assert all(m[:3] == [Moment.CLAIMED, Moment.LOADED, Moment.FIRST_OUT] and m[3:] == [Moment.RECORDED] * 4
               for m in by_attempt.values())


def test_a_worker_dying_mid_screen_fails_its_attempt_and_the_screen_runs_again(store, tmp_path):
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=3))  # 8 episodes
    pool = FakePool(fault=lambda worker, entry: "die" if worker.index == 0 and entry["index"] == 3 else None)
    d = dispatcher(store, tmp_path, pool, workers=1)
    outcomes = d.run()
    first, second = store.attempts(screen_id)
    assert first.status == "failed" and "worker worker-1 (pid 1000, node node-0) died" in first.error
    assert second.status == "done" and rows(store, second.id) == list(range(8))
    assert rows(store, first.id) == [0, 1, 2]  # what came back before the death stays recorded
    assert ArchiveReader(Path(first.archive_path)).episodes()  # its partial archive is kept
    assert [(o.status, o.screen_status) for o in outcomes] == [("failed", "queued"), ("done", "done")]
    assert len(pool.workers) == 2 and pool.workers[0].killed  # a replacement was started


def test_a_failing_call_fails_the_screen_and_the_worker_lives(store, tmp_path):
    from packbench.core.errors import PackbenchError

    (bad, good) = submit(store, protocol_file(tmp_path), replicas=2)
    pool = FakePool(fault=lambda worker, entry: PackbenchError("broken checkpoint; fix it")
                    if not worker.episodes and entry["index"] == 0 else None)
    outcomes = dispatcher(store, tmp_path, pool, workers=1, look_ahead=False).run()
    assert [(o.screen_id, o.status, o.bad_input) for o in outcomes] == [(bad, "failed", True), (good, "done", False)]
    assert "PackbenchError: broken checkpoint; fix it" in store.latest_attempt(bad).error
    assert len(pool.workers) == 1


def test_cancel_a_queued_and_a_running_screen(store, tmp_path):
    (never,) = submit(store, protocol_file(tmp_path), priority=-1)
    store.cancel_screen(never)
    (running,) = submit(store, protocol_file(tmp_path, prompts=20))  # 42 episodes
    pool = FakePool(episode_s=0.005)

    def cancel_after_two(event):
        if event.moment is Moment.RECORDED and len(event.run.episodes) == 2 and pool.episode_s < 0.05:
            store.cancel_screen(running)
            pool.episode_s = 0.05  # what is left would take 2 s: the cancel is seen long before

    # A renewal every 0.4 s sees the cancel; a lease of 1.2 s is not lost on a loaded machine.
    d = dispatcher(store, tmp_path, pool, workers=1, lease_s=1.2, observer=cancel_after_two)
    (outcome,) = d.run()
    assert outcome.screen_id == running and outcome.status == "cancelled"
    assert store.screen(never).status == "cancelled" and store.attempts(never) == []
    (attempt,) = store.attempts(running)
    assert attempt.status == "cancelled" and attempt.error == "cancelled by the user"
    done = rows(store, attempt.id)
    assert 2 <= len(done) < 42 and done == list(range(len(done)))  # stopped after the episodes in flight
    assert f"screen {running}: {Stop.CANCELLED}; stopping after the episode in flight" in d.said


def test_leases_are_renewed_while_a_screen_runs(store, tmp_path):
    """A screen running for several lease lengths keeps its one attempt: renewed every third of
    a lease, never reaped (a reaper of another dispatcher would mark it lost)."""
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=8))  # 18 episodes of 40 ms: 0.72 s
    renewals: list[tuple[float, bool]] = []
    real = store.renew_lease

    def renew(attempt_id, lease_s):
        renewals.append((time.monotonic(), real(attempt_id, lease_s)))
        return renewals[-1][1]

    store.renew_lease = renew
    (outcome,) = dispatcher(store, tmp_path, FakePool(episode_s=0.04), workers=1, lease_s=0.6).run()
    (attempt,) = store.attempts(screen_id)  # never reaped: its own reaper would have made it lost
    assert outcome.status == "done" and attempt.status == "done"
    assert len(renewals) >= 3 and all(granted for _, granted in renewals)  # every 0.2 s over about 0.72 s
    assert max(b - a for (a, _), (b, _) in zip(renewals, renewals[1:])) < 0.6


def test_the_parts_keep_no_state_of_their_own(store, tmp_path):
    """One owner: every part holds the dispatcher's State and its collaborators, nothing it
    changes; a run (claims, a worker dying, a replacement, episodes, ends) leaves each part's
    attributes the very objects they were."""
    submit(store, protocol_file(tmp_path, prompts=2), replicas=2)
    pool = FakePool(fault=lambda worker, entry: "die" if worker.index == 0 and entry["index"] == 2 else None)
    d = dispatcher(store, tmp_path, pool, workers=1)
    parts = {"claims": d.claims, "lifecycle": d.lifecycle, "upkeep": d.upkeep, "fleet": d.fleet, "watch": d.watch}
    before = {name: dict(vars(part)) for name, part in parts.items()}
    for name, attributes in before.items():
        assert attributes["state"] is d.state, name
        assert not [k for k, v in attributes.items() if isinstance(v, (list, set, bytearray))], name
    outcomes = d.run()
    assert [o.status for o in outcomes] == ["failed", "done", "done"]  # it did run: a death, a requeue, two ends
    for name, part in parts.items():
        assert vars(part).keys() == before[name].keys(), name
        assert all(v is before[name][k] for k, v in vars(part).items()), name


def test_a_full_archive_disk_fails_the_screen_that_hit_it_not_the_queue(store, tmp_path, monkeypatch):
    """Two workers claim two screens in one turn; the archive disk is full: the first screen's
    attempt fails (its screen queued again), the second claim is given back unharmed (no
    attempt used), the third screen is never claimed, and the dispatcher stops saying why."""
    import errno

    import packbench.core.archive.writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packbench.core.archive.writer, "_write_at", full)
    first, second, third = submit(store, protocol_file(tmp_path), replicas=3)
    d = dispatcher(store, tmp_path, FakePool(gpus=2), look_ahead=False)
    (outcome,) = d.run()
    assert (outcome.screen_id, outcome.status, outcome.storage, outcome.bad_input) == (first, "failed", True, False)
    assert d.stopping == "archive" and d.fatal.startswith("the archive storage failed: could not create archive")
    assert [s.status for s in map(store.screen, (first, second, third))] == ["queued"] * 3
    assert [a.status for a in store.attempts(second)] == ["interrupted"] and store.screen(second).attempts_used == 0
    assert store.attempts(third) == [] and store.screen(first).attempts_used == 1


def test_the_dispatcher_runs_its_screens_with_what_it_started_with_frozen_out_of_the_collector(store, tmp_path):
    """The driver's full collections (60-260 ms on a 2-core host, over Ray's and the
    libraries' objects) took a core from the worker mid-episode at a fixed episode count. While it
    dispatches, what was alive when it connected is frozen (a full collection scans only what
    screens made since); when it stops, nothing of it stays frozen."""
    import gc

    submit(store, protocol_file(tmp_path))
    frozen_at_episodes: list[int] = []

    class Watching(FakePool):
        def run(self, worker, tag, entry, prompt):
            frozen_at_episodes.append(gc.get_freeze_count())
            super().run(worker, tag, entry, prompt)

    before = gc.get_freeze_count()
    (outcome,) = dispatcher(store, tmp_path, Watching()).run()
    assert outcome.status == "done" and len(frozen_at_episodes) == 4
    assert min(frozen_at_episodes) > before + 1000  # the interpreter's own objects and more
    assert gc.get_freeze_count() == 0


def test_a_signing_key_the_database_lacks_is_registered_so_its_screens_audit(store, tmp_path):
    """Bug caught: a dispatcher whose --signing-key was not registered in its database (made by
    `keys init --no-db`, or for another database) signed every archive and recorded the signer, and
    every later `audit SCREEN` checked the signature against the key the database names, found
    none, and called each screen DISAGREE ("valid, but by key ..., which is not trusted here").
    The dispatcher now registers its key's public half as this deployment's own, and says so; a
    key already registered is left as it is (its name and locality kept)."""
    from packbench.core.provenance import generate_key
    from packbench.core.settings import Settings
    from packbench.service.audit import audit_screens
    from packbench.service.dispatcher import Dispatcher

    key, _, key_id = generate_key(tmp_path / "deploy.pem")
    (screen_id,) = submit(store, protocol_file(tmp_path))
    said = []
    d = Dispatcher(store, Settings(archive_dir=tmp_path / "archives", signing_key=key), FakePool(), lease_s=30,
                   progress=lambda message, **event: said.append(message))
    (outcome,) = d.run()
    assert outcome.status == "done" and store.latest_attempt(screen_id).signer_key_id == key_id
    (audit,) = audit_screens(store, [screen_id])
    assert audit.result == "agree", audit.report.problems
    assert audit.report.record["signature"] == {"status": "valid", "key_id": key_id}
    (signer,) = store.signers()
    assert (signer.key_id, signer.name, signer.local) == (key_id, "deploy.pem (--signing-key at dispatch)", True)
    assert signer.public_key == d.signer.public_raw.hex()
    assert (f"registered signing key {key_id} as this deployment's own ('deploy.pem (--signing-key at dispatch)'): "
            f"audits of the archives it signs check their signatures against it") in said
    # A second dispatcher with the key, now registered, registers nothing and says nothing of it.
    store.put_signer(key_id="0" * 16, public_key="11" * 32, name="another", local=False)
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=2))
    said.clear()
    d = Dispatcher(store, Settings(archive_dir=tmp_path / "archives", signing_key=key), FakePool(), lease_s=30,
                   progress=lambda message, **event: said.append(message))
    (outcome,) = d.run()
    assert outcome.status == "done" and [s.key_id for s in store.signers()] == [key_id, "0" * 16]
    assert not any("registered signing key" in m for m in said)
