"""The job queue on a real database (SQLite file and PostgreSQL): claims, leases, reaping,
cancel, retry, priorities, placement filters, heartbeats and `queue_status`.

Time is a fake clock handed to the Store, so lease expiry is tested without sleeping.
"""

from __future__ import annotations

import shutil
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from packbench.db.errors import Conflict, NotFound
from packbench.db.store import Store

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
FREEZE = {"git": "abc", "dirty": False}
# The quickstart protocol's canonical JSON: 2 conditions x (1 warmup + 3 prompts) = 8 episodes.
BODY = ('{"allowance_mib":4800,"conditions":[{"name":"dense-stream","policy":"dense-stream"},'
        '{"name":"packet","policy":"packet"}],"continuation_tokens":8,"dtype":"float32",'
        '"gates":{"faithfulness":{"tolerance":0.0}},"model":{"path":"models/tiny"},"name":"quickstart",'
        '"prefix_tokens":32,"prompts":{"generator":{"count":3,"seed":0}},"reference":"dense-stream",'
        '"schema":1,"warmups":1}')


class Clock:
    """A settable UTC clock."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture(autouse=True)
def fresh_claim_statements():
    """Every test builds the claim statements it uses: `db/queue.py` caches them once built
    (functools.lru_cache), and mutation testing forks each mutant from a process whose earlier
    tests filled the cache, so a mutant of the statement's builder would never be run."""
    from packbench.db import queue as q

    q._claim_statement.cache_clear()
    q._pg_claim_statement.cache_clear()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def sqlite_at_head(tmp_path_factory) -> Path:
    """An empty SQLite database migrated to head once, copied for each SQLite test: the
    migrations take most of a queue test's time, and every test still gets its own file."""
    path = tmp_path_factory.mktemp("head") / "packbench.db"
    with Store(f"sqlite:///{path}") as store:
        store.upgrade()
    return path


@pytest.fixture
def queue(db_url, clock, request):
    """A Store at head on an empty database, with the fake clock."""
    if db_url.startswith("sqlite:///"):
        shutil.copyfile(request.getfixturevalue("sqlite_at_head"), db_url.removeprefix("sqlite:///"))
    with Store(db_url, clock=clock, retry_delays=()) as store:
        store.upgrade()  # from the copy: already at head
        yield store


def protocol(store: Store, body: str = "{}") -> int:
    return store.put_protocol(sha256="a" * 64, name="q", canonical_json=body)


def claim(store: Store, dispatcher: int, **options):
    arguments = dict(lease_s=60, archive_dir="/archives", source_freeze=FREEZE)
    arguments.update(options)
    return store.claim_screen(dispatcher, **arguments)


# -- claims -------------------------------------------------------------------------------


def test_claim_moves_the_screen_and_creates_a_leased_attempt(queue, clock):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="alice")
    dispatcher = queue.register_dispatcher("d1", "host-a", pid=42)
    c = claim(queue, dispatcher, worker="w0", node="node-a", gpu_name="NVIDIA H200", gpu_index=1,
              model_state="cold")
    assert c.screen.id == screen_id and c.screen.status == "running" and c.screen.attempts_used == 1
    assert c.screen.started_at == T0 and c.protocol.name == "q"
    a = c.attempt
    assert (a.number, a.status, a.dispatcher_id, a.node, a.gpu_index, a.model_state) == (
        1, "running", dispatcher, "node-a", 1, "cold")
    assert a.lease_expires_at == T0 + timedelta(seconds=60) and a.shared_node is False
    assert len(a.attempt_key) == 32 and a.archive_path == f"/archives/screen-{screen_id:05d}-attempt-1-{a.attempt_key}.zip"
    assert a.source_freeze == FREEZE
    assert claim(queue, dispatcher) is None  # nothing left
    assert queue.queued_screens() == []


def test_claims_follow_priority_then_fifo(queue):
    p = protocol(queue)
    low = queue.create_screen(protocol_id=p, submitter="a")
    high_old = queue.create_screen(protocol_id=p, submitter="a", priority=5)
    mid = queue.create_screen(protocol_id=p, submitter="a", priority=1)
    high_new = queue.create_screen(protocol_id=p, submitter="a", priority=5)
    negative = queue.create_screen(protocol_id=p, submitter="a", priority=-1)
    d = queue.register_dispatcher("d", "h")
    assert [s.id for s in queue.queued_screens()] == [high_old, high_new, mid, low, negative]
    order = [claim(queue, d).screen.id for _ in range(5)]
    assert order == [high_old, high_new, mid, low, negative]


def test_claim_filters_gpu_type_exclusions_and_one_screen(queue):
    p = protocol(queue)
    h200 = queue.create_screen(protocol_id=p, submitter="a", gpu_type="H200", priority=1)
    anywhere = queue.create_screen(protocol_id=p, submitter="a")
    d = queue.register_dispatcher("d", "h")
    assert claim(queue, d, gpu_types=["A100"]).screen.id == anywhere
    assert claim(queue, d, gpu_types=["A100"]) is None
    other = queue.create_screen(protocol_id=p, submitter="a")
    assert claim(queue, d, exclude_screens=[h200, other]) is None
    assert claim(queue, d, screen_id=other).screen.id == other
    assert claim(queue, d, screen_id=other) is None  # no longer queued
    assert claim(queue, d, gpu_types=["H200", "A100"]).screen.id == h200


def test_claim_places_on_nodes(queue):
    p = protocol(queue)
    pinned = queue.create_screen(protocol_id=p, submitter="a", placement_node="node-b", priority=9)
    d = queue.register_dispatcher("d", "h")
    replicas = queue.create_screens(3, spread=True, protocol_id=p, submitter="a", priority=5)
    assert len({queue.screen(i).replica_group for i in replicas}) == 1
    # node-a: the pinned screen is not for it; one replica only.
    first = claim(queue, d, node="node-a")
    assert first.screen.id == replicas[0]
    assert claim(queue, d, node="node-a") is None  # a replica runs there; the pinned is for node-b
    left = {s.id for s in queue.queued_screens()}
    assert pinned in left and replicas[1] in left and replicas[2] in left
    second = claim(queue, d, node="node-b")
    assert second.screen.id == pinned
    third = claim(queue, d, node="node-b")
    assert third.screen.id == replicas[1] and third.attempt.shared_node is True
    assert queue.latest_attempt(pinned).shared_node is True  # marked when the second arrived
    assert claim(queue, d, node="node-b") is None  # replicas[2] needs a third node
    assert claim(queue, d, node="node-c").screen.id == replicas[2]
    assert queue.replica_nodes(queue.screen(replicas[0]).replica_group) == {"node-a", "node-b", "node-c"}


def test_exclusive_node(queue):
    p = protocol(queue)
    exclusive = queue.create_screen(protocol_id=p, submitter="a", exclusive_node=True, priority=1)
    plain = queue.create_screen(protocol_id=p, submitter="a")
    d = queue.register_dispatcher("d", "h")
    assert claim(queue, d, node="n1").screen.id == exclusive
    assert claim(queue, d, node="n1") is None  # n1 is taken whole
    c = claim(queue, d, node="n2")
    assert c.screen.id == plain
    another = queue.create_screen(protocol_id=p, submitter="a", exclusive_node=True)
    assert claim(queue, d, node="n2") is None  # n2 runs a screen: no exclusive claim there
    queue.finish_attempt(c.attempt.id, status="done")
    assert claim(queue, d, node="n2").screen.id == another


def test_a_look_ahead_claim_ignores_the_slots_own_attempt_on_the_node(queue):
    """follows_attempt: the slot's running screen ends before the claimed one starts, so it makes
    the node neither shared nor taken for an exclusive screen; a replica still counts."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    queue.create_screen(protocol_id=p, submitter="a")
    first = claim(queue, d, node="n1")
    exclusive = queue.create_screen(protocol_id=p, submitter="a", exclusive_node=True)
    assert claim(queue, d, node="n1") is None  # another worker on n1: the node is not free
    after = claim(queue, d, node="n1", follows_attempt=first.attempt.id)
    assert after.screen.id == exclusive and after.attempt.shared_node is False
    assert queue.latest_attempt(first.screen.id).shared_node is False
    # The exclusive screen (claimed, not started) keeps every other worker off n1 ...
    queue.create_screen(protocol_id=p, submitter="a")
    assert claim(queue, d, node="n1") is None
    # ... but not the worker that runs it, once it looks ahead in turn.
    assert claim(queue, d, node="n1", follows_attempt=after.attempt.id) is not None
    group = queue.create_screens(2, spread=True, protocol_id=p, submitter="a", priority=3)
    on_n2 = claim(queue, d, node="n2")
    assert on_n2.screen.id == group[0]
    assert claim(queue, d, node="n2", follows_attempt=on_n2.attempt.id) is None  # its replica needs another node
    assert claim(queue, d, node="n3").screen.id == group[1]


def test_screens_needing_custom_resources_go_to_nodes_that_have_them_free(queue):
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    nvme = [queue.create_screen(protocol_id=p, submitter="a", resources={"fast_nvme": 1}, priority=1)
            for _ in range(2)]
    plain = queue.create_screen(protocol_id=p, submitter="a")
    assert queue.screen(nvme[0]).needs == {"fast_nvme": 1} and queue.screen(plain).needs == {}
    # A slot without a node, or on a node that lacks the resource, never takes them.
    assert claim(queue, d).screen.id == plain
    assert claim(queue, d, node="n1", node_resources={"other": 4}) is None
    first = claim(queue, d, node="n1", node_resources={"fast_nvme": 1, "other": 4})
    assert first.screen.id == nvme[0]
    # n1's only fast_nvme is in use; its own worker looking ahead may have it next.
    assert claim(queue, d, node="n1", node_resources={"fast_nvme": 1}) is None
    assert claim(queue, d, node="n2", node_resources={"fast_nvme": 0.5}) is None
    following = claim(queue, d, node="n1", node_resources={"fast_nvme": 1}, follows_attempt=first.attempt.id)
    assert following.screen.id == nvme[1]
    big = queue.create_screen(protocol_id=p, submitter="a", resources={"fast_nvme": 2})
    queue.finish_attempt(first.attempt.id, status="done")
    queue.finish_attempt(following.attempt.id, status="done")
    assert claim(queue, d, node="n1", node_resources={"fast_nvme": 1}) is None
    assert claim(queue, d, node="n2", node_resources={"fast_nvme": 2.0}).screen.id == big


@pytest.mark.timeout(120)
def test_two_dispatchers_claiming_for_one_node_never_break_exclusive_node(queue, db_url):
    """The race of issue 12: both dispatchers claim for node n at the same instant, one queued
    screen wanting n to itself and a plain one. Each round at most one screen may start on n
    when one of them is exclusive (before claims for a node were serialized, PostgreSQL let
    both start: each claim's snapshot missed the other's uncommitted attempt)."""
    p = protocol(queue)
    rounds, errors = 25, []
    barrier = threading.Barrier(3)
    results: list[list] = [[None] * rounds for _ in range(2)]

    def claimer(i: int) -> None:
        try:
            with Store(db_url) as store:  # each dispatcher its own Store (and connections), in its thread
                d = store.register_dispatcher(f"d{i}", "h")
                for r in range(rounds):
                    barrier.wait(timeout=30)  # the screens of round r are queued
                    results[i][r] = claim(store, d, node="n")
                    barrier.wait(timeout=30)  # both claimed; the main thread checks and cleans up
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for r in range(rounds):
            # Alternate which screen is first in line, so both orders of the race are tried.
            pair = [queue.create_screen(protocol_id=p, submitter="a", exclusive_node=True, priority=r % 2),
                    queue.create_screen(protocol_id=p, submitter="a", priority=1 - r % 2)]
            barrier.wait(timeout=30)
            barrier.wait(timeout=30)
            got = [c for c in (results[0][r], results[1][r]) if c is not None]
            assert len(got) == 1, f"round {r}: {len(got)} screens started on n, one of them exclusive_node"
            for c in got:
                queue.finish_attempt(c.attempt.id, status="done")
            for screen_id in pair:
                if queue.screen(screen_id).status == "queued":
                    queue.cancel_screen(screen_id)
    except threading.BrokenBarrierError:
        assert errors, "a claimer stopped without an error"
        raise errors[0]
    finally:
        barrier.abort()  # a failed round releases the claimers
        for t in threads:
            t.join(timeout=60)
    assert not errors or isinstance(errors[0], threading.BrokenBarrierError), errors[0]


@pytest.mark.timeout(60)
def test_a_claim_that_fails_midway_leaves_the_node_free(queue, db_url, monkeypatch):
    """A claim for a node that fails after taking the node's lock (PostgreSQL) rolls back and
    lets it go, even on an error that is not the database's (the Store keeps its connection):
    the next claim for that node, from another dispatcher, goes through."""
    import packbench.db.queue as queue_module

    p = protocol(queue)
    screen_id = queue.create_screen(protocol_id=p, submitter="a", resources={"fast_nvme": 1})
    d = queue.register_dispatcher("d", "h")

    def broken(*args, **kwargs):
        raise ValueError("a resources column that is not JSON")

    monkeypatch.setattr(queue_module, "_fitting", broken)
    with pytest.raises(ValueError):
        claim(queue, d, node="n", node_resources={"fast_nvme": 1})
    monkeypatch.undo()
    assert queue.screen(screen_id).status == "queued" and queue.attempts(screen_id) == []
    with Store(db_url) as other:
        c = claim(other, other.register_dispatcher("e", "h"), node="n", node_resources={"fast_nvme": 1})
    assert c.screen.id == screen_id


@pytest.mark.timeout(120)
def test_concurrent_claimers_claim_each_screen_exactly_once(queue, db_url):
    screens = 60
    p = protocol(queue)
    for _ in range(screens):
        queue.create_screen(protocol_id=p, submitter="load")
    claimed: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def claimer(i: int) -> None:
        try:
            with Store(db_url) as store:
                d = store.register_dispatcher(f"d{i}", "h")
                barrier.wait(timeout=30)
                misses = 0
                while misses < 3:  # a SKIP LOCKED claim may come back empty while rows remain
                    c = claim(store, d)
                    if c is None:
                        misses += 1
                        continue
                    claimed[i].append(c.screen.id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not errors, errors[0]
    every = [s for ids in claimed for s in ids]
    assert sorted(every) == list(range(1, screens + 1))  # each exactly once
    keys = {a.attempt_key for s in range(1, screens + 1) for a in queue.attempts(s)}
    assert len(keys) == screens
    assert queue.queue_status().counts["running"] == screens


# -- leases -------------------------------------------------------------------------------


def test_renew_and_expiry_requeue_up_to_max_attempts(queue, clock):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a", max_attempts=2)
    d = queue.register_dispatcher("d", "h")
    first = claim(queue, d, lease_s=30)
    clock.advance(20)
    assert queue.renew_lease(first.attempt.id, 30) is True
    clock.advance(20)
    assert queue.reap_expired() == []  # renewed until T0 + 50
    clock.advance(11)
    [reaped] = queue.reap_expired()
    assert (reaped.attempt_id, reaped.screen_id, reaped.screen_status) == (first.attempt.id, screen_id, "queued")
    lost = queue.latest_attempt(screen_id)
    assert lost.status == "lost" and lost.finished_at == clock.now and reaped.why == "lease expired"
    # the stored reason names when the lease ran out and whose it was (`packbench status` shows it)
    assert lost.error == "lease expired at 2026-11-30T12:00:50+00:00: dispatcher %d stopped renewing it" % d
    assert queue.reap_expired() == []  # reaped once
    assert queue.renew_lease(first.attempt.id, 30) is False  # the old dispatcher must stop
    with pytest.raises(Conflict):
        queue.finish_attempt(first.attempt.id, status="done")

    second = claim(queue, d, lease_s=30)
    assert (second.screen.id, second.attempt.number, second.screen.attempts_used) == (screen_id, 2, 2)
    assert second.attempt.attempt_key != first.attempt.attempt_key
    assert queue.screen(screen_id).started_at == T0  # the first claim's
    clock.advance(31)
    [reaped] = queue.reap_expired(now=clock.now)
    assert reaped.screen_status == "failed"  # max_attempts used up
    screen = queue.screen(screen_id)
    assert screen.status == "failed" and screen.finished_at == clock.now
    assert [a.status for a in queue.attempts(screen_id)] == ["lost", "lost"]
    assert claim(queue, d) is None


def test_a_holder_on_the_reapers_host_is_judged_by_its_process_not_its_lease(queue, clock):
    """A live dispatcher on the reaper's host keeps its expired lease (a `dispatch --follow` that
    waited out a database outage longer than the lease renews it once it can: reaping it threw
    away 23 episodes); a dead one loses its unexpired lease at once (a SIGKILLed driver held its
    screen for the whole lease). Another host's leases are judged by expiry alone."""
    p = protocol(queue)
    live_screen, far_screen, dead_screen = (queue.create_screen(protocol_id=p, submitter="a") for _ in range(3))
    live = queue.register_dispatcher("live", "here", pid=101)
    dead = queue.register_dispatcher("dead", "here", pid=202)
    far = queue.register_dispatcher("far", "elsewhere", pid=101)  # live's pid, on another host
    claim(queue, live, lease_s=10)
    clock.advance(5)
    claim(queue, far, lease_s=10)
    claim(queue, dead, lease_s=600)
    clock.advance(8)  # live's lease expired 3 s ago; far's and dead's have not
    seen = []

    def alive(pid, started_at):
        seen.append((pid, started_at))
        return pid == 101

    reaped = queue.reap_expired(host="here", alive=alive)
    assert [(r.screen_id, r.why) for r in reaped] == [(dead_screen, "its dispatcher (pid 202 on here) is gone")]
    assert queue.latest_attempt(dead_screen).status == "lost" and queue.screen(dead_screen).status == "queued"
    assert queue.latest_attempt(dead_screen).error == f"dispatcher {dead} is gone: its process (pid 202 on here) ended"
    assert queue.latest_attempt(live_screen).status == "running" and (101, T0) in seen
    clock.advance(10)  # far's lease expires: another host's process cannot be seen, its lease decides
    # judged by its lease, not by a process of this host that has its pid
    assert [(r.screen_id, r.why) for r in queue.reap_expired(host="here", alive=alive)] == [(far_screen,
                                                                                         "lease expired")]
    assert queue.latest_attempt(live_screen).status == "running"
    assert [r.screen_id for r in queue.reap_expired()] == [live_screen]  # without a host: leases alone


@pytest.mark.parametrize("host, alive", [("here", None), (None, lambda pid, started_at: True)])
def test_a_reaper_given_only_one_of_host_and_alive_is_refused_and_reaps_nothing(queue, clock, host, alive):
    """Would catch a reaper that quietly falls back to leases alone when half of the host check is
    given (or judges by a host with no way to see its processes)."""
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    claim(queue, queue.register_dispatcher("d", "here", pid=1), lease_s=10)
    clock.advance(11)
    with pytest.raises(ValueError, match=r"^reap_expired judges a host's attempts by their process: give host "
                                         r"and alive together, or neither \(leases only\)$"):
        queue.reap_expired(host=host, alive=alive)
    assert queue.latest_attempt(screen_id).status == "running"


def test_reconcile_targets_a_dead_holders_running_attempt_on_this_host(queue, clock):
    """`db reconcile` after a one-shot dispatch died in an outage: its attempt still runs (the
    lease has not run out) and nobody writes its archive any more; a live holder's, or one
    whose process this host cannot see, is left to its dispatcher."""
    p = protocol(queue)
    for _ in range(3):
        queue.create_screen(protocol_id=p, submitter="a")
    dead = queue.register_dispatcher("dead", "here", pid=202)
    live = queue.register_dispatcher("live", "here", pid=101)
    far = queue.register_dispatcher("far", "elsewhere", pid=202)
    orphan = claim(queue, dead).attempt
    claim(queue, live)
    claim(queue, far)
    alive = lambda pid, started_at: pid == 101  # noqa: E731
    assert queue.reconcile_targets() == []  # running attempts are their dispatchers' own
    (target,) = queue.reconcile_targets(host="here", alive=alive)
    assert target.attempt.id == orphan.id and target.stored == frozenset()


def test_attempts_without_a_lease_are_never_reaped(queue, clock):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    attempt = queue.start_attempt(screen_id=screen_id, worker="w", node="n", gpu_name="g", gpu_index=0,
                                  machine_id=None, source_freeze={}, archive_path="a.zip")
    assert attempt.lease_expires_at is None and len(attempt.attempt_key) == 32
    clock.advance(10**6)
    assert queue.reap_expired() == []


def test_release_requeues_without_using_an_attempt(queue):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a", max_attempts=1)
    d = queue.register_dispatcher("d", "h")
    c = claim(queue, d)
    assert queue.release(c.attempt.id, "dispatcher shutting down") == "queued"
    attempt = queue.latest_attempt(screen_id)
    assert (attempt.status, attempt.error) == ("interrupted", "dispatcher shutting down")
    assert queue.screen(screen_id).attempts_used == 0
    again = claim(queue, d)
    assert again.attempt.number == 2 and again.screen.attempts_used == 1
    with pytest.raises(Conflict):
        queue.release(c.attempt.id, "twice")
    queue.stop_dispatcher(d)
    assert queue.dispatchers()[0].stopped_at is not None


def test_place_attempt_records_where_it_runs(queue):
    p = protocol(queue)
    queue.create_screen(protocol_id=p, submitter="a")
    queue.create_screen(protocol_id=p, submitter="a")
    d = queue.register_dispatcher("d", "h")
    first, second = claim(queue, d), claim(queue, d)
    assert first.attempt.node == "" and first.attempt.shared_node is None
    machine = queue.put_machine(host="n1", gpu_name="H200", driver=None, torch=None, cuda=None)
    placed = queue.place_attempt(first.attempt.id, worker="w0", node="n1", gpu_name="H200", gpu_index=0,
                                 machine_id=machine, model_state="warm")
    assert (placed.node, placed.gpu_name, placed.machine_id, placed.model_state, placed.shared_node) == (
        "n1", "H200", machine, "warm", False)
    assert queue.place_attempt(second.attempt.id, node="n1").shared_node is True
    assert queue.latest_attempt(first.screen.id).shared_node is True
    with pytest.raises(ValueError):
        queue.place_attempt(first.attempt.id, model_state="tepid")
    queue.finish_attempt(first.attempt.id, status="done")
    with pytest.raises(Conflict):
        queue.place_attempt(first.attempt.id, node="n2")


# -- cancel, retry, unplaceable ----------------------------------------------------------


def test_cancel_a_queued_screen(queue):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    cancelled = queue.cancel_screen(screen_id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    d = queue.register_dispatcher("d", "h")
    assert claim(queue, d) is None  # never runs
    with pytest.raises(Conflict) as info:
        queue.cancel_screen(screen_id)
    assert "\n" not in str(info.value)
    with pytest.raises(NotFound):
        queue.cancel_screen(999)


def test_cancel_a_running_screen(queue, clock):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    d = queue.register_dispatcher("d", "h")
    c = claim(queue, d, lease_s=30)
    requested = queue.cancel_screen(str(screen_id))
    assert requested.status == "running" and requested.cancel_requested_at == T0
    assert queue.renew_lease(c.attempt.id, 30) is False  # stop after the episode in flight
    assert queue.put_episode(c.attempt.id, {"plan_index": 0, "condition": "x", "role": "scored",
                                            "prompt": 0, "status": "ok"}) is True
    queue.finish_attempt(c.attempt.id, status="cancelled", error="cancelled by the user")
    assert queue.screen(screen_id).status == "cancelled"
    assert queue.latest_attempt(screen_id).status == "cancelled"
    assert len(queue.episodes(c.attempt.id)) == 1  # the partial record is kept


def test_cancel_requested_then_lease_expires(queue, clock):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    d = queue.register_dispatcher("d", "h")
    claim(queue, d, lease_s=30)
    queue.cancel_screen(screen_id)
    clock.advance(31)
    [reaped] = queue.reap_expired()
    assert reaped.screen_status == "cancelled"
    assert queue.latest_attempt(screen_id).status == "lost"


def test_retry_a_failed_or_cancelled_screen(queue, clock):
    p = protocol(queue)
    failed = queue.create_screen(protocol_id=p, submitter="a", max_attempts=1)
    d = queue.register_dispatcher("d", "h")
    c = claim(queue, d, lease_s=10)
    clock.advance(11)
    queue.reap_expired()
    assert queue.screen(failed).status == "failed"
    with pytest.raises(Conflict):
        queue.retry_screen(queue.create_screen(protocol_id=p, submitter="a"))  # queued
    retried = queue.retry_screen(failed)
    assert (retried.status, retried.attempts_used, retried.finished_at) == ("queued", 0, None)
    again = claim(queue, d, exclude_screens=[failed + 1])
    assert (again.screen.id, again.attempt.number) == (failed, 2)
    queue.finish_attempt(again.attempt.id, status="done")
    with pytest.raises(Conflict):
        queue.retry_screen(failed)  # done: submit again instead
    queue.cancel_screen(failed + 1)
    assert queue.retry_screen(failed + 1).status == "queued"
    assert c.attempt.id != again.attempt.id


def test_unplaceable_screens_stay_queued_with_a_reason(queue):
    screen_id = queue.create_screen(protocol_id=protocol(queue, BODY), submitter="a", gpu_type="B200")
    assert queue.set_unplaceable(screen_id, "no B200 worker in the cluster") is True
    status = queue.queue_status()
    [queued] = status.queued
    assert (queued.screen_id, queued.gpu_type, queued.unplaceable_reason) == (
        screen_id, "B200", "no B200 worker in the cluster")
    assert status.counts["queued"] == 1 and status.counts["failed"] == 0
    d = queue.register_dispatcher("d", "h")
    c = claim(queue, d)
    assert c.screen.unplaceable_reason is None  # cleared by the claim
    assert queue.set_unplaceable(screen_id, "late") is False  # not queued any more


# -- heartbeats and status -----------------------------------------------------------------


def test_queue_status(queue, clock):
    p = protocol(queue, BODY)
    running = queue.create_screen(protocol_id=p, submitter="a", priority=2)
    waiting = queue.create_screen(protocol_id=p, submitter="a")
    d1 = queue.register_dispatcher("d1", "host-1", pid=1)
    d2 = queue.register_dispatcher("d2", "host-2")
    c = claim(queue, d1, node="node-a", gpu_name="H200", gpu_index=3, model_state="warm")
    queue.put_episode(c.attempt.id, {"plan_index": 0, "condition": "dense-stream", "role": "warmup",
                                     "prompt": 0, "status": "ok"})
    queue.heartbeat(d1, [{"name": "w0", "node": "node-a", "gpu": "H200", "gpu_index": 3, "state": "busy",
                          "screen_id": running},
                         {"name": "w1", "node": "node-a", "gpu": "H200", "gpu_index": 4, "state": "idle"}])
    with pytest.raises(ValueError):
        queue.heartbeat(d1, [{"name": "w0", "state": "sleepy"}])
    with pytest.raises(NotFound):
        queue.heartbeat(999, [])
    clock.advance(45)
    queue.heartbeat(d2, [{"name": "w", "node": "node-b", "gpu": "A100", "gpu_index": 0, "state": "idle"}])
    status = queue.queue_status(live_within_s=30)
    assert status.counts == {"queued": 1, "running": 1, "done": 0, "failed": 0, "cancelled": 0}
    [r] = status.running
    assert (r.screen_id, r.dispatcher, r.node, r.gpu_name, r.gpu_index, r.model_state) == (
        running, "d1", "node-a", "H200", 3, "warm")
    assert (r.episodes_done, r.episodes_total, r.cancel_requested) == (1, 8, False)
    assert [q.screen_id for q in status.queued] == [waiting]
    assert [(x.name, x.live) for x in status.dispatchers] == [("d1", False), ("d2", True)]
    assert (status.idle_workers, status.busy_workers) == (1, 0)  # d1's heartbeat is stale
    queue.stop_dispatcher(d2)
    assert [x.name for x in queue.queue_status().dispatchers] == ["d1"]


def test_audits_record_node_and_kind(queue):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    attempt = queue.start_attempt(screen_id=screen_id, worker="w", node="n", gpu_name="g", gpu_index=0,
                                  machine_id=None, source_freeze={}, archive_path="a.zip")
    arguments = dict(attempt_id=attempt.id, archive_sha256="d" * 64, digest="e" * 64, result="agree",
                     problems=[], machine="laptop", started_at=T0, finished_at=T0)
    queue.put_audit(**arguments, node="ray-node-7", kind="ray")
    queue.put_audit(**arguments)
    assert [(a.node, a.kind) for a in queue.audits(attempt.id)] == [("ray-node-7", "ray"), (None, None)]
    with pytest.raises(ValueError):
        queue.put_audit(**arguments, kind="remote")


def test_a_failed_attempt_with_requeue_goes_back_to_the_queue_until_max_attempts(queue):
    """A worker that died is not the screen's fault: requeued, but each claim counts."""
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a", max_attempts=2)
    d = queue.register_dispatcher("d", "h")
    first = claim(queue, d)
    queue.finish_attempt(first.attempt.id, status="failed", error="worker-1 died", requeue=True)
    assert queue.screen(screen_id).status == "queued" and queue.latest_attempt(screen_id).status == "failed"
    second = claim(queue, d)
    assert second.attempt.number == 2
    queue.finish_attempt(second.attempt.id, status="failed", error="worker-2 died", requeue=True)
    assert queue.screen(screen_id).status == "failed"  # max_attempts used
    assert [a.status for a in queue.attempts(screen_id)] == ["failed", "failed"]
    other = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    c = claim(queue, d)
    queue.cancel_screen(other)
    queue.finish_attempt(c.attempt.id, status="failed", error="died", requeue=True)
    assert queue.screen(other).status == "cancelled"  # a cancel request wins over the requeue


def test_attempt_numbers_count_per_screen(queue):
    """Each screen's first claim is its attempt 1, whatever other screens did before."""
    p = protocol(queue)
    ids = [queue.create_screen(protocol_id=p, submitter="a") for _ in range(3)]
    d = queue.register_dispatcher("d", "h")
    claims = [claim(queue, d) for _ in ids]
    assert [(c.screen.id, c.attempt.number) for c in claims] == [(i, 1) for i in ids]
    queue.finish_attempt(claims[0].attempt.id, status="failed", error="died", requeue=True)
    assert claim(queue, d).attempt.number == 2


# -- arguments checked before any transaction (no database) ---------------------------------


def test_argument_checks_refuse_exactly_what_is_outside_their_sets():
    # Bugs: a lease of 0 s accepted (every claim expires at once) or a tiny positive one
    # refused; an unknown model state, attempt status or worker state stored; messages that
    # do not name the value and the choices.
    from packbench.db.queue import check_final_status, check_lease, check_model_state, worker_list

    check_lease(1e-9)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"^lease_s {bad} must be > 0$"):
            check_lease(bad)
    for ok in (None, "cold", "warm"):
        check_model_state(ok)
    with pytest.raises(ValueError, match=r"^model_state 'hot' is not one of cold, warm$"):
        check_model_state("hot")
    for ok in ("done", "failed", "interrupted", "cancelled"):
        check_final_status(ok)
    with pytest.raises(ValueError, match=r"^attempt status 'lost' is not one of \['cancelled', 'done', 'failed', "
                                         r"'interrupted'\]$"):
        check_final_status("lost")
    workers = [{"name": "w0", "state": "idle"}, {"name": "w1", "state": "busy", "gpu": "H200"}]
    listed = worker_list(workers)
    assert listed == workers and listed[0] is not workers[0]  # copies: the caller's dicts are not stored
    assert worker_list([]) == []
    with pytest.raises(ValueError, match=r"^worker state None is not one of idle, busy$"):
        worker_list([{"name": "w0", "state": "idle"}, {"name": "w1"}])


def test_names_keys_and_resources_json():
    # Bugs: archive names not zero-padded to 5 digits (their sort order breaks), keys shorter
    # than 128 bits or repeated, resource needs not canonical (equal needs stored as different
    # strings never match the claim's IN), empty needs stored as "{}".
    from packbench.db.queue import archive_file_name, new_attempt_key, resources_json

    assert archive_file_name(7, 2, "k") == "screen-00007-attempt-2-k.zip"
    assert archive_file_name(123456, 10, "k") == "screen-123456-attempt-10-k.zip"
    keys = {new_attempt_key() for _ in range(50)}
    assert len(keys) == 50 and all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    assert resources_json({"b": 1.0, "a": 2}) == '{"a":2,"b":1.0}' == resources_json({"a": 2, "b": 1.0})
    assert resources_json({}) is None and resources_json(None) is None
    # A need of 0 or less, or not a finite number, is refused: it would fit every node, even one
    # that declares no such resource (the protocol refuses it too: placement.resources).
    for amount in (0, -1, 0.0, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValueError) as e:
            resources_json({"nvme": amount})
        assert str(e.value) == (f"resource 'nvme' needs {amount!r}; a need is a finite number > 0 "
                                f"(as a protocol's placement.resources says it)")
    assert resources_json({"nvme": 1e-4}) == '{"nvme":0.0001}'


@pytest.mark.parametrize("call, noun", [
    (lambda q: q.heartbeat(999_999, []), "dispatcher"),
    (lambda q: q.stop_dispatcher(999_999), "dispatcher"),
    (lambda q: q.place_attempt(999_999, worker="w"), "attempt"),
    (lambda q: q.renew_lease(999_999, 60.0), "attempt"),
    (lambda q: q.release(999_999, "shutting down"), "attempt"),
    (lambda q: q.finish_attempt(999_999, status="done"), "attempt"),
    (lambda q: q.start_attempt(screen_id=999_999, worker="w", node="n", gpu_name="g", gpu_index=0, machine_id="m",
                               source_freeze={}, archive_path="a.zip"), "screen"),
])
def test_an_id_that_does_not_exist_is_not_found_naming_what_was_looked_for(queue, call, noun):
    """Every call that takes a dispatcher, attempt or screen id refuses one that does not exist with
    one line naming the kind of row and the id (catches a lookup that names the wrong thing, or
    none, and a missing row treated as a no-op)."""
    with pytest.raises(NotFound) as e:
        call(queue)
    assert str(e.value) == f"no {noun} with id 999999; list screens with `packbench screens list`"


def test_replica_nodes_are_those_of_the_group_with_a_running_or_done_attempt(queue, clock):
    """Catches the group filter dropped (another group's nodes counted), the status filter dropped
    or misspelt (a failed attempt's node counted, a done one's not), and a join that pairs an
    attempt with the wrong screen."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    ours = queue.create_screens(3, spread=True, protocol_id=p, submitter="a", priority=5)
    theirs = queue.create_screens(2, spread=True, protocol_id=p, submitter="a", priority=1)
    group, other = queue.screen(ours[0]).replica_group, queue.screen(theirs[0]).replica_group
    assert group != other
    done = claim(queue, d, node="node-a", screen_id=ours[0])
    queue.finish_attempt(done.attempt.id, status="done")
    claim(queue, d, node="node-b", screen_id=ours[1])  # running
    failed = claim(queue, d, node="node-c", screen_id=ours[2], lease_s=5)
    queue.finish_attempt(failed.attempt.id, status="failed", error="boom")
    claim(queue, d, node="node-x", screen_id=theirs[0])
    assert queue.replica_nodes(group) == {"node-a", "node-b"}
    assert queue.replica_nodes(other) == {"node-x"}
    assert queue.replica_nodes("no-such-group") == set()


def test_set_unplaceable_marks_the_named_queued_screen_only(queue):
    """Catches the id filter dropped: every queued screen would take the reason."""
    p = protocol(queue, BODY)
    one, two = (queue.create_screen(protocol_id=p, submitter="a", gpu_type="B200") for _ in range(2))
    assert queue.set_unplaceable(two, "no B200") is True
    reasons = {q.screen_id: q.unplaceable_reason for q in queue.queue_status().queued}
    assert reasons == {one: None, two: "no B200"}
    assert queue.set_unplaceable(999_999, "nothing") is False


def test_a_lease_is_reaped_after_it_expires_not_at_the_instant(queue, clock):
    """The lease runs until lease_expires_at: an attempt whose lease ends exactly now is alive
    (catches `<` written `<=`: a dispatcher renewing on the boundary would lose its attempt)."""
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    d = queue.register_dispatcher("d", "h")
    c = claim(queue, d, lease_s=10)
    clock.advance(10)
    queue.reap_expired()
    assert queue.latest_attempt(screen_id).status == "running"
    clock.advance(1e-3)
    queue.reap_expired()
    assert queue.latest_attempt(screen_id).status != "running" and c.attempt.id == queue.latest_attempt(screen_id).id


def test_retry_of_a_screen_that_is_not_failed_or_cancelled_says_why(queue):
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    with pytest.raises(Conflict) as e:
        queue.retry_screen(screen_id)
    assert str(e.value) == f"screen {screen_id} is queued; only a failed or cancelled screen can be retried"


def test_a_worker_of_an_unknown_state_is_named_with_its_state():
    from packbench.db.queue import worker_list

    with pytest.raises(ValueError) as e:
        worker_list([{"name": "w0", "state": "sleeping"}])
    assert str(e.value) == "worker state 'sleeping' is not one of idle, busy"


# -- promises the mutation run of db/queue.py found untested (docs/mutation.md) -------------


def test_start_attempt_numbers_per_screen_and_starts_the_screen_once(queue, clock):
    """A started attempt is running since now, numbered after its own screen's attempts (another
    screen's do not count), with the placement's source freeze; the screen runs and keeps the
    started_at of its first attempt. Catches the number counted over every screen or from 2, a
    status or start time not stored, the source freeze dropped, started_at moved by each attempt."""
    p = protocol(queue)
    first, second = queue.create_screen(protocol_id=p, submitter="a"), queue.create_screen(protocol_id=p, submitter="a")
    place = dict(worker="w", node="n", gpu_name="g", gpu_index=0, machine_id=None, archive_path="a.zip")
    a1 = queue.start_attempt(screen_id=first, source_freeze=FREEZE, **place)
    assert (a1.number, a1.status, a1.started_at, a1.source_freeze) == (1, "running", T0, FREEZE)
    assert (queue.screen(first).status, queue.screen(first).started_at) == ("running", T0)
    clock.advance(5)
    queue.finish_attempt(a1.id, status="failed", error="boom")
    a2 = queue.start_attempt(screen_id=first, source_freeze=FREEZE, **place)
    assert (a2.number, a2.started_at) == (2, T0 + timedelta(seconds=5))
    assert (queue.screen(first).status, queue.screen(first).started_at) == ("running", T0)
    b1 = queue.start_attempt(screen_id=second, source_freeze=FREEZE, **place)
    assert (b1.number, b1.started_at) == (1, T0 + timedelta(seconds=5))
    stored = queue.latest_attempt(first)
    assert (stored.id, stored.status, stored.started_at, stored.source_freeze) == (
        a2.id, "running", T0 + timedelta(seconds=5), FREEZE)


def test_release_gives_back_one_claim_and_a_requested_cancel_wins(queue, clock):
    """release() takes back exactly the claim it releases (attempts_used 2 -> 1, not 0), stamps
    the attempt's finished_at, and a screen whose cancel was requested becomes cancelled then,
    not queued again. Catches the count lowered by 2, finished_at not stored, a cancelled
    screen requeued or its status misspelt, and a Conflict that does not say why."""
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a", max_attempts=3)
    d = queue.register_dispatcher("d", "h")
    first = claim(queue, d)
    assert queue.finish_attempt(first.attempt.id, status="failed", error="worker died", requeue=True) == "queued"
    second = claim(queue, d)
    assert queue.screen(screen_id).attempts_used == 2
    clock.advance(7)
    assert queue.release(second.attempt.id, "shutting down") == "queued"
    assert queue.screen(screen_id).attempts_used == 1
    assert queue.latest_attempt(screen_id).finished_at == T0 + timedelta(seconds=7)
    third = claim(queue, d)
    queue.cancel_screen(screen_id)
    clock.advance(3)
    assert queue.release(third.attempt.id, "shutting down") == "cancelled"
    screen = queue.screen(screen_id)
    assert (screen.status, screen.finished_at) == ("cancelled", T0 + timedelta(seconds=10))
    with pytest.raises(Conflict) as e:
        queue.release(third.attempt.id, "again")
    assert str(e.value) == f"attempt {third.attempt.id} is already interrupted; nothing to release"


def test_placing_an_attempt_that_no_longer_runs_says_why(queue):
    """Catches the Conflict's reason dropped: the dispatcher logs it and stops working on the
    attempt."""
    queue.create_screen(protocol_id=protocol(queue), submitter="a")
    d = queue.register_dispatcher("d", "h")
    c = claim(queue, d)
    queue.finish_attempt(c.attempt.id, status="done")
    with pytest.raises(Conflict) as e:
        queue.place_attempt(c.attempt.id, node="n1")
    assert str(e.value) == f"attempt {c.attempt.id} is done, not running; stop working on it"


def test_dispatchers_and_queued_screens_keep_their_order_after_updates(queue, clock):
    """Dispatchers come back by id and queued screens of one priority oldest first (a retried
    screen keeps its place by id) even after the older rows were updated (PostgreSQL stores an
    updated row anew, so an order left to the table's storage or an index puts it last).
    Catches an ORDER BY (or its id tie-break) dropped; SQLite returns rowid order either way,
    so only the PostgreSQL case can fail on that."""
    p = protocol(queue)
    older, newer = queue.create_screen(protocol_id=p, submitter="a"), queue.create_screen(protocol_id=p, submitter="a")
    first, second = queue.register_dispatcher("d1", "h"), queue.register_dispatcher("d2", "h")
    clock.advance(1)  # a heartbeat that changes nothing writes nothing
    queue.heartbeat(first, [{"name": "w0", "state": "idle"}])
    queue.cancel_screen(older)  # then queued again: a changed status is a new row version in every index
    queue.retry_screen(older)
    assert [d.id for d in queue.dispatchers()] == [first, second]
    assert [s.id for s in queue.queued_screens()] == [older, newer]


def test_a_claim_takes_the_oldest_of_equal_priorities_even_after_it_was_updated(queue):
    """Of queued screens of one priority a claim takes the oldest (by id), also when the older
    rows were updated since (PostgreSQL stores an updated row anew, after the others). Catches the
    claim's id tie-break dropped (only the PostgreSQL case can fail on it: SQLite returns rowid order)."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    ids = [queue.create_screen(protocol_id=p, submitter="a") for _ in range(3)]
    for screen_id in ids[:2]:  # the two older rows written anew (a changed status: in every index too)
        queue.cancel_screen(screen_id)
        queue.retry_screen(screen_id)
    assert [claim(queue, d).screen.id for _ in range(3)] == ids


def test_a_reaper_reaps_in_attempt_id_order_even_after_renewals(queue, clock):
    """Expired attempts are reaped in id order, also when the older ones' leases were renewed
    since (a renewal is an UPDATE: PostgreSQL stores the row anew, after the others). Catches the
    reaper's ORDER BY dropped (only the PostgreSQL case can fail on it)."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    attempts = []
    for _ in range(3):
        queue.create_screen(protocol_id=p, submitter="a")
        attempts.append(claim(queue, d, lease_s=10).attempt.id)
    clock.advance(5)
    for attempt_id in attempts[:2]:
        assert queue.renew_lease(attempt_id, 10)
    clock.advance(11)  # every lease expired
    assert [r.attempt_id for r in queue.reap_expired()] == attempts


def test_a_claim_stamps_the_screens_start_as_every_other_write_of_a_time_does(queue, clock, db_url):
    """The claim writes the screen's started_at in its own statement: it must store the instant in
    the same form as the ORM stores created_at (on SQLite a text whose order is the time's order), or
    a `--since`/`--until` comparison in SQL puts a screen started at an instant on the wrong side of it.
    Catches the statement's `now` parameter left without the column's type (SQLite's default adapter
    writes '2026-11-30 12:00:00+00:00', the ORM '2026-11-30 12:00:00.000000')."""
    from sqlalchemy import text

    from packbench.db.session import make_engine

    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    claim(queue, queue.register_dispatcher("d", "h"))  # at the same clock instant as the screen's creation
    engine = make_engine(db_url)
    with engine.connect() as connection:
        created, started = connection.execute(
            text("SELECT created_at, started_at FROM screens WHERE id = :i"), {"i": screen_id}).one()
    engine.dispose()
    assert started == created and queue.screen(screen_id).started_at == T0


def _started(store: Store) -> tuple[int, int]:
    """A claimed screen's (screen id, attempt id)."""
    screen_id = store.create_screen(protocol_id=protocol(store), submitter="a")
    return screen_id, claim(store, store.register_dispatcher("d", "h")).attempt.id


# Each case: (what another writer changes while holding the row's lock, the call, what the call must
# answer once that writer commits). The call has to lock the row before reading it (FOR UPDATE);
# one that reads first acts on the row as it was and overwrites the other writer's change.
ROW_LOCK_CASES = {
    "finish_attempt": ("UPDATE attempts SET status = 'lost' WHERE id = {attempt}",
                       lambda q, s, a: q.finish_attempt(a, status="done"), Conflict),
    "release": ("UPDATE attempts SET status = 'lost' WHERE id = {attempt}",
                lambda q, s, a: q.release(a, "shutting down"), Conflict),
    "renew_lease": ("UPDATE attempts SET status = 'lost' WHERE id = {attempt}",
                    lambda q, s, a: q.renew_lease(a, 60.0), False),
    "place_attempt": ("UPDATE attempts SET status = 'lost' WHERE id = {attempt}",
                      lambda q, s, a: q.place_attempt(a, worker="w1"), Conflict),
    "start_attempt": ("UPDATE screens SET started_at = '2026-01-01T00:00:00+00:00' WHERE id = {screen}",
                      lambda q, s, a: q.start_attempt(screen_id=s, worker="w", node="n", gpu_name="g", gpu_index=0,
                                                      machine_id=None, source_freeze={}, archive_path="b.zip")
                      and q.screen(s).started_at, datetime(2026, 1, 1, tzinfo=UTC)),
    "cancel_screen": ("UPDATE screens SET status = 'done' WHERE id = {screen}",
                      lambda q, s, a: q.cancel_screen(s), Conflict),
    "retry_screen": ("UPDATE screens SET status = 'queued' WHERE id = {screen}",
                     lambda q, s, a: q.retry_screen(s), Conflict),
    # the screen's lock, taken after the attempt's: a cancel requested meanwhile wins
    "finish_attempt screen": ("UPDATE screens SET cancel_requested_at = now() WHERE id = {screen}",
                              lambda q, s, a: q.finish_attempt(a, status="failed", error="died", requeue=True),
                              "cancelled"),
    "release screen": ("UPDATE screens SET cancel_requested_at = now() WHERE id = {screen}",
                       lambda q, s, a: q.release(a, "shutting down"), "cancelled"),
    "reap_expired screen": ("UPDATE screens SET cancel_requested_at = now() WHERE id = {screen}",
                            lambda q, s, a: [r.screen_status for r in q.reap_expired(T0 + timedelta(hours=1))],
                            ["cancelled"]),
}


@pytest.mark.parametrize("case", sorted(ROW_LOCK_CASES))
def test_a_change_committed_under_a_row_lock_is_seen_not_overwritten(pg_url, clock, case):
    """PostgreSQL only (SQLite serializes every write transaction at BEGIN IMMEDIATE): each call
    that reads a row and then decides on it locks the row first, so a writer holding the lock is
    waited for and its change is what the call decides on. Catches a FOR UPDATE dropped: the
    call would finish a lost attempt, renew its lease, cancel a done screen, retry a queued
    one or move a screen's start time."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    change, call, expected = ROW_LOCK_CASES[case]
    with Store(pg_url, clock=clock, retry_delays=()) as store:
        store.upgrade()
        screen_id, attempt_id = _started(store)
        if case == "retry_screen":
            store.finish_attempt(attempt_id, status="failed", error="boom")
        if case == "start_attempt":  # a screen no attempt has started yet
            screen_id = store.create_screen(protocol_id=protocol(store), submitter="a")
        engine = create_engine(pg_url, poolclass=NullPool)
        answer: dict = {}

        def run():
            try:
                answer["value"] = call(store, screen_id, attempt_id)
            except Exception as error:  # noqa: BLE001 - the answer is the exception's type
                answer["value"] = type(error)

        with engine.connect() as other:
            table = "attempts" if change.startswith("UPDATE attempts") else "screens"
            key = attempt_id if table == "attempts" else screen_id
            other.exec_driver_sql(f"SELECT id FROM {table} WHERE id = {key} FOR UPDATE")
            other.exec_driver_sql(change.format(attempt=attempt_id, screen=screen_id))
            thread = threading.Thread(target=run)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive(), "the call did not wait for the other writer's lock"
            other.commit()
            thread.join(30)
        engine.dispose()
        assert answer["value"] == expected



def _held_elsewhere(pg_url: str, table: str, row_id: int, call, wait_s: float = 10.0):
    """Run `call()` in a thread while another connection holds row `row_id` of `table` FOR UPDATE;
    return (whether the call finished while the row was held, its answer). The lock is then
    released (rolled back) and the thread joined."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(pg_url, poolclass=NullPool)
    answer: dict = {}

    def run():
        try:
            answer["value"] = call()
        except Exception as error:  # noqa: BLE001 - the answer is the exception's type
            answer["value"] = type(error)

    with engine.connect() as other:
        other.exec_driver_sql(f"SELECT id FROM {table} WHERE id = {row_id} FOR UPDATE")
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(wait_s)
        finished = not thread.is_alive()
        other.rollback()
        thread.join(30)
    engine.dispose()
    return finished, answer.get("value")


def test_a_claim_passes_over_a_screen_another_claimer_holds(pg_url, clock):
    """PostgreSQL only: a claimer takes the best queued screen no other transaction holds, at once
    (`FOR UPDATE SKIP LOCKED`), so dispatchers never queue behind each other. Catches the
    candidate's row lock dropped or made blocking: the claim would wait for the other claimer's
    screen (and then take nothing, or take it), instead of taking the next one."""
    with Store(pg_url, clock=clock, retry_delays=()) as store:
        store.upgrade()
        p = protocol(store)
        first = store.create_screen(protocol_id=p, submitter="a", priority=5)
        second = store.create_screen(protocol_id=p, submitter="a", priority=1)
        d = store.register_dispatcher("d", "h")
        finished, got = _held_elsewhere(pg_url, "screens", first, lambda: claim(store, d))
        assert finished, "the claim waited for the screen another transaction holds"
        assert got.screen.id == second and got.attempt.number == 1
        assert claim(store, d).screen.id == first  # released: the best screen is claimable again


def test_a_reaper_passes_over_an_attempt_another_transaction_holds(pg_url, clock):
    """PostgreSQL only: every dispatcher reaps at once, each skipping the expired attempts another
    reaper or a renewal holds, and reaping the rest in id order. Catches the reaper's row lock
    dropped or made blocking (it would wait for the holder, then reap an attempt the holder may
    just have renewed) and the id order dropped."""
    with Store(pg_url, clock=clock, retry_delays=()) as store:
        store.upgrade()
        p = protocol(store)
        d = store.register_dispatcher("d", "h")
        ids = []
        for _ in range(3):
            store.create_screen(protocol_id=p, submitter="a")
            ids.append(claim(store, d).attempt.id)
        clock.advance(61)  # every lease (60 s) expired
        finished, reaped = _held_elsewhere(pg_url, "attempts", ids[0], store.reap_expired)
        assert finished, "the reaper waited for an attempt another transaction holds"
        assert [(r.attempt_id, r.why) for r in reaped] == [(ids[1], "lease expired"), (ids[2], "lease expired")]
        assert [r.attempt_id for r in store.reap_expired()] == [ids[0]]  # released: reaped once, now


def test_a_nodes_free_resources_are_its_capacity_less_what_runs_there(queue):
    """What a node has free is its declared capacity less the needs of the screens running on it
    (each counted by its own screen's needs; the look-ahead slot's own attempt left out; a need
    the node no longer declares counts against zero), and screens needing nothing stay claimable
    beside them. Catches running needs joined to other screens' needs, the capacity ignored for
    a running need, the look-ahead exception turned into 'nothing runs', an undeclared need
    crashing the claim, and screens without needs breaking the fit check."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")

    def screen(priority, resources=None):
        return queue.create_screen(protocol_id=p, submitter="a", priority=priority, resources=resources)

    big, x, y, w = screen(5, {"nvme": 2}), screen(4, {"nvme": 1}), screen(3, {"nvme": 1}), screen(2, {"nvme": 1})
    plain1, plain2 = screen(0), screen(0)
    done = claim(queue, d, node="n2", node_resources={"nvme": 2}, screen_id=big)
    queue.finish_attempt(done.attempt.id, status="done")
    assert claim(queue, d, node="n1", node_resources={"nvme": 2}, screen_id=x).screen.id == x
    # n1 has 2 - 1 free: y fits (the done screen's 2 are not n1's, nor are the queued ones' needs)
    assert claim(queue, d, node="n1", node_resources={"nvme": 2}).screen.id == y
    beside = claim(queue, d, node="n1", node_resources={"nvme": 2}, screen_id=plain1)
    # x and y use both: w does not fit, even for the slot of plain1 (which needs nothing) looking ahead
    after = claim(queue, d, node="n1", node_resources={"nvme": 2}, follows_attempt=beside.attempt.id)
    assert after.screen.id == plain2
    # n1 now declares no nvme: what runs there still uses 2 of none, and nothing is claimed
    assert claim(queue, d, node="n1", node_resources={"other": 1}) is None
    assert [s.id for s in queue.queued_screens()] == [w]


def test_a_need_the_node_no_longer_declares_counts_against_zero(queue):
    """Half of a resource runs on n1; n1 then stops declaring it. A queued screen needing the other
    half must not fit: the undeclared resource has 0 - 0.5 free, not 1 - 0.5 (would catch an
    undeclared need counted against any capacity but zero)."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    first, second = (queue.create_screen(protocol_id=p, submitter="a", resources={"nvme": 0.5}) for _ in range(2))
    assert claim(queue, d, node="n1", node_resources={"nvme": 0.5}).screen.id == first
    assert claim(queue, d, node="n1", node_resources={"other": 1}) is None
    assert claim(queue, d, node="n1", node_resources={"nvme": 1}).screen.id == second


def test_a_finished_attempt_keeps_its_outcome_and_time_and_refusals_say_why(queue, clock):
    """Catches finish_attempt dropping the error, the archive's hash or the finish time (of the
    attempt or its screen), a registered dispatcher without its first heartbeat, and the
    refusals to finish twice or cancel a finished screen losing their reason."""
    screen_id = queue.create_screen(protocol_id=protocol(queue), submitter="a")
    d = queue.register_dispatcher("d", "h")
    assert (queue.dispatchers()[0].started_at, queue.dispatchers()[0].heartbeat_at) == (T0, T0)
    c = claim(queue, d)
    clock.advance(9)
    assert queue.finish_attempt(c.attempt.id, status="done", error="note", archive_sha256="f" * 64) == "done"
    a = queue.latest_attempt(screen_id)
    assert (a.status, a.error, a.archive_sha256, a.finished_at) == ("done", "note", "f" * 64, T0 + timedelta(seconds=9))
    assert queue.screen(screen_id).finished_at == T0 + timedelta(seconds=9)
    with pytest.raises(Conflict) as e:
        queue.finish_attempt(c.attempt.id, status="failed")
    assert str(e.value) == (f"attempt {c.attempt.id} is already done; finished attempts are kept as they are: "
                            f"start a new attempt instead")
    with pytest.raises(Conflict) as e:
        queue.cancel_screen(screen_id)
    assert str(e.value) == f"screen {screen_id} is already done; only a queued or running screen can be cancelled"


def test_sharing_a_node_marks_its_running_attempts_only_and_unmarked_ones_too(queue):
    """An attempt started outside a claim has no shared_node mark yet (NULL); a claim on its node
    marks it shared, and leaves attempts on other nodes and finished ones alone. Catches the
    node and status filters dropped from the marking and NULL marks left unmarked."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    started_id, other_id, old_id, new_id = (queue.create_screen(protocol_id=p, submitter="a") for _ in range(4))
    place = dict(worker="w", gpu_name="g", gpu_index=0, machine_id=None, source_freeze={}, archive_path="a.zip")
    started = queue.start_attempt(screen_id=started_id, node="n1", **place)
    assert started.shared_node is None
    old = claim(queue, d, node="n1", screen_id=old_id)
    queue.finish_attempt(old.attempt.id, status="done")
    claim(queue, d, node="n2", screen_id=other_id)
    new = claim(queue, d, node="n1", screen_id=new_id)
    assert new.attempt.shared_node is True
    assert queue.latest_attempt(started_id).shared_node is True
    assert queue.latest_attempt(other_id).shared_node is False
    assert queue.latest_attempt(old_id).shared_node is True  # marked while it ran beside `started`, kept


def test_a_claim_stores_what_it_was_given(queue):
    """The claimed attempt as stored: its machine, its source freeze, its archive path under the
    archive directory however that is written (a trailing '/' is not doubled, nothing else is cut); a model state
    outside cold / warm is refused before anything is claimed; node resources without a node
    place nothing that needs them. Catches the machine or source freeze not stored, the
    directory's trailing '/' kept, the model-state check skipped and a node-less slot's
    declared resources used."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    needs = queue.create_screen(protocol_id=p, submitter="a", resources={"nvme": 1}, priority=1)
    plain = queue.create_screen(protocol_id=p, submitter="a")
    machine = queue.put_machine(host="n1", gpu_name="H200", driver=None, torch=None, cuda=None)
    with pytest.raises(ValueError, match=r"^model_state 'hot' is not one of cold, warm$"):
        claim(queue, d, model_state="hot")
    assert [s.id for s in queue.queued_screens()] == [needs, plain]
    c = claim(queue, d, archive_dir="/archives-X/", machine_id=machine, node_resources={"nvme": 4})
    assert c.screen.id == plain
    stored = queue.latest_attempt(plain)
    assert (stored.machine_id, stored.source_freeze) == (machine, FREEZE)
    assert stored.archive_path == f"/archives-X/screen-{plain:05d}-attempt-1-{stored.attempt_key}.zip"


def test_a_claims_node_checks_count_every_other_running_attempt_and_every_done_replica(queue):
    """A look-ahead slot leaves out its own attempt only: another screen running on the node
    still keeps an exclusive screen off it. A replica that ran to the end (done) on a node keeps
    its siblings off that node; one that failed there does not. A screen needing nothing is
    claimed before a lower-priority one whose needs fit. Catches the look-ahead exception
    leaving out every running attempt, the replica check counting failed attempts or missing
    done ones, and screens without needs dropped when some needs fit."""
    p = protocol(queue)
    d = queue.register_dispatcher("d", "h")
    mine, theirs = (queue.create_screen(protocol_id=p, submitter="a", priority=9) for _ in range(2))
    slot, other = claim(queue, d, node="n1", screen_id=mine), claim(queue, d, node="n1", screen_id=theirs)
    exclusive = queue.create_screen(protocol_id=p, submitter="a", exclusive_node=True, priority=8)
    assert claim(queue, d, node="n1", follows_attempt=slot.attempt.id) is None  # `theirs` still runs on n1
    queue.finish_attempt(other.attempt.id, status="done")
    assert claim(queue, d, node="n1", follows_attempt=slot.attempt.id).screen.id == exclusive
    done_group = queue.create_screens(2, spread=True, protocol_id=p, submitter="a", priority=7)
    ran = claim(queue, d, node="n2", screen_id=done_group[0])
    queue.finish_attempt(ran.attempt.id, status="done")
    assert claim(queue, d, node="n2", screen_id=done_group[1]) is None  # its sibling is done on n2
    failed_group = queue.create_screens(2, spread=True, protocol_id=p, submitter="a", priority=7)
    broke = claim(queue, d, node="n3", screen_id=failed_group[0])
    queue.finish_attempt(broke.attempt.id, status="failed", error="boom")
    assert claim(queue, d, node="n3", screen_id=failed_group[1]).screen.id == failed_group[1]
    plain = queue.create_screen(protocol_id=p, submitter="a", priority=20)
    queue.create_screen(protocol_id=p, submitter="a", priority=19, resources={"nvme": 1})
    assert claim(queue, d, node="n4", node_resources={"nvme": 1}).screen.id == plain


def test_a_new_screen_is_queued_now_with_the_documented_defaults(queue, clock):
    """A screen created without options (one, or a batch): queued at the clock's time, no attempt used, 1
    repetition, priority 0, 3 attempts at most, the node not exclusive; a protocol id that is
    not stored is refused naming the protocol. Catches a default changed, the status, creation
    time or attempt count not set, and the refusal naming something else."""
    clock.advance(3)
    s = queue.screen(queue.create_screen(protocol_id=protocol(queue), submitter="a"))
    assert (s.status, s.created_at, s.attempts_used, s.repetitions, s.priority, s.max_attempts, s.exclusive_node) == (
        "queued", T0 + timedelta(seconds=3), 0, 1, 0, 3, False)
    for i in queue.create_screens(2, protocol_id=protocol(queue), submitter="a"):  # the batch path's own defaults
        s = queue.screen(i)
        assert (s.status, s.attempts_used, s.repetitions, s.priority, s.max_attempts) == ("queued", 0, 1, 0, 3)
    with pytest.raises(NotFound) as e:
        queue.create_screen(protocol_id=999_999, submitter="a")
    assert str(e.value) == "no protocol with id 999999; list screens with `packbench screens list`"


def test_a_claim_that_fails_after_the_nodes_lock_leaves_no_lock_or_transaction_behind(pg_url, clock, monkeypatch):
    """PostgreSQL only: a claim for a node opens a transaction and takes the node's advisory lock;
    when it fails midway (here the fit check raises), it must roll both back before the connection
    goes back to the pool. Catches a missing or broken ROLLBACK: the pooled connection would keep
    the node locked, and every other dispatcher's claim for the node would wait on it."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    import packbench.db.queue as queue_module
    from packbench.db.queue import new_attempt_key

    with Store(pg_url, clock=clock, retry_delays=()) as store:
        store.upgrade()
        p = protocol(store)
        d = store.register_dispatcher("d", "h")
        screen_id = store.create_screen(protocol_id=p, submitter="a", resources={"nvme": 1})
        node = f"n-{new_attempt_key()}"  # no other run's claim takes this node's lock

        def broken(*args, **kwargs):
            raise RuntimeError("the fit check failed")

        monkeypatch.setattr(queue_module, "_fitting", broken)
        with pytest.raises(RuntimeError, match="^the fit check failed$"):
            claim(store, d, node=node, node_resources={"nvme": 1})
        monkeypatch.undo()
        engine = create_engine(pg_url, poolclass=NullPool)
        with engine.connect() as other:  # another session may take the node's lock at once
            free = other.exec_driver_sql(f"SELECT pg_try_advisory_xact_lock({queue_module._node_lock_key(node)})")
            assert free.scalar_one() is True, "the failed claim's connection still holds the node's lock"
            other.rollback()
        engine.dispose()
        assert claim(store, d, node=node, node_resources={"nvme": 1}).screen.id == screen_id
