"""A claimed screen's life on its worker (service/dispatcher/lifecycle.py), driven reply by reply
on the fake pool with a real SQLite queue and real archives: started, loaded, its episodes out
one ahead and recorded, ended; and what a full archive disk ends (that screen, nothing more)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import packbench.core.archive.writer
from packbench.core.archive import ArchiveReader
from packbench.core.errors import ArchiveError, ArchiveStorageError
from packbench.service.dispatcher.lifecycle import Lifecycle
from packbench.service.dispatcher.outage import OutageWatch
from packbench.service.dispatcher.state import LOOKAHEAD, CallKind, Slot, State
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool
from tests.service.screens import protocol_file


def lifecycle(store, pool: FakePool) -> Lifecycle:
    state = State(id=store.register_dispatcher("d", "fake-host", pid=None))
    watch = OutageWatch(state, store, follow=False, lease_s=30, progress=lambda *a, **k: None)
    return Lifecycle(state, store, pool, watch, freeze={}, signer=None, model_cache=None,
                     progress=lambda *a, **k: None, on_outcome=lambda o: None, observer=None)


def worker(life: Lifecycle, pool: FakePool) -> Slot:
    slot = Slot(name="worker-1", worker=None)
    slot.worker = pool.start_worker(None, pool_size=1)
    slot.env = pool.workers[-1].env
    pool.pending.clear()  # its description: the fleet's business, not this part's
    life.state.slots.append(slot)
    return slot


def claim(store, tmp_path, state: State, screen_id: int | None = None):
    return store.claim_screen(state.id, lease_s=30, archive_dir=str(tmp_path / "archives"), source_freeze={},
                              screen_id=screen_id)


def drain(life: Lifecycle, pool: FakePool) -> list[CallKind]:
    seen = []
    while pool.in_flight():
        for reply in pool.wait(1.0):
            seen.append(reply.tag.kind)
            life.reply(reply.tag, reply)
    return seen


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_screen_runs_from_its_start_to_its_end(store, tmp_path):
    (screen_id,) = submit(store, protocol_file(tmp_path))  # 4 episodes
    pool = FakePool()
    life = lifecycle(store, pool)
    slot = worker(life, pool)
    active = life.start(slot, claim(store, tmp_path, life.state))
    assert slot.active is active and [p.tag.kind for p in pool.pending] == [CallKind.LOAD]
    assert Path(active.run.archive_path).is_file()  # opened before the load goes out
    assert drain(life, pool) == [CallKind.LOAD] + [CallKind.EPISODE] * 4
    (outcome,) = life.state.outcomes
    assert outcome.status == "done" and slot.active is None and active.ended
    assert ArchiveReader(Path(outcome.archive_path)).complete
    assert [e.plan_index for e in store.episodes(outcome.attempt_id)] == [0, 1, 2, 3]


def test_episodes_go_out_one_ahead(store, tmp_path):
    submit(store, protocol_file(tmp_path, prompts=3))  # 8 episodes
    pool = FakePool()
    life = lifecycle(store, pool)
    slot = worker(life, pool)
    active = life.start(slot, claim(store, tmp_path, life.state))
    (load,) = list(pool.wait(1.0))
    life.reply(load.tag, load)
    assert active.submitted == LOOKAHEAD and active.inflight == LOOKAHEAD  # one running, one waiting
    first = next(pool.wait(1.0))  # replies are taken as they are iterated: the other stays in flight
    life.reply(first.tag, first)
    assert active.submitted == LOOKAHEAD + 1 and active.run.done_count == 1


def test_a_screen_claimed_behind_takes_the_worker_when_the_first_ends(store, tmp_path):
    first_id, second_id = submit(store, protocol_file(tmp_path), replicas=2)
    pool = FakePool()
    life = lifecycle(store, pool)
    slot = worker(life, pool)
    first = life.start(slot, claim(store, tmp_path, life.state, first_id))
    second = life.start(slot, claim(store, tmp_path, life.state, second_id), queued=True)
    assert slot.active is first and slot.next is second
    drain(life, pool)
    assert [(o.screen_id, o.status) for o in life.state.outcomes] == [(first_id, "done"), (second_id, "done")]
    assert slot.active is None and slot.next is None


def test_a_full_disk_at_the_start_fails_that_screen_only_and_stops_the_claims(store, tmp_path, monkeypatch):
    """That attempt fails, its screen is queued again (the cause is the storage's, not the
    screen's), and the dispatcher claims nothing more. The bug caught: every queued screen
    failed within seconds, as bad input (exit 2), each naming an archive never created."""
    first_id, second_id = submit(store, protocol_file(tmp_path), replicas=2)
    pool = FakePool()
    life = lifecycle(store, pool)
    slot = worker(life, pool)
    c = claim(store, tmp_path, life.state, first_id)
    monkeypatch.setattr(packbench.core.archive.writer, "_write_at", full_disk)
    life.start(slot, c)
    (outcome,) = life.state.outcomes
    assert outcome.status == "failed" and outcome.storage and not outcome.bad_input
    assert "No space left on device" in outcome.error and outcome.screen_status == "queued"
    assert not Path(c.attempt.archive_path).exists()  # no empty archive left behind
    assert pool.in_flight() == 0  # no load was sent for it
    assert life.state.stopping == "archive" and "the archive storage failed" in life.state.fatal
    assert store.screen(second_id).status == "queued" and store.attempts(second_id) == []


@pytest.mark.parametrize("error, storage", [
    (ArchiveStorageError("could not append member x to archive a.zip (No space left on device)"), True),
    (ArchiveError("an archive already exists at a.zip; results are never overwritten"), False),
])
def test_an_archive_refusal_mid_screen(store, tmp_path, error, storage):
    """The storage's refusal requeues the screen and stops the claims (exit 74); any other
    refusal of the archive is the input's (exit 2), and the dispatcher goes on."""
    submit(store, protocol_file(tmp_path))
    pool = FakePool()
    life = lifecycle(store, pool)
    slot = worker(life, pool)
    active = life.start(slot, claim(store, tmp_path, life.state))

    def refused(active, value):
        raise error

    life.guarded(active, refused, {})
    (outcome,) = life.state.outcomes
    assert (outcome.storage, outcome.bad_input) == (storage, not storage)
    assert outcome.screen_status == ("queued" if storage else "failed")
    assert (life.state.stopping == "archive") is storage
