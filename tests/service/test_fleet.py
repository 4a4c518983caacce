"""The dispatcher's workers (service/dispatcher/fleet.py) on the in-process fake pool: started,
placed, refused, lost and replaced; no database, no Ray."""

from __future__ import annotations

from packbench.service.dispatcher.fleet import DEAD_ON_ARRIVAL_MAX, Fleet
from packbench.service.dispatcher.state import Active, Slot, State
from tests.service.fake_pool import FakePool


def fleet(gpus: int = 2, planned: int | None = None) -> tuple[Fleet, FakePool, list[str]]:
    said: list[str] = []
    pool = FakePool(gpus=gpus)
    return Fleet(State(), pool, planned=planned, progress=said.append), pool, said


def place_all(f: Fleet, pool: FakePool) -> None:
    for reply in pool.wait(0.0, every=True):
        f.placed(reply.tag.slot, reply.value)


def test_one_worker_per_gpu_each_ready_once_placed():
    f, pool, said = fleet(gpus=2)
    f.start()
    assert [s.name for s in f.state.slots] == ["worker-1", "worker-2"] and not f.state.ready()
    place_all(f, pool)
    assert [s.node for s in f.state.ready()] == ["node-0", "node-1"]  # the pool's node ids, not hostnames
    assert f.state.slots[0].gpu_type == "FAKE" and said[0] == "worker-1 ready on fake-host (fake-gpu, node node-0)"


def test_a_second_worker_on_one_gpu_is_refused():
    """Two workers on one physical GPU would contaminate each other's measurements."""
    f, pool, _ = fleet(gpus=1, planned=2)
    f.start()
    first, second = f.state.slots
    f.placed(first, {**pool.workers[0].env})
    f.placed(second, {**pool.workers[1].env, "gpu_uuid": pool.workers[0].env["gpu_uuid"],
                      "node_id": first.node})
    assert f.state.slots == [first] and pool.workers[1].killed


def test_a_worker_whose_gpu_another_cluster_holds_is_refused_and_said():
    f, pool, _ = fleet(gpus=1)
    f.start()
    f.placed(f.state.slots[0], {**pool.workers[0].env, "gpu_busy": "GPU 0 is held by pid 77 (another cluster)"})
    assert f.state.slots == [] and f.state.refusals == ["GPU 0 is held by pid 77 (another cluster)"]


def test_a_lost_worker_hands_back_its_screens_and_is_replaced():
    f, pool, _ = fleet(gpus=1)
    f.start()
    place_all(f, pool)
    (slot,) = f.state.slots
    slot.active = Active(slot=slot, run=None, protocol=None)
    slot.next = Active(slot=slot, run=None, protocol=None)
    held = slot.screens()
    cause, lost = f.lose(slot, "died: RuntimeError: segfault", stopping=False)
    assert cause.startswith("worker worker-1 (pid 1000, node node-0) died: RuntimeError: segfault")
    assert lost == held and slot.active is None and slot.next is None  # nothing promoted onto a dead worker
    assert [s.name for s in f.state.slots] == ["worker-2"] and pool.workers[0].killed


def test_no_replacement_while_stopping_and_none_after_workers_keep_dying_unready():
    f, pool, _ = fleet(gpus=1)
    f.start()
    f.lose(f.state.slots[0], "died: RuntimeError: x", stopping=True)
    assert f.state.slots == []  # stopping: not replaced
    f.add()
    for _ in range(DEAD_ON_ARRIVAL_MAX - 1):  # never ready: each death counts
        f.lose(f.state.slots[0], "died: RuntimeError: bad install", stopping=False)
    assert f.state.slots == [] and "workers died before they were ready" in f.state.refusals[-1]


def test_a_worker_never_placed_is_dropped_after_the_timeout():
    f, pool, _ = fleet(gpus=1)
    f.start()
    f.state.slots[0].placing_since -= 10
    f.drop_unplaced(30.0)
    assert len(f.state.slots) == 1
    f.drop_unplaced(5.0)
    assert f.state.slots == [] and pool.workers[0].killed


def test_slots_describe_themselves_for_the_heartbeat():
    slot = Slot(name="w", worker=None, env={"host": "h", "gpu": "H200", "gpu_index": "3,4", "node_id": "n"})
    assert slot.describe() == {"name": "w", "node": "n", "host": "h", "gpu": "H200", "gpu_index": 3, "state": "idle"}
