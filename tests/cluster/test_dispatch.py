"""The dispatcher on a real multi-node Ray cluster (logical GPUs on this CPU machine).

`ray.cluster_utils.Cluster`: a head without GPUs and two worker nodes with one logical GPU each,
shared by the module. Dispatchers run in this process (or as `packbench dispatch` subprocesses
joining the cluster, where a test kills or signals them); every screen is a tiny synthetic one.
Faults, as issue 12 lists them: concurrent dispatchers, a worker killed, a dispatcher killed,
a node removed, cancels, a database that stays down, signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from packbench.core.archive import ArchiveReader
from packbench.core.settings import Settings
from packbench.db.errors import DatabaseLocked, DatabaseUnavailable
from packbench.db.store import Store
from packbench.service.submit import submit
from tests.service.screens import protocol_file as screen_protocol

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=2, num_gpus=1)
    ray.shutdown()  # an embedded Ray an earlier test left in this process
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def protocol_file(folder: Path, *, prompts: int = 1, continuation: int = 4, name: str = "tiny-screen") -> Path:
    """The dispatcher tests' protocol (tests/service/screens.py), with this file's defaults."""
    return screen_protocol(folder, prompts=prompts, continuation=continuation, name=name)


def settings(cluster, tmp_path, models, **changes) -> Settings:
    return Settings(address=cluster.address, archive_dir=tmp_path / "archives", model_cache=models,
                    placement_timeout_s=120, **changes)


@pytest.fixture
def store(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'packbench.db'}", retry_delays=(0.05, 0.1)) as s:
        s.upgrade()
        yield s


def dispatcher(store, cfg, **options):
    """The dispatcher on this cluster: service/dispatcher/ over cluster/pool.py's RayPool."""
    from packbench.cluster.pool import RayPool
    from packbench.service.dispatcher import Dispatcher

    return Dispatcher(store, cfg, RayPool(cfg), **options)


def wait_for(predicate, timeout: float = 120, what: str = "condition"):
    """Poll `predicate` until it is truthy. A poll that finds SQLite locked by the dispatcher's
    write (the store's own retries spent) is a poll that saw nothing yet, as for any reader."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except DatabaseLocked:
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def episodes_of(store, screen_id: int) -> dict[int, list[int]]:
    return {a.number: [e.plan_index for e in store.episodes(a.id)] for a in store.attempts(screen_id)}


def running_attempt_with_episodes(store, screen_id: int, n: int = 1):
    def check():
        attempts = store.attempts(screen_id)
        live = [a for a in attempts if a.status == "running"]
        return live[0] if live and len(store.episodes(live[0].id)) >= n else None
    return check


def test_two_workers_run_screens_concurrently_and_each_exactly_once(cluster, tmp_path, models, store):
    """One dispatcher, one worker per GPU: six screens, each done once, on both nodes; a second
    screen of the same model on a worker reuses its model (warm)."""
    d = dispatcher(store, settings(cluster, tmp_path, models), lease_s=30, follow=True)
    serving = threading.Thread(target=d.run)
    serving.start()
    # Queue once both workers are up, so the test does not depend on how fast each one starts.
    wait_for(lambda: len(d.slots) == 2 and all(s.ready for s in d.slots), what="two ready workers")
    ids = submit(store, protocol_file(tmp_path), replicas=6)
    wait_for(lambda: all(store.screen(i).status == "done" for i in ids), what="six screens done")
    d.stopping = "test"
    serving.join(60)
    outcomes = d.outcomes
    assert sorted(o.screen_id for o in outcomes) == ids and {o.status for o in outcomes} == {"done"}
    attempts = [a for i in ids for a in store.attempts(i)]
    assert len(attempts) == 6 and {a.status for a in attempts} == {"done"}
    assert len({a.node for a in attempts}) == 2  # both GPUs busy
    assert {a.model_state for a in attempts} == {"cold", "warm"}
    assert all(ArchiveReader(Path(a.archive_path)).complete for a in attempts)
    assert len({Path(a.archive_path).name for a in attempts}) == 6
    # Where each worker's start went is archived with its environment (bench/queue_timeline.py).
    worker = ArchiveReader(Path(attempts[0].archive_path)).read_json("worker.json")
    assert set(worker["environment"]["startup"]) == {"process_s", "import_s", "init_s"}
    assert worker["environment"]["startup"]["import_s"] > 0 and type(worker["environment"]["torch"]) is str
    # The worker's share of the cores reached torch (set before it imported torch): a joined
    # cluster's worker has its node's cores.
    assert worker["environment"]["threads"] == (os.cpu_count() or 1)


def test_a_worker_claims_its_next_screen_while_its_last_episodes_run(cluster, tmp_path, models, store):
    """Look-ahead claims: with one worker, each screen after the first is claimed before the
    previous one has finished, runs after it on the same worker, and neither is marked as
    sharing the node; every episode is recorded exactly once and every archive is sealed."""
    ids = submit(store, protocol_file(tmp_path, prompts=2), replicas=3)
    outcomes = dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=30).run()
    assert sorted(o.screen_id for o in outcomes) == ids and {o.status for o in outcomes} == {"done"}
    runs = [store.latest_attempt(i) for i in ids]
    assert len({a.worker for a in runs}) == 1 and [len(store.attempts(i)) for i in ids] == [1, 1, 1]
    ordered = sorted(runs, key=lambda a: a.started_at)
    assert all(b.started_at < a.finished_at for a, b in zip(ordered, ordered[1:]))  # claimed ahead
    assert not any(a.shared_node for a in runs)
    for a in runs:
        assert sorted(e.plan_index for e in store.episodes(a.id)) == list(range(6))
        reader = ArchiveReader(Path(a.archive_path))
        assert reader.complete and len(reader.episodes()) == 6


def test_a_busy_worker_of_another_cluster_on_the_host_is_said_once_and_recorded(cluster, tmp_path, models, store):
    """A packbench worker this dispatcher did not start (another cluster's, on another GPU of the
    host), busy while the screen runs, shares the host's cores and memory: the dispatcher says so
    once per attempt, and every episode's record lists it."""
    from packbench.engine.gpu_lock import HostPresence

    (screen_id,) = submit(store, protocol_file(tmp_path))
    said: list[str] = []
    # In the host's lock directory, where the worker actors mark (tests/conftest.py points the test
    # process's own marks elsewhere).
    foreign = HostPresence("GPU-foreign", directory=Path("/tmp/packbench-gpu-locks"))
    foreign.busy()  # at work all along (an idle worker is not named)
    try:
        dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=30,
                   progress=lambda message, **event: said.append(message)).run()
    finally:
        foreign.release()
    notes = [m for m in said if "was shared with packbench worker" in m]
    assert len(notes) == 1 and notes[0].startswith(f"screen {screen_id}: host ")
    assert f"pid {os.getpid()} (GPU-foreign)" in notes[0]
    reader = ArchiveReader(Path(store.latest_attempt(screen_id).archive_path))
    records = [reader.read_json(e.record) for e in reader.episodes()]
    assert records and all([os.getpid(), "GPU-foreign"] in r["host_workers"] for r in records)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_dispatchers_share_one_queue(cluster, tmp_path, models, backend, request):
    """Two dispatchers (one worker each) drain six screens: every screen runs exactly once."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.db'}"
        context = None
    else:
        from tests.db.conftest import fresh_pg_schema, skip_without_pg

        context = fresh_pg_schema(skip_without_pg())
        url = context.__enter__()
        request.addfinalizer(lambda: context.__exit__(None, None, None))
    with Store(url) as s:
        s.upgrade()
    stores = [Store(url) for _ in range(2)]
    ds = [dispatcher(mine, settings(cluster, tmp_path, models), workers=1, lease_s=30, follow=True) for mine in stores]
    threads = [threading.Thread(target=d.run) for d in ds]
    for t in threads:
        t.start()
    # Queue once both dispatchers' workers are up: both then claim from the start.
    wait_for(lambda: all(d.slots and d.slots[0].ready for d in ds), what="both dispatchers' workers")
    with Store(url) as s:
        ids = submit(s, protocol_file(tmp_path), replicas=6)
        wait_for(lambda: all(s.screen(i).status == "done" for i in ids), what="six screens done")
    for d in ds:
        d.stopping = "test"
    for t in threads:
        t.join(120)
    for mine in stores:
        mine.close()
    ran = sorted(o.screen_id for d in ds for o in d.outcomes)
    assert ran == ids and all(d.outcomes for d in ds)  # every screen once, both dispatchers took part
    with Store(url) as s:
        attempts = [a for i in ids for a in s.attempts(i)]
        assert [a.status for a in attempts] == ["done"] * 6
        assert all(s.screen(i).status == "done" for i in ids)


def test_a_killed_worker_fails_its_attempt_and_the_screen_completes_on_another(cluster, tmp_path, models, store):
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=6, continuation=8))
    d = dispatcher(store, settings(cluster, tmp_path, models), lease_s=30)
    killer_saw: dict = {}

    def kill_mid_screen():
        attempt = wait_for(running_attempt_with_episodes(store, screen_id, 2), what="two episodes")
        killer_saw["episodes"] = len(store.episodes(attempt.id))
        os.kill(int(attempt.worker.rsplit("pid ", 1)[1]), signal.SIGKILL)

    t = threading.Thread(target=kill_mid_screen)
    t.start()
    outcomes = d.run()
    t.join()
    first, second = store.attempts(screen_id)
    assert first.status == "failed" and "died" in first.error and first.worker.split()[0] in first.error
    assert second.status == "done" and store.screen(screen_id).status == "done"
    rows = episodes_of(store, screen_id)
    assert len(rows[1]) >= killer_saw["episodes"] and rows[1] == list(range(len(rows[1])))  # kept, a prefix
    assert rows[2] == list(range(14))  # 2 conditions x (1 warmup + 6 prompts), none lost or duplicated
    partial = ArchiveReader(Path(first.archive_path))
    assert not partial.complete and len(partial.episodes()) == len(rows[1])
    assert [o.status for o in outcomes] == ["failed", "done"]


def test_a_hung_worker_is_timed_out_killed_and_the_screen_completes_on_another(cluster, tmp_path, models, store):
    """A worker stopped mid-screen (SIGSTOP: it never replies, as a deadlocked CUDA call) is
    taken as hung after the episode timeout: ray.kill ends it, its attempt fails saying it
    timed out, and a replacement runs the screen (before, the screen stayed `running`)."""
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=6, continuation=8))
    d = dispatcher(store, settings(cluster, tmp_path, models, episode_timeout_s=3.0), lease_s=30)
    stopped: dict = {}

    def stop_mid_screen():
        attempt = wait_for(running_attempt_with_episodes(store, screen_id, 2), what="two episodes")
        stopped["pid"] = int(attempt.worker.rsplit("pid ", 1)[1])
        os.kill(stopped["pid"], signal.SIGSTOP)

    t = threading.Thread(target=stop_mid_screen)
    t.start()
    outcomes = d.run()
    t.join()
    first, second = store.attempts(screen_id)
    assert first.status == "failed" and " timed out: no reply to episode " in first.error
    assert "within 3 s (--episode-timeout); the worker was killed" in first.error
    assert second.status == "done" and store.screen(screen_id).status == "done"
    rows = episodes_of(store, screen_id)
    assert rows[1] == list(range(len(rows[1]))) and rows[2] == list(range(14))
    assert [o.status for o in outcomes] == ["failed", "done"]
    wait_for(lambda: not os.path.exists(f"/proc/{stopped['pid']}"), what="the hung worker's process gone")


def test_cancel_a_queued_and_a_running_screen(cluster, tmp_path, models, store):
    (never,) = submit(store, protocol_file(tmp_path), priority=-1)
    store.cancel_screen(never)
    (running,) = submit(store, protocol_file(tmp_path, prompts=30, continuation=16))  # 62 episodes
    d = dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=1.5)

    def cancel_mid_screen():
        wait_for(running_attempt_with_episodes(store, running, 1), what="an episode")
        store.cancel_screen(running)

    t = threading.Thread(target=cancel_mid_screen)
    t.start()
    outcomes = d.run()
    t.join()
    assert store.attempts(never) == [] and store.screen(never).status == "cancelled"
    (attempt,) = store.attempts(running)
    assert attempt.status == "cancelled" and store.screen(running).status == "cancelled"
    kept = len(store.episodes(attempt.id))
    assert 1 <= kept < 62
    reader = ArchiveReader(Path(attempt.archive_path))
    assert not reader.complete and len(reader.episodes()) == kept  # partial archive kept
    assert [o.status for o in outcomes] == ["cancelled"]


def test_a_database_that_stays_down_stops_the_dispatcher_and_keeps_the_evidence(cluster, tmp_path, models, store,
                                                                                  monkeypatch):
    (screen_id,) = submit(store, protocol_file(tmp_path))
    real = Store.put_episode
    calls = {"n": 0}

    def down(self, attempt_id, record):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise DatabaseUnavailable("connection refused; gave up on put_episode after 8 tries over 12.7 s")
        return real(self, attempt_id, record)

    from tests.service.screens import process_gone

    monkeypatch.setattr(Store, "put_episode", down)
    d = dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=30)  # one screen: one worker
    assert d.run() == [] and d.stopping == "database" and "gave up" in d.fatal
    monkeypatch.setattr(Store, "put_episode", real)
    process_gone(tmp_path / "packbench.db", d.state.id)  # a one-shot dispatch is a process of its own: it ends
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "running"  # nothing could be recorded: the lease is left to expire
    reader = ArchiveReader(Path(attempt.archive_path))
    assert len(reader.episodes()) == 2 and len(store.episodes(attempt.id)) == 1  # the archive holds both
    # The database is back; the dispatcher's process is gone from this host: a new dispatcher
    # reaps its attempt at once (not after its 30 s lease) and reruns the screen.
    outcomes = dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=30).run()
    lost, done = store.attempts(screen_id)
    assert lost.status == "lost" and done.status == "done" and [o.status for o in outcomes] == ["done"]
    # Issue 27, case 13: the lost attempt's archive holds an episode the database lacks, until
    # reconciliation inserts it (checked by its CRC-32: nobody sealed that archive).
    assert len(store.episodes(lost.id)) == 1
    from packbench.service.reconcile import reconcile

    report = reconcile(store)
    assert [(r.attempt_id, r.inserted, r.check, r.refused) for r in report.attempts] == [(lost.id, 1, "crc32", ())]
    assert [e.plan_index for e in store.episodes(lost.id)] == [e.index for e in reader.episodes()] == [0, 1]
    assert reconcile(store).inserted == 0  # idempotent
    (lost,) = [a for a in store.attempts(screen_id) if a.id == lost.id]
    assert lost.reconciled_episodes == 1 and lost.reconciled_check == "crc32" and lost.reconciled_at is not None


def cli_dispatch(cluster, tmp_path, models, *args) -> subprocess.Popen:
    env = dict(os.environ, PACKBENCH_DB_URL=f"sqlite:///{tmp_path / 'packbench.db'}", RAY_AUTH_MODE="disabled",
               PYTHONPATH=str(ROOT), PACKBENCH_MODEL_CACHE=str(models))
    return subprocess.Popen([sys.executable, "-m", "packbench", "dispatch", "--address", cluster.address,
                             "--archive-dir", str(tmp_path / "archives"), *args],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_dispatcher_gives_its_screen_back(cluster, tmp_path, models, store, sig, code):
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=6, continuation=8))
    proc = cli_dispatch(cluster, tmp_path, models, "--follow", "--workers", "1")
    try:
        wait_for(running_attempt_with_episodes(store, screen_id, 1), what="an episode")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-2000:]
    assert "held screens are back in the queue" in err
    (attempt,) = store.attempts(screen_id)
    assert attempt.status == "interrupted" and store.screen(screen_id).status == "queued"
    assert store.screen(screen_id).attempts_used == 0
    assert store.queue_status().counts["running"] == 0


def test_a_killed_dispatcher_leaves_a_lost_attempt_that_another_reclaims(cluster, tmp_path, models, store):
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=6, continuation=8))
    proc = cli_dispatch(cluster, tmp_path, models, "--workers", "1", "--lease", "2")
    try:
        wait_for(running_attempt_with_episodes(store, screen_id, 1), what="an episode")
        proc.kill()  # SIGKILL: no chance to give anything back
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    d = dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=2, follow=True)
    stopper = threading.Thread(target=lambda: (wait_for(lambda: store.screen(screen_id).status == "done",
                                                         what="the screen to finish"),
                                               setattr(d, "stopping", "test")))
    stopper.start()
    d.run()
    stopper.join()
    lost, done = store.attempts(screen_id)
    assert lost.status == "lost" and f"pid {proc.pid} on " in lost.error  # on this host: gone, not waited for
    assert done.status == "done" and len(store.episodes(done.id)) == 14
    assert not ArchiveReader(Path(lost.archive_path)).complete  # the lost attempt's evidence stays
    assert store.queue_status().counts["running"] == 0


def test_audits_fan_out_to_other_nodes_and_repeat_with_one_digest(cluster, tmp_path, models, store):
    """`audit --ray --other-node --repeat 2`: each audit runs on a node other than the producer's,
    the two repeats on distinct nodes, with one digest; every audit is recorded with its node."""
    from packbench.service.audit import audit_screens, repeat_disagreements

    ids = submit(store, protocol_file(tmp_path), replicas=2)
    dispatcher(store, settings(cluster, tmp_path, models), lease_s=30).run()
    seen = []
    outcomes = audit_screens(store, ids, on_ray=True, settings=settings(cluster, tmp_path, models), other_node=True,
                             repeat=2, concurrency=2, progress=lambda done, total: seen.append((done, total)))
    assert len(outcomes) == 4 and all(o.agrees and o.recorded for o in outcomes)
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]  # the CLI's progress bar hears every audit
    assert repeat_disagreements(outcomes) == []
    for screen_id in ids:
        attempt = store.latest_attempt(screen_id)
        mine = [o for o in outcomes if o.screen_id == screen_id]
        assert len({o.node for o in mine}) == 2 and attempt.node not in {o.node for o in mine}
        audits = store.audits(attempt.id)
        assert {(a.kind, a.node) for a in audits} == {("ray", o.node) for o in mine}


def test_an_archive_missing_on_the_auditing_node_travels_as_bytes(tmp_path, store, cluster, models):
    """The task side of shipping: without the file, the bytes it is handed give the same digest."""
    from packbench.cluster.audit import _audit_here

    (screen_id,) = submit(store, protocol_file(tmp_path))
    dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=30).run()
    path = Path(store.latest_attempt(screen_id).archive_path)
    here = _audit_here(str(path), None, {})
    elsewhere = _audit_here(str(tmp_path / "not-on-this-node" / path.name), path.read_bytes(), {})
    assert here["shipped"] is False and elsewhere["shipped"] is True
    assert elsewhere["record"] == here["record"] and here["record"]["result"] == "agree"
    assert _audit_here(str(tmp_path / "nowhere.zip"), None, {})["missing"] is True


def test_a_dispatcher_with_a_signing_key_signs_every_archive(cluster, tmp_path, models, store):
    """--signing-key: each sealed archive gets <archive>.sig; `audit --archive --trust` agrees with
    the right public key and refuses another one."""
    from packbench.core.audit import audit_archive
    from packbench.core.provenance import generate_key, signature_path

    key, pub, _ = generate_key(tmp_path / "deploy.pem")
    _, other, _ = generate_key(tmp_path / "other.pem")
    (screen_id,) = submit(store, protocol_file(tmp_path))
    outcomes = dispatcher(store, settings(cluster, tmp_path, models, signing_key=key), workers=1, lease_s=30).run()
    assert [o.status for o in outcomes] == ["done"]
    archive = Path(store.latest_attempt(screen_id).archive_path)
    assert signature_path(archive).is_file() and audit_archive(archive).agrees
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    trusted = subprocess.run([sys.executable, "-m", "packbench", "audit", "--archive", str(archive), "--trust", str(pub)],
                             capture_output=True, text=True, env=env)
    assert trusted.returncode == 0, trusted.stdout[-1500:] + trusted.stderr[-1500:]
    stranger = subprocess.run([sys.executable, "-m", "packbench", "audit", "--archive", str(archive), "--trust", str(other)],
                              capture_output=True, text=True, env=env)
    assert stranger.returncode == 1


def test_screens_needing_custom_resources_run_where_a_node_declares_them(cluster, tmp_path, models, store):
    """placement.resources: a node added with {fast_nvme: 1} and two GPUs takes both screens that
    need it, one at a time (its two workers share one fast_nvme); a plain screen runs anywhere;
    a screen needing more than any node declares stays queued with the reason."""
    fast = cluster.add_node(num_cpus=2, num_gpus=2, resources={"fast_nvme": 1})
    try:
        def needing(amount, name):
            path = protocol_file(tmp_path, name=name)
            body = yaml.safe_load(path.read_text())
            body["placement"] = {"resources": {"fast_nvme": amount}}
            path.write_text(yaml.safe_dump(body))
            return path

        nvme = submit(store, needing(1, "nvme"), replicas=2)
        (plain,) = submit(store, protocol_file(tmp_path))
        (too_big,) = submit(store, needing(2, "nvme-x2"))
        d = dispatcher(store, settings(cluster, tmp_path, models), workers=4, lease_s=30)
        outcomes = d.run()
        assert sorted(o.screen_id for o in outcomes) == sorted([*nvme, plain])
        assert {o.status for o in outcomes} == {"done"}
        runs = [store.latest_attempt(i) for i in nvme]
        assert {a.node for a in runs} == {fast.node_id}
        first, second = sorted(runs, key=lambda a: a.started_at)
        # One fast_nvme: the second started after the first ended, or follows it on its worker.
        assert second.started_at >= first.finished_at or second.worker == first.worker
        left = store.screen(too_big)
        assert left.status == "queued" and store.attempts(too_big) == []
        assert "needs Ray resources {fast_nvme: 2}" in left.unplaceable_reason
        assert "fast_nvme: 1" in left.unplaceable_reason
    finally:
        cluster.remove_node(fast)


def test_a_node_removed_mid_screen(cluster, tmp_path, models, store):
    """Runs last: it removes a node (and adds one back for whatever follows)."""
    (screen_id,) = submit(store, protocol_file(tmp_path, prompts=6, continuation=8))
    d = dispatcher(store, settings(cluster, tmp_path, models), lease_s=30)

    def remove_its_node():
        attempt = wait_for(running_attempt_with_episodes(store, screen_id, 1), what="an episode")
        node = next(n for n in cluster.list_all_nodes() if n.node_id == attempt.node)
        cluster.remove_node(node)

    t = threading.Thread(target=remove_its_node)
    t.start()
    outcomes = d.run()
    t.join()
    cluster.add_node(num_cpus=2, num_gpus=1)
    first, second = store.attempts(screen_id)
    assert first.status == "failed" and "died" in first.error
    assert second.status == "done" and second.node != first.node
    assert episodes_of(store, screen_id)[2] == list(range(14))
    assert [o.status for o in outcomes] == ["failed", "done"]


def test_json_lines(cluster, tmp_path, models, store):
    """`dispatch --json` over two screens: one JSON object per line (one worker runs both: a second
    would start torch beside it on the 2 cores for nothing this test reads)."""
    submit(store, protocol_file(tmp_path), replicas=2)
    proc = cli_dispatch(cluster, tmp_path, models, "--json", "--workers", "1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["status"] == "done" for line in lines)


# ----------------------------------------------------------------------------- database outages


class TcpProxy:
    """127.0.0.1:<port> forwarding to PostgreSQL; `down()` refuses new connections and cuts the
    open ones (what a server restart or a failover does to a client), `up()` listens again on the
    same port. The real server keeps running for every other test."""

    def __init__(self, target: tuple[str, int]) -> None:
        import socket

        self.socket, self.target = socket, target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.conns: list = []
        self.listener = None
        self.up()

    def up(self) -> None:
        s = self.socket.socket()
        s.setsockopt(self.socket.SOL_SOCKET, self.socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def down(self) -> None:
        listener, self.listener = self.listener, None
        listener.close()
        for c in self.conns:
            try:
                c.shutdown(self.socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.conns.clear()

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self.listener is not listener:
                client.close()
                return
            server = self.socket.create_connection(self.target)
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass


class SqliteLock:
    """Another connection holding the SQLite database's write lock (BEGIN IMMEDIATE): every
    packbench transaction (each takes the lock at BEGIN) waits its busy timeout, then fails."""

    def __init__(self, path: Path) -> None:
        import sqlite3

        self.connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def down(self) -> None:
        self.connection.execute("BEGIN IMMEDIATE")

    def up(self) -> None:
        self.connection.execute("ROLLBACK")


def _rows(url: str, attempt_id: int) -> int:
    """Episode rows, read beside the outage (a plain sqlite3 read needs no write lock)."""
    if url.startswith("sqlite"):
        import sqlite3

        with sqlite3.connect(url.removeprefix("sqlite:///")) as c:
            return c.execute("SELECT count(*) FROM episodes WHERE attempt_id = ?", (attempt_id,)).fetchone()[0]
    with Store(url) as s:
        return len(s.episodes(attempt_id))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_following_dispatcher_waits_out_a_database_outage(cluster, tmp_path, models, backend, request,
                                                            monkeypatch):
    """The database goes away mid-screen (PostgreSQL refusing connections through a proxy, or
    SQLite held locked by another connection) for much longer than the Store's retries and the
    lease: the dispatcher says so once, keeps the episodes in flight in the archive, probes with a
    capped backoff, and when the database is back reconciles their rows, renews its lease and
    finishes the screen: one attempt, archive episodes == database rows, none lost or twice."""
    if backend == "sqlite":
        import packbench.db.session

        monkeypatch.setattr(packbench.db.session, "SQLITE_BUSY_TIMEOUT_MS", 100)  # the lock fails fast, as a long outage would
        path = tmp_path / "outage.db"
        direct = url = f"sqlite:///{path}"
        with Store(url) as s:
            s.upgrade()
        outage = SqliteLock(path)
    else:
        from sqlalchemy.engine import make_url

        from tests.db.conftest import fresh_pg_schema, skip_without_pg

        context = fresh_pg_schema(skip_without_pg())
        direct = context.__enter__()
        request.addfinalizer(lambda: context.__exit__(None, None, None))
        real = make_url(direct)
        outage = TcpProxy((real.host or "127.0.0.1", real.port or 5432))
        request.addfinalizer(lambda: outage.listener and outage.down())
        url = real.set(host="127.0.0.1", port=outage.port).render_as_string(hide_password=False)
        with Store(direct) as s:
            s.upgrade()
    with Store(direct) as s:
        (screen_id,) = submit(s, protocol_file(tmp_path, prompts=6, continuation=8))  # 14 episodes
    said: list[str] = []
    store = Store(url, retry_delays=(0.05, 0.1))
    d = dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=2, follow=True,
                   outage_backoff=(0.05, 0.2), progress=lambda msg, **event: said.append(msg))
    thread = threading.Thread(target=d.run)
    thread.start()
    try:
        with Store(direct) as s:
            attempt = wait_for(running_attempt_with_episodes(s, screen_id, 2), what="two episodes")
        outage.down()
        # Observable, not slept: the dispatcher has probed many times at its cap, long past the
        # Store's retries (0.15 s) and the lease (2 s), and never given up.
        wait_for(lambda: d.outage is not None and d.outage.probes >= 15, timeout=60, what="15 failed probes")
        archived = len(ArchiveReader(Path(attempt.archive_path)).episodes())
        rows_during = _rows(direct, attempt.id)
        assert archived > rows_during  # the episodes in flight went to the archive without rows
        assert d.fatal is None and thread.is_alive()
        outage.up()
        with Store(direct) as s:
            wait_for(lambda: s.screen(screen_id).status == "done", what="the screen to finish")
    finally:
        if getattr(outage, "listener", True) is None:  # a failed assertion left the proxy down
            outage.up()
        d.stopping = "test"
        thread.join(120)
        store.close()
    waiting = [m for m in said if m.startswith("database unavailable since")]
    back = [m for m in said if m.startswith("database back after")]
    assert len(waiting) == 1 and len(back) == 1, said  # one line each way, not one per probe
    assert "waiting for it" in waiting[0] and "continuing" in back[0]
    assert len(d.outages) == 1 and d.outages[0]["probes"] >= 15 and d.outages[0]["reconciled"] >= 1
    with Store(direct) as s:
        (only,) = s.attempts(screen_id)  # the lease expired in the outage, yet it was renewed, not lost
        assert only.status == "done" and only.reconciled_check == "writer"
        assert only.reconciled_episodes == archived - rows_during
        rows = [e.plan_index for e in s.episodes(only.id)]
        reader = ArchiveReader(Path(only.archive_path))
        assert reader.complete and reader.verify() == []
        assert rows == list(range(14)) == [e.index for e in reader.episodes()]
        from packbench.service.audit import audit_screens

        (audited,) = audit_screens(s, [screen_id])
        assert audited.agrees, audited.report.record["problems"]


def test_a_following_dispatcher_waits_for_a_database_down_at_start_and_idle(cluster, tmp_path, models, request):
    """PostgreSQL refusing before the dispatcher registers: it waits, then registers; refusing again
    while it idles: it waits again; stopped during that wait it leaves without a database write."""
    from sqlalchemy.engine import make_url

    from tests.db.conftest import fresh_pg_schema, skip_without_pg

    context = fresh_pg_schema(skip_without_pg())
    direct = context.__enter__()
    request.addfinalizer(lambda: context.__exit__(None, None, None))
    with Store(direct) as s:
        s.upgrade()
    real = make_url(direct)
    proxy = TcpProxy((real.host or "127.0.0.1", real.port or 5432))
    url = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    proxy.down()
    said: list[str] = []
    store = Store(url, retry_delays=(0.05,))
    d = dispatcher(store, settings(cluster, tmp_path, models), workers=1, lease_s=2, follow=True,
                   outage_backoff=(0.05, 0.1), progress=lambda msg, **event: said.append(msg))
    thread = threading.Thread(target=d.run)
    thread.start()
    try:
        wait_for(lambda: d.outage is not None and d.outage.probes >= 5, timeout=30, what="probes before registering")
        assert d.id is None and not d.slots
        proxy.up()
        wait_for(lambda: d.slots and d.slots[0].ready, what="registered, with its worker")
        with Store(direct) as s:
            (row,) = s.dispatchers()
        assert row.id == d.id
        proxy.down()  # now idle: the heartbeat finds it gone
        wait_for(lambda: d.outage is not None and d.outage.probes >= 5, timeout=30, what="probes while idle")
        d.stopping = "SIGTERM"
        thread.join(15)
        assert not thread.is_alive() and d.fatal is None
    finally:
        d.stopping = d.stopping or "test"
        if proxy.listener is None:
            proxy.up()
        thread.join(60)
        store.close()
    kinds = [m.split(" since ")[0].split(" after ")[0] for m in said if m.startswith("database ")]
    assert kinds == ["database unavailable", "database back", "database unavailable"], said
    with Store(direct) as s:
        (row,) = s.dispatchers()
        assert row.stopped_at is None  # stopped while the database was down: nothing could be written


def test_sigterm_in_a_blocking_ray_call_arrives_as_keyboard_interrupt_and_is_remembered(cluster, monkeypatch):
    """What core/signals.py rests on. Bug caught: `packbench audit reexecute` terminated while it
    waited on its worker exited 1 with no line (Ray's blocking calls turn a SystemExit raised by a
    signal handler inside them into SystemExit(1)) or died of SIGABRT after Ray's stack dump (its
    core worker's C-level SIGTERM handler). After `signals.install`, SIGTERM in `ray.get` reaches
    the caller as KeyboardInterrupt, and the process knows it was SIGTERM (exit 143, not 130)."""
    import ray

    from packbench.core import signals

    monkeypatch.setattr(signals, "received", [])
    previous = signal.getsignal(signal.SIGTERM)

    @ray.remote(num_cpus=1)
    def slow():
        time.sleep(60)

    try:
        signals.install()
        ref = slow.remote()
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            ray.get(ref)
        assert time.monotonic() - t0 < 30  # stopped by the signal, not by the task's end
    finally:
        signal.signal(signal.SIGTERM, previous)
    ray.cancel(ref, force=True)
    assert signals.received == [signal.SIGTERM] and signals.exit_code() == 143
