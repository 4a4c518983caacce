"""The upkeep (service/dispatcher/upkeep.py) on a real SQLite queue: leases renewed (a refusal
stops a screen), reaped (a holder on this host judged by its process), heartbeats on a clock,
and no reaping for one lease after an outage. No pool, no Ray."""

from __future__ import annotations

import platform
import time

from packbench.service.dispatcher.state import Active, Slot, State, Stop
from packbench.service.dispatcher.upkeep import Upkeep
from packbench.service.submit import submit
from tests.service.screens import protocol_file


class _Run:
    def __init__(self, claim) -> None:
        self.attempt, self.screen = claim.attempt, claim.screen


def upkeep(store, *, alive=lambda pid, started_at: True, lease_s: float = 30) -> tuple[Upkeep, list[str]]:
    said: list[str] = []
    state = State(id=store.register_dispatcher("me", platform.node(), pid=1))
    return Upkeep(state, store, lease_s=lease_s, progress=said.append, alive=alive), said


def held(u: Upkeep, store, screen_id: int, *, lease_s: float = 30) -> Active:
    claim = store.claim_screen(u.state.id, lease_s=lease_s, archive_dir="/archives", source_freeze={},
                               screen_id=screen_id)
    slot = Slot(name="w", worker=None, env={"node_id": "n"})
    slot.active = Active(slot=slot, run=_Run(claim), protocol=None)
    u.state.slots.append(slot)
    return slot.active


def test_a_cancel_stops_the_screen_after_what_is_in_flight(store, tmp_path):
    a_id, b_id = submit(store, protocol_file(tmp_path), replicas=2)
    u, said = upkeep(store)
    idle, busy = held(u, store, a_id), held(u, store, b_id)
    busy.inflight = 1
    store.cancel_screen(a_id)
    store.cancel_screen(b_id)
    assert u.renew(u.state.screens()) == [idle]  # nothing in flight: it ends now; `busy` when its episode is back
    assert idle.stop is busy.stop is Stop.CANCELLED
    assert said == [f"screen {a_id}: cancelled; stopping after the episode in flight",
                    f"screen {b_id}: cancelled; stopping after the episode in flight"]


def test_a_reaped_attempt_stops_as_lost(store, tmp_path):
    (screen_id,) = submit(store, protocol_file(tmp_path))
    u, _ = upkeep(store)
    active = held(u, store, screen_id, lease_s=0.001)
    store.reap_expired()  # another dispatcher's reaper, its holder being elsewhere
    assert u.renew([active]) == [active] and active.stop is Stop.LOST


def test_tick_runs_on_a_clock_and_heartbeats(store, tmp_path):
    u, _ = upkeep(store, lease_s=30)
    assert u.tick() == []  # due at once
    assert u.tick() is None  # then every third of a lease, at most 2 s
    assert 1.9 < u.state.next_upkeep - time.monotonic() <= 2.0
    (me,) = [d for d in store.dispatchers() if d.id == u.state.id]
    assert me.heartbeat_at > me.started_at


def test_reaping_spares_a_live_holder_here_and_takes_a_dead_one_at_once(store, tmp_path):
    """The bugs caught: a new `dispatch` reaped a live `dispatch --follow` on the same host
    after an outage longer than the lease; a SIGKILLed driver's screen stayed held for its lease."""
    live_screen, dead_screen = submit(store, protocol_file(tmp_path), replicas=2)
    host = platform.node()
    live = store.register_dispatcher("live", host, pid=101)
    dead = store.register_dispatcher("dead", host, pid=202)
    store.claim_screen(live, lease_s=0.001, archive_dir="/a", source_freeze={}, screen_id=live_screen)
    store.claim_screen(dead, lease_s=600, archive_dir="/a", source_freeze={}, screen_id=dead_screen)
    u, said = upkeep(store, alive=lambda pid, started_at: pid == 101)
    u.reap()
    assert store.latest_attempt(live_screen).status == "running"
    assert store.latest_attempt(dead_screen).status == "lost" and store.screen(dead_screen).status == "queued"
    # The attempt's number within its screen (1), not its row id (2, the live screen's attempt being 1):
    # the bug caught said "attempt 2 lost" of a screen whose only attempt is 1 (seen after a SIGKILLed
    # `submit --wait` of a second screen).
    lost = store.latest_attempt(dead_screen)
    assert (lost.number, lost.id) == (1, 2)
    assert said == [f"screen {dead_screen}: attempt 1 lost (its dispatcher (pid 202 on {host}) is gone), screen queued"]


def test_no_reaping_for_one_lease_after_an_outage(store, tmp_path):
    (screen_id,) = submit(store, protocol_file(tmp_path))
    other = store.register_dispatcher("other", "elsewhere", pid=5)
    store.claim_screen(other, lease_s=0.001, archive_dir="/a", source_freeze={})
    u, _ = upkeep(store)
    u.after_outage()  # the other dispatcher waited out the same outage: it gets a lease to renew
    u.tick()
    assert store.latest_attempt(screen_id).status == "running"
    u.state.no_reap_until = u.state.next_upkeep = 0.0
    u.tick()
    assert store.latest_attempt(screen_id).status == "lost"
