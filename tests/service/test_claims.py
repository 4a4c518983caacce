"""Claims (service/dispatcher/claims.py): which worker claims which screen, on a real SQLite
queue; nothing is started (that is lifecycle.py's), no pool call is made."""

from __future__ import annotations

from packbench.service.dispatcher.claims import Claims
from packbench.service.dispatcher.state import Active, Slot, State
from packbench.service.submit import submit
from tests.service.fake_pool import FakeWorker
from tests.service.screens import protocol_file


def ready_slot(index: int) -> Slot:
    worker = FakeWorker(index=index, node=f"node-{index}")
    return Slot(name=f"worker-{index + 1}", worker=worker, env=worker.env)


def claims(store, tmp_path, *slots: Slot, **options) -> Claims:
    state = State(slots=list(slots), id=store.register_dispatcher("d", "fake-host", pid=None))
    options = {"only_screen": None, "look_ahead": True, **options}
    return Claims(state, store, archive_dir=str(tmp_path / "archives"), lease_s=30, freeze={}, **options)


def test_each_idle_worker_claims_one_screen_in_queue_order(store, tmp_path):
    ids = submit(store, protocol_file(tmp_path), replicas=3)
    c = claims(store, tmp_path, ready_slot(0), ready_slot(1))
    got = c.fill()
    assert [(g.slot.name, g.claim.screen.id, g.queued) for g in got] == [("worker-1", ids[0], False),
                                                                      ("worker-2", ids[1], False)]
    attempt = store.latest_attempt(ids[0])
    assert attempt.status == "running" and attempt.node == "node-0" and attempt.machine_id is not None
    assert store.screen(ids[2]).status == "queued"


def test_a_worker_still_being_placed_claims_nothing(store, tmp_path):
    submit(store, protocol_file(tmp_path))
    placing = ready_slot(0)
    placing.placing_since = 0.0
    assert claims(store, tmp_path, placing).fill() == []


def test_look_ahead_once_the_last_episodes_are_out_and_only_once(store, tmp_path):
    first, second = submit(store, protocol_file(tmp_path), replicas=2)
    slot = ready_slot(0)
    c = claims(store, tmp_path, slot)
    (claimed,) = c.fill()
    slot.active = active = Active(slot=slot, run=_Run(claimed.claim.attempt), protocol=None, entries=[{}, {}])
    assert c.fill() == []  # episodes still to hand out: no look-ahead yet
    active.submitted = 2
    (ahead,) = c.fill()
    assert ahead.queued and ahead.claim.screen.id == second and active.looked_ahead
    assert c.fill() == []  # tried once per screen: an empty queue is not polled every turn


def test_only_screen_claims_that_screen_and_never_looks_ahead(store, tmp_path):
    other, wanted = submit(store, protocol_file(tmp_path), replicas=2)
    slot = ready_slot(0)
    c = claims(store, tmp_path, slot, only_screen=wanted)
    (claimed,) = c.fill()
    assert claimed.claim.screen.id == wanted
    slot.active = Active(slot=slot, run=_Run(claimed.claim.attempt), protocol=None, entries=[{}], submitted=1)
    assert c.fill() == [] and store.screen(other).status == "queued"


class _Run:
    def __init__(self, attempt) -> None:
        self.attempt = attempt
