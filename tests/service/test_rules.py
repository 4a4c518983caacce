"""The dispatcher's pure decisions (service/dispatcher/rules.py): values in, values out."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from packbench.service.dispatcher.rules import SILENT_AFTER_S, held_by_silent, unplaceable_reason
from packbench.service.dispatcher.state import Slot


def slot(node: str, gpu_type: str | None = "H200", **resources: float) -> Slot:
    return Slot(name=node, worker=None, env={"node_id": node}, gpu_type=gpu_type, resources=resources)


def queued(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"gpu_type": None, "placement_node": None, "needs": {}, "replica_group": None, **fields})


def test_why_no_worker_can_take_a_screen():
    ready = [slot("n1"), slot("n2", "B200", disk=2.0)]
    never = lambda group: []  # noqa: E731
    assert unplaceable_reason(queued(), ready, replica_nodes=never) is None
    assert unplaceable_reason(queued(gpu_type="A100"), ready, replica_nodes=never) == (
        "needs GPU type A100; this cluster's workers have B200, H200")
    assert unplaceable_reason(queued(placement_node="n9"), ready, replica_nodes=never) == (
        "needs node n9, which has no worker")
    assert unplaceable_reason(queued(needs={"disk": 1.0}), ready, replica_nodes=never) is None
    assert unplaceable_reason(queued(needs={"disk": 3.0}), ready, replica_nodes=never).startswith(
        "needs Ray resources {disk: 3} on one node; no node with a worker declares them (declared: disk: 2)")
    assert unplaceable_reason(queued(replica_group="g"), ready, replica_nodes=lambda g: ["n1", "n2"]) == (
        "its replicas need distinct nodes; the cluster has 2 with workers")


def test_only_silent_dispatchers_are_named():
    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    running = [SimpleNamespace(screen_id=i, attempt=1, dispatcher=f"d{i}", lease_expires_at=now + timedelta(seconds=30))
               for i in (1, 2)]
    dispatchers = [SimpleNamespace(name="d1", host="far", pid=5, heartbeat_at=now - timedelta(seconds=SILENT_AFTER_S + 1)),
                   SimpleNamespace(name="d2", host="far", pid=6, heartbeat_at=now)]
    (line,) = held_by_silent(SimpleNamespace(now=now, running=running, dispatchers=dispatchers), host="here",
                             alive=lambda pid: True)
    assert line.startswith("screen 1 is held by dispatcher d1 (no heartbeat for 11 s): attempt 1's lease expires")


def test_a_silent_holder_whose_process_lives_here_is_named_with_the_way_out():
    """Bug caught: a `dispatch` SIGSTOPped (hung) on this host held its screen with no heartbeat,
    and `dispatch` said "a `packbench dispatch` after that [lease] marks the attempt lost and runs
    the screen again"; but a holder whose process lives on this host is never reaped
    (db/queue.py reap_expired), so every later `dispatch` said it again and the screen stayed
    running. The line now names the process and how to free the screen."""
    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    running = [SimpleNamespace(screen_id=i, attempt=2, dispatcher=f"d{i}", lease_expires_at=now - timedelta(seconds=5))
               for i in (1, 2)]
    dispatchers = [SimpleNamespace(name="d1", host="here", pid=5, heartbeat_at=now - timedelta(seconds=72)),
                   SimpleNamespace(name="d2", host="far", pid=5, heartbeat_at=now - timedelta(seconds=72))]
    here, far = held_by_silent(SimpleNamespace(now=now, running=running, dispatchers=dispatchers), host="here",
                               alive=lambda pid: True)
    assert here == ("screen 1 is held by dispatcher d1 (no heartbeat for 72 s), whose process (pid 5) still runs on "
                    "this host: no dispatcher here takes attempt 2 from it while it lives; if it hangs, stop it "
                    "(`kill 5`) and a `packbench dispatch` then marks the attempt lost and runs the screen again")
    assert far == ("screen 2 is held by dispatcher d2 (no heartbeat for 72 s): attempt 2's lease expires at "
                   "2026-12-01T11:59:55+00:00 (in 0 s); a `packbench dispatch` after that marks the attempt lost and "
                   "runs the screen again")  # another host's holder is judged by its lease: that still holds
