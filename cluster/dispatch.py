"""The dispatcher: drains the database queue onto a pool of GPU worker actors.

The database is the record and the queue; Ray is the transport and the placement engine.

- One worker actor per GPU of the cluster (or `workers`), kept across screens: a worker keeps
  its loaded checkpoint for the next screen of the same model (`model_state` warm/cold).
- Each idle worker claims one screen (`Store.claim_screen`: atomic, a lease). Screens run
  concurrently, one per worker; a screen's episodes run in plan order on its worker, submitted
  one ahead (and the next one handed out before the driver persists the one that came back)
  so the worker never waits for the driver. `ray.wait` returns as soon as any call is back.
- A worker whose screen has handed out its last episodes claims its next screen at once (the
  `next` of its slot): the new archive is opened and the load is queued on the same actor
  behind those episodes, so claim, archive creation and load overlap the screen's end. The
  claim ignores the slot's own running attempt in node checks (shared_node, exclusive_node):
  the two screens run one after the other on one worker, never side by side.
- Leases are renewed every third of their length; a renewal refused means the screen was
  cancelled (stop after the episode in flight, attempt `cancelled`) or the attempt was reaped
  as lost (stop touching it). Expired leases of any dispatcher are reaped here too.
- A worker that dies fails its attempt with a cause naming it, and the screen is requeued
  (up to its max_attempts); a replacement actor is started.
- SIGINT/SIGTERM: stop claiming, give every held attempt back (`interrupted`, requeued), exit.
- The database down (`DatabaseUnavailable`, after the Store's own retries): a one-shot
  dispatcher stops (`fatal`); `follow` waits it out however long it lasts (`Outage`): no new
  claims or episodes, the episodes in flight go to their archives without rows, one probe per
  backoff step (doubling up to a cap), one line when the wait starts and one when it ends.
  When the database answers: reconcile the rows its archives hold (service/reconcile.py),
  renew its leases (an attempt reaped meanwhile ends as lost), do the writes it deferred, in
  order, reconcile the archives on this host of attempts that ended since the outage began,
  and continue, reaping no other dispatcher's lease for one lease length.

Ray retries are off everywhere (max_restarts=0, max_task_retries=0): ordering comes from the
database, never from Ray's retries (with max_task_retries > 0, Ray 2.60 ran retried calls out of
submission order in 3 of 3 runs, and retried a call that kills its actor until the restart budget
was gone).
"""

from __future__ import annotations

import json
import logging
from collections import deque
import os
import platform
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from core.dispersion import NOISY_CORES, other_cores
from core.errors import PackbenchError
from db.errors import DatabaseUnavailable
from core.protocol import Protocol, expand, is_builtin_resource, resources_fit
from core.provenance import Signer
from core.settings import Settings
from core.source import source_freeze
from engine.gpu_lock import process_alive
from service.screen import ScreenOutcome, ScreenRun, cause_of, is_bad_input
from service.submit import screen_prompts

log = logging.getLogger(__name__)

LOOKAHEAD = 2  # episodes submitted to a worker at once: one running, one waiting
UPKEEP_MAX_S = 2.0  # longest pause between lease renewals (and so before a cancel is seen)
# Probes of a database that is down (`follow`): the first after 1 s, doubling up to 10 s. The
# cap is how long a dispatcher may idle after the database is back (a 30 s cap left one idle
# for 10 s after a 60 s PostgreSQL outage); one connection attempt per 10 s per dispatcher is
# nothing to a recovering server.
OUTAGE_BACKOFF_S = (1.0, 10.0)


def outage_delays(first: float, cap: float) -> Iterator[float]:
    """Seconds between probes of a database that is down: doubling from `first`, capped, forever."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


@dataclass
class Outage:
    """A database outage that a following dispatcher waits out (what tests observe)."""

    cause: str
    since: float  # time.monotonic() of its first failed try (the Store's retries come before it is noticed)
    started_at: str  # the same, as UTC wall time for the line
    delays: Iterator[float]
    next_probe: float = 0.0
    probes: int = 0  # failed probes so far

    def schedule(self, now: float) -> float:
        delay = next(self.delays)
        self.next_probe = now + delay
        return delay


@dataclass
class Slot:
    """One worker actor and what the dispatcher knows of it."""

    name: str
    actor: Any
    env: dict = field(default_factory=dict)  # describe(): host, pid, gpu, node_id, gpu_uuid, ...
    gpu_type: str | None = None  # Ray's accelerator_type of its node, e.g. "H200"
    resources: dict[str, float] = field(default_factory=dict)  # its node's custom Ray resources (totals)
    machine_id: int | None = None
    active: "Active | None" = None
    next: "Active | None" = None  # claimed while `active` runs its last episodes; its load queued behind them
    placing_since: float | None = None  # set while Ray has not placed it yet

    @property
    def node(self) -> str:
        """Ray node id: distinct for two nodes on one host (hostnames are not)."""
        return self.env.get("node_id", "")

    @property
    def ready(self) -> bool:
        return self.placing_since is None

    def describe(self) -> dict:
        """As `packbench status` lists it (Store.heartbeat)."""
        return {"name": self.name, "node": self.node, "host": self.env.get("host", ""),
                "gpu": self.env.get("gpu") or "cpu", "gpu_index": _gpu_index(self.env),
                "state": "busy" if self.active else "idle",
                **({"screen_id": self.active.run.screen.id} if self.active else {})}


@dataclass(eq=False)  # identity: `in`, `remove` and the refs' ownership checks compare objects, not fields
class Active:
    """A screen running on a slot."""

    slot: Slot
    run: ScreenRun
    protocol: Protocol
    entries: list[dict] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    submitted: int = 0  # episodes handed to the worker
    inflight: int = 0  # calls not back yet (load included)
    stop: str | None = None  # cancelled | lost: no more episodes are submitted
    start: dict | None = None  # a `next` screen's load result, kept until it becomes the slot's active
    looked_ahead: bool = False  # its slot tried to claim its next screen (once: an empty queue is not polled)
    host_shared: bool = False  # said once: another dispatcher's or cluster's worker was busy on its host
    host_busy: bool = False  # said once: other processes kept its host's cores busy during an episode
    ended: bool = False  # its outcome is taken (an ending deferred over an outage never runs twice)

    @property
    def handed_out(self) -> bool:
        """Every planned episode is with the worker (the slot may claim its next screen)."""
        return bool(self.entries) and self.submitted >= len(self.entries)


SILENT_AFTER_S = 5 * UPKEEP_MAX_S  # a dispatcher heartbeats at least every UPKEEP_MAX_S


def held_by_silent(status, *, host: str, alive: Callable[[int], bool]) -> list[str]:
    """One line per running screen whose dispatcher is gone (its pid on this host is not a
    process) or silent (no heartbeat for SILENT_AFTER_S): which screen, and when its lease
    expires and a dispatcher started then requeues it. `status` is a db QueueStatus."""
    by_name = {d.name: d for d in status.dispatchers}
    out = []
    for r in status.running:
        d = by_name.get(r.dispatcher)
        if d is None or r.lease_expires_at is None:
            continue
        silent_s = (status.now - d.heartbeat_at).total_seconds()
        if d.host == host and d.pid is not None and not alive(d.pid):
            why = f"its process (pid {d.pid} on this host) is gone"
        elif silent_s > SILENT_AFTER_S:
            why = f"no heartbeat for {silent_s:.0f} s"
        else:
            continue
        left = max(0.0, (r.lease_expires_at - status.now).total_seconds())
        out.append(f"screen {r.screen_id} is held by dispatcher {d.name} ({why}): attempt {r.attempt}'s lease "
                   f"expires at {r.lease_expires_at.isoformat(timespec='seconds')} (in {left:.0f} s); a "
                   f"`packbench dispatch` after that marks the attempt lost and runs the screen again")
    return out


def _archive_dir(path: Path) -> None:
    """Create the archive directory, or say in one line why it cannot be (nothing is claimed)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PackbenchError(f"cannot create the archive directory {path} ({e.strerror or type(e).__name__}); "
                             f"give --archive-dir (PACKBENCH_ARCHIVE_DIR) a writable directory") from None


def _show(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _gpu_index(env: dict) -> int:
    return int((env.get("gpu_index") or "-1").split(",")[0])


class Dispatcher:
    """Drain the queue (or serve it, `follow`) onto a pool of GPU workers."""

    def __init__(self, store, settings: Settings, *, workers: int | None = None, follow: bool = False,
                 lease_s: float = 60.0, only_screen: int | None = None,
                 progress: Callable[..., None] = lambda msg, **event: None,
                 on_outcome: Callable[[ScreenOutcome], None] = lambda outcome: None,
                 worker_class: Any = None, look_ahead: bool = True,
                 outage_backoff: tuple[float, float] = OUTAGE_BACKOFF_S) -> None:
        self.store, self.settings = store, settings
        self.workers, self.follow, self.lease_s = workers, follow, lease_s
        self.only_screen = only_screen
        self.progress, self.on_outcome = progress, on_outcome
        self.worker_class = worker_class  # tests and the simulator pass their own actor class
        # Claim a worker's next screen while its last episodes run (False: only when idle, as
        # before; bench/cluster.py --no-look-ahead measures the difference).
        self.look_ahead = look_ahead
        self.slots: list[Slot] = []
        # in-flight ref -> (kind, slot, the screen it serves): a late result of an ended screen is
        # recognised as such even when its slot already runs the next one.
        self.refs: dict[Any, tuple[str, Slot, Active | None]] = {}
        self.outcomes: list[ScreenOutcome] = []
        # The latest attempts this dispatcher drove, for their timings (bench/cluster.py); bounded,
        # and stripped of logits once ended, so a dispatcher serving for weeks stays small.
        self.runs: deque[ScreenRun] = deque(maxlen=10_000)
        self.refusals: list[str] = []  # workers refused (their GPU taken) or dead before ready
        self._dead_on_arrival = 0  # workers that died before ever being ready
        self.stopping: str | None = None  # SIGINT | SIGTERM | database, or set by a caller to stop
        self.fatal: str | None = None  # why the dispatcher had to stop (the database stayed down)
        self.held: list[str] = []  # with nothing queued: screens that dispatchers gone silent hold (held_by_silent)
        self.done = False
        self.freeze = source_freeze()
        # The deployment's key signs every sealed archive (<archive>.sig, core/provenance.py).
        self.signer = Signer.load(settings.signing_key) if settings.signing_key else None
        self.id: int | None = None
        self._next_upkeep = 0.0
        self.outage_backoff = outage_backoff
        self.outage: Outage | None = None  # the database is down and `follow` waits for it
        self.outages: list[dict] = []  # each outage waited out: seconds, probes, rows reconciled
        # Database writes that an outage interrupted or that came due during it, run in order
        # once it answers again (each is idempotent or resumes where it stopped).
        self._after_outage: list[Callable[[], None]] = []
        self._no_reap_until = 0.0  # after an outage: time.monotonic() before which no lease is reaped
        self._started = 0

    # ------------------------------------------------------------------------- lifecycle

    def run(self) -> list[ScreenOutcome]:
        """Until drained (or stopped); returns what became of every screen this dispatcher ran."""
        from cluster.runtime import ensure_ray

        if not self.follow and self.only_screen is None:
            self._reap()  # a dead dispatcher's screens count as queued once their leases expired
            if not self.store.queued_screens():
                # Nothing to drain: no Ray is started (seconds, for nothing). Screens a dead
                # dispatcher still holds are said, with when their leases let them go.
                self.held = held_by_silent(self.store.queue_status(), host=platform.node(), alive=process_alive)
                return self.outcomes
        _archive_dir(self.settings.archive_dir)  # before a claim: a claimed attempt would fail on it
        self.ray = ensure_ray(self.settings)
        # Signals reach the main thread only; a dispatcher in another thread (tests) is stopped by
        # setting `stopping`.
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            self._register()
            if self.id is not None:
                self._start_pool()
            while not self.stopping and self.id is not None:
                try:
                    if self.outage is not None:
                        self._ride_out()
                    else:
                        self._step()
                except DatabaseUnavailable as e:
                    if self.follow:
                        self._database_down(e)
                        continue
                    # Retried with backoff already (Store): stop claiming; the archives hold every
                    # finished episode; leases expire and a later dispatcher requeues the screens.
                    self.stopping, self.fatal = "database", str(e)
                    held = [str(s.active.run.archive_path) for s in self.slots if s.active]
                    log.error("database unavailable; stopping. Archives kept as evidence: %s", ", ".join(held) or "none")
                    break
                if self.done:
                    break
        finally:
            self._shutdown()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.outcomes

    def _register(self) -> None:
        """Register this dispatcher (`id`); `follow` waits for a database that is down at start."""
        name = f"dispatch-{platform.node()}-{os.getpid()}"
        while not self.stopping:
            try:
                if self.outage is not None:
                    if time.monotonic() < self.outage.next_probe:
                        time.sleep(min(0.2, self.outage.next_probe - time.monotonic()))
                        continue
                    self.store.ping()  # one try per probe; the register below retries on its own
                self.id = self.store.register_dispatcher(name, platform.node(), pid=os.getpid())
                if self.outage is not None:
                    self._database_back()
                return
            except DatabaseUnavailable as e:
                if not self.follow:
                    raise
                self._database_down(e)

    # ------------------------------------------------------------------------- database outages

    def _database_down(self, e: DatabaseUnavailable) -> None:
        """The database stopped answering (`follow`): wait for it, saying so once."""
        now = time.monotonic()
        if self.outage is not None:  # it failed again while we were catching up: keep waiting
            self.outage.probes += 1
            self.outage.schedule(now)
            return
        first, cap = self.outage_backoff
        # It was failing through the Store's retries before it was raised: the outage began then.
        began = datetime.now(timezone.utc) - timedelta(seconds=e.failing_s)
        self.outage = Outage(cause=e.cause, since=now - e.failing_s, started_at=began.strftime("%H:%M:%S UTC"),
                             delays=outage_delays(first, cap))
        self.outage.schedule(now)
        held = self._in_flight() + self._unpersisted()
        self.progress(f"database unavailable since {self.outage.started_at} ({e.cause}); waiting for it, probing "
                      f"every {first:g}-{cap:g} s: no claims and no new episodes meanwhile; {held} episode"
                      f"{'s' if held != 1 else ''} in flight or archived without a row get their rows from the "
                      f"archives when it answers")

    def _in_flight(self) -> int:
        return sum(a.submitted - a.run.done_count for a in self._actives() if a.entries)

    def _unpersisted(self) -> int:
        return sum(len(a.run.unpersisted) for a in self._actives())

    def _actives(self) -> list[Active]:
        return [a for s in self.slots for a in (s.active, s.next) if a is not None]

    def _ride_out(self) -> None:
        """One turn while the database is down: archive what the workers return; probe on time."""
        wait = max(0.0, min(0.2, self.outage.next_probe - time.monotonic()))
        if self.refs:
            ready, _ = self.ray.wait(list(self.refs), num_returns=len(self.refs), timeout=wait)
            for ref in ready:
                if ref in self.refs:
                    self._handle(ref)
        else:
            time.sleep(wait)
        if time.monotonic() < self.outage.next_probe or self.stopping:
            return
        try:
            self.store.ping()
        except DatabaseUnavailable:
            self.outage.probes += 1
            self.outage.schedule(time.monotonic())
            return
        self._database_back()

    def _database_back(self) -> None:
        """The database answers again: catch up, in order, then carry on (see the module doc)."""
        outage = self.outage
        down_s = time.monotonic() - outage.since
        own = {a.run.attempt.id: a for a in self._actives() if a.run.writer is not None}
        from service.reconcile import reconcile

        report = reconcile(self.store, attempt_ids=list(own),
                           expected={i: a.run.writer.members for i, a in own.items()})
        for done in report.attempts:
            own[done.attempt_id].run.unpersisted.clear()
        if self.id is not None:
            for active in own.values():
                if active.stop is None and not active.ended and not self.store.renew_lease(active.run.attempt.id,
                                                                                         self.lease_s):
                    self._refused(active)  # reaped meanwhile (lost) or cancelled: its ending is deferred below
        # The deferred writes run now (and whatever they start writes at once, not deferred again).
        self.outage = None
        pending, self._after_outage = self._after_outage, []
        while pending:
            action = pending.pop(0)
            try:
                action()
            except DatabaseUnavailable:
                self._after_outage = [action, *pending, *self._after_outage]
                self.outage = outage  # the same outage goes on: no second line
                raise
            except PackbenchError as e:
                log.error("a write deferred over the database outage failed: %s", e)
        try:
            # Every attempt on this host that ended since the outage began (a lease before it, to
            # cover the attempts it cut short): not the whole history, which `db reconcile` reads.
            since = datetime.now(timezone.utc) - timedelta(seconds=down_s + self.lease_s)
            others = reconcile(self.store, finished_since=since)
        except DatabaseUnavailable:
            self.outage = outage
            raise
        self._next_upkeep = 0.0  # renew and heartbeat on the next turn
        # Other dispatchers waited out the same outage and their leases expired too: give them one
        # lease to renew before reaping theirs (a dead dispatcher's screens wait that much longer).
        self._no_reap_until = time.monotonic() + self.lease_s
        for active in self._actives():
            if active.entries and active.stop is None and not active.ended:
                while active.submitted - active.run.done_count < LOOKAHEAD and active.submitted < len(active.entries):
                    self._submit_next(active)
        rows = report.inserted + others.inserted
        self.outages.append({"seconds": down_s, "probes": outage.probes, "reconciled": rows,
                             "attempts": [r.line() for r in report.attempts + others.attempts]})
        detail = "; ".join(r.line() for r in report.attempts + others.attempts)
        self.progress(f"database back after {down_s:.1f} s ({outage.probes} failed probe"
                      f"{'s' if outage.probes != 1 else ''}); reconciled {rows} episode row"
                      f"{'s' if rows != 1 else ''} from archives{f' ({detail})' if detail else ''}; continuing")

    def _when_db(self, action: Callable[[], None]) -> None:
        """Run a database step now; while the database is down (`follow`), once it is back, in order."""
        if self.outage is not None:
            self._after_outage.append(action)
            return
        try:
            action()
        except DatabaseUnavailable:
            if self.follow:
                self._after_outage.append(action)
            raise

    def _step(self) -> None:
        """One turn: upkeep, claims for idle workers, then whatever the workers returned."""
        self._upkeep()
        claimed = self._fill_idle_slots()
        if self._finished(claimed):
            self.done = True
            return
        if not self.refs:
            time.sleep(0.2)
            return
        # num_returns=1: back as soon as any call is; waiting for all of them (as before) held
        # each result until the look-ahead episode was back too, and the worker then idled
        # while the driver caught up (7.8 ms of queue path per episode, docs/benchmarks.md).
        ready, rest = self.ray.wait(list(self.refs), num_returns=1, timeout=0.2)
        if ready and rest:
            ready += self.ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in ready:
            if ref in self.refs:  # a dead worker's other calls were dropped with it
                self._handle(ref)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self.stopping = signal.Signals(signum).name
        log.warning("%s: giving back held screens and stopping", self.stopping)

    def _finished(self, claimed: bool) -> bool:
        """Drained: nothing runs, nothing was claimable, no worker is on its way. With
        `only_screen`: that screen has ended (or it cannot run: no worker at all)."""
        if claimed or any(s.active or s.next for s in self.slots):
            return False
        if self.only_screen is not None:
            if self.store.screen(self.only_screen).status in ("done", "failed", "cancelled"):
                return True
            return not self.slots  # every worker gone and none could be placed
        if self.follow:
            return False
        # A worker still being placed may yet take a screen the others cannot (its GPU type or
        # node): wait for it while screens are queued (bounded by the placement timeout).
        queued = self.store.queued_screens()
        if queued and all(s.ready for s in self.slots):
            self._explain_unplaceable()  # what is left says why in `packbench status`
            return True
        return not queued

    def _shutdown(self) -> None:
        reason = f"dispatcher stopped ({self.stopping})" if self.stopping else "dispatcher stopped"
        # With the database down nothing can be given back: the leases expire and a later
        # dispatcher requeues the screens; the archives keep every episode (db reconcile).
        offline = self.stopping == "database" or self.outage is not None
        for slot in self.slots:
            for active in (slot.active, slot.next):
                if active is not None and active.stop != "lost" and not offline:
                    try:
                        status = self.store.release(active.run.attempt.id, reason)
                        self.progress(f"screen {active.run.screen.id}: attempt {active.run.attempt.number} "
                                      f"interrupted, screen {status}")
                    except PackbenchError as e:
                        log.error("could not give back screen %s: %s", active.run.screen.id, e)
            self._kill(slot)
        if self.id is not None and not offline:
            try:
                self.store.stop_dispatcher(self.id)
            except PackbenchError as e:
                log.error("could not record the dispatcher's stop: %s", e)

    def _kill(self, slot: Slot) -> None:
        try:
            self.ray.kill(slot.actor)
        except Exception:  # already dead
            pass

    # ------------------------------------------------------------------------- the pool

    def _gpus(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("GPU", 0)))

    def _start_pool(self) -> None:
        for _ in range(self.workers or self._gpus()):
            self._add_slot()

    def _add_slot(self) -> None:
        from cluster.worker import start_worker

        self._started += 1
        name = f"worker-{self._started}"
        if self.worker_class is not None:
            actor = self.worker_class.options(num_gpus=1, num_cpus=0).remote()
        else:
            # An embedded cluster is this host: its workers share its cores.
            share = (self.workers or self._gpus()) if self.settings.embedded else 1
            actor = start_worker(self.settings, workers_on_host=share)
        slot = Slot(name=name, actor=actor, placing_since=time.monotonic())
        self.slots.append(slot)
        self.refs[actor.describe.remote()] = ("describe", slot, None)

    def _placed(self, slot: Slot, env: dict) -> None:
        if env.get("gpu_busy"):
            # Its GPU is held by a worker of another cluster on this host: never share it.
            self.refusals.append(env["gpu_busy"])
            log.warning("%s refused: %s", slot.name, env["gpu_busy"])
            self._drop(slot)
            return
        slot.env, slot.placing_since = env, None
        slot.gpu_type, slot.resources = self._node_info().get(slot.node, (None, {}))
        twin = next((s for s in self.slots if s is not slot and s.ready and env.get("gpu_uuid")
                     and s.env.get("gpu_uuid") == env["gpu_uuid"] and s.node == slot.node), None)
        if twin is not None:
            # Two workers on one physical GPU would contaminate each other's measurements.
            log.warning("%s landed on the GPU of %s (%s); refused: one worker per GPU", slot.name, twin.name,
                        env["gpu_uuid"])
            self._drop(slot)
            return
        self.progress(f"{slot.name} ready on {env.get('host')} ({env.get('gpu') or 'cpu'}, node {slot.node[:8]})")

    def _node_info(self) -> dict[str, tuple[str | None, dict[str, float]]]:
        """Per Ray node id: its accelerator_type and the custom resources it declares
        (`ray start --resources`), which screens' `placement.resources` are matched against."""
        out = {}
        for node in self.ray.nodes():
            accelerator, custom = None, {}
            for key, amount in node.get("Resources", {}).items():
                if key.startswith("accelerator_type:"):
                    accelerator = key.split(":", 1)[1]
                elif not is_builtin_resource(key):
                    custom[key] = float(amount)
            out[node["NodeID"]] = (accelerator, custom)
        return out

    def _drop(self, slot: Slot) -> None:
        self._kill(slot)
        self.slots.remove(slot)
        for ref, (_, s, _) in list(self.refs.items()):
            if s is slot:
                del self.refs[ref]

    # ------------------------------------------------------------------------- upkeep

    def _upkeep(self) -> None:
        """Every third of a lease (at most UPKEEP_MAX_S): reap expired leases, renew ours,
        heartbeat, unplaced workers."""
        now = time.monotonic()
        if now < self._next_upkeep:
            return
        # A third of a lease keeps it alive; at most 2 s so a cancel is seen within 2 s.
        self._next_upkeep = now + min(self.lease_s / 3, UPKEEP_MAX_S)
        if now >= self._no_reap_until:
            self._reap()
        for slot in self.slots:
            for active in (slot.active, slot.next):
                if active is not None and active.stop is None and not self.store.renew_lease(active.run.attempt.id,
                                                                                          self.lease_s):
                    self._refused(active)
        for slot in [s for s in self.slots if not s.ready]:
            if now - slot.placing_since > self.settings.placement_timeout_s:
                log.warning("%s was not placed within %.0f s; dropped", slot.name, self.settings.placement_timeout_s)
                self._drop(slot)
        self.store.heartbeat(self.id, [s.describe() for s in self.slots if s.ready])
        self._explain_unplaceable()

    def _reap(self) -> None:
        for reaped in self.store.reap_expired():
            self.progress(f"screen {reaped.screen_id}: attempt {reaped.attempt_id} lost (lease expired), "
                          f"screen {reaped.screen_status}")

    def _refused(self, active: Active) -> None:
        """A renewal was refused: cancelled (finish after the episode in flight) or lost."""
        attempt = next(a for a in self.store.attempts(active.run.screen.id) if a.id == active.run.attempt.id)
        active.stop = "cancelled" if attempt.status == "running" else "lost"
        self.progress(f"screen {active.run.screen.id}: {active.stop}; stopping after the episode in flight")
        if active.inflight == 0:
            self._end_stopped(active)

    def _explain_unplaceable(self) -> None:
        """Queued screens no worker of this pool can ever take say why in `packbench status`."""
        ready = [s for s in self.slots if s.ready]
        if not ready:
            return
        types = {s.gpu_type for s in ready if s.gpu_type}
        nodes = {s.node for s in ready}
        for screen in self.store.queued_screens():
            reason = None
            needs = screen.needs
            if screen.gpu_type and screen.gpu_type not in types:
                reason = f"needs GPU type {screen.gpu_type}; this cluster's workers have {', '.join(sorted(types)) or 'none'}"
            elif screen.placement_node and screen.placement_node not in nodes:
                reason = f"needs node {screen.placement_node}, which has no worker"
            elif needs and not any(resources_fit(needs, s.resources) for s in ready):
                have = sorted({f"{k}: {v:g}" for s in ready for k, v in s.resources.items()})
                reason = (f"needs Ray resources {_show(needs)} on one node; no node with a worker declares them "
                          f"(declared: {', '.join(have) or 'none'}); start a node with `ray start --resources "
                          f"'{json.dumps(needs)}'` or change the protocol's placement.resources")
            elif screen.replica_group and len(self.store.replica_nodes(screen.replica_group)) >= len(nodes):
                reason = f"its replicas need distinct nodes; the cluster has {len(nodes)} with workers"
            if reason != screen.unplaceable_reason:
                self.store.set_unplaceable(screen.id, reason)

    # ------------------------------------------------------------------------- claiming

    def _fill_idle_slots(self) -> bool:
        """Claim for idle workers first, then a next screen for workers handing out their last
        episodes (an idle worker elsewhere must not lose a screen to a busy one's look-ahead)."""
        claimed = False
        if self.stopping:
            return False
        for slot in self.slots:
            if slot.ready and slot.active is None and self._claim(slot) is not None:
                claimed = True
        if self.only_screen is None and self.look_ahead:
            for slot in self.slots:
                active = slot.active
                if (slot.ready and active is not None and slot.next is None and active.stop is None
                        and active.handed_out and not active.looked_ahead):
                    active.looked_ahead = True
                    claimed = self._claim(slot, follows=active) is not None or claimed
        return claimed

    def _claim(self, slot: Slot, *, follows: Active | None = None) -> Active | None:
        t0 = time.perf_counter()
        claim = self.store.claim_screen(
            self.id, lease_s=self.lease_s, archive_dir=str(self.settings.archive_dir.resolve()),
            source_freeze=self.freeze, worker=f"{slot.name} pid {slot.env.get('pid')}", node=slot.node,
            gpu_name=slot.env.get("gpu") or "cpu", gpu_index=_gpu_index(slot.env),
            machine_id=self._machine(slot), gpu_types=[slot.gpu_type] if slot.gpu_type else [],
            node_resources=slot.resources, screen_id=self.only_screen,
            follows_attempt=None if follows is None else follows.run.attempt.id)
        if claim is None:
            return None
        active = self._start(slot, claim, queued=follows is not None)
        active.run.t_claimed = time.perf_counter() - t0
        return active

    def _machine(self, slot: Slot) -> int:
        env = slot.env
        if slot.machine_id is None:  # one row per worker: its host, GPU and software do not change
            slot.machine_id = self.store.put_machine(host=env["host"], gpu_name=env["gpu"], driver=env["driver"],
                                                     torch=env["torch"], cuda=env["cuda"])
        return slot.machine_id

    def _start(self, slot: Slot, claim, *, queued: bool = False) -> Active:
        """Open the claimed screen's archive and send its load; `queued`: as the slot's next
        screen (the load waits on the actor behind the running screen's last episodes)."""
        protocol = expand(json.loads(claim.protocol.canonical_json))
        run = ScreenRun(self.store, screen=claim.screen, attempt=claim.attempt, protocol=protocol,
                        archive_path=Path(claim.attempt.archive_path), freeze=self.freeze, progress=self.progress,
                        signer=self.signer)
        active = Active(slot=slot, run=run, protocol=protocol)
        self.runs.append(run)
        if queued:
            slot.next = active
        else:
            slot.active = active
        try:
            run.begin(slot.env)
        except PackbenchError as e:  # the archive cannot be written: the attempt fails, never stays running
            # bad_input as when the archive fails mid-screen (_guarded): one cause, one exit code.
            self._end(active, run.fail("failed", str(e), bad_input=True))
            return active
        cache = None if self.settings.model_cache is None else str(self.settings.model_cache)
        # A protocol that judges the cold start gets a cold model; any other reuses a warm one.
        reuse = protocol.gates.useful_latency is None
        ref = slot.actor.load.remote(protocol, claim.screen.model_dir, model_cache=cache, reuse=reuse)
        active.inflight += 1
        self.refs[ref] = ("load", slot, active)
        return active

    # ------------------------------------------------------------------------- results

    def _handle(self, ref) -> None:
        kind, slot, active = self.refs.pop(ref)
        try:
            value = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as e:
            self._worker_died(slot, e)
            return
        except Exception as e:  # the worker raised (a RayTaskError): this screen fails, the worker lives
            if kind == "describe":
                self._worker_died(slot, e)
            elif active is not None and active in (slot.active, slot.next):
                active.inflight -= 1
                self._fail(active, "failed", cause_of(e), bad_input=is_bad_input(e))
            return
        if kind == "describe":
            self._placed(slot, value)
            return
        if active is None or active not in (slot.active, slot.next):
            return  # a result for a screen already ended (a cancelled screen's look-ahead)
        active.inflight -= 1
        if kind == "load" and active is slot.next:
            active.start = value  # the slot's screen is still finishing: it starts when that ends
            if active.stop:
                self._end_stopped(active)
            return
        self._guarded(active, self._loaded if kind == "load" else self._episode, value)

    def _guarded(self, active: Active, step: Callable[[Active, dict], None], value: dict) -> None:
        try:
            step(active, value)
        except DatabaseUnavailable:
            raise
        except PackbenchError as e:
            self._fail(active, "failed", str(e), bad_input=True)

    def _loaded(self, active: Active, start: dict) -> None:
        run = active.run
        # The bench's clock of the screen starts here, before any of the driver's own work.
        run.t_loaded = time.perf_counter()
        vocab = start.pop("vocab")
        prompt_file = Path(run.screen.prompt_file) if run.screen.prompt_file else None
        active.token_ids = screen_prompts(active.protocol, vocab=vocab, model_dir=Path(start["model_dir"]),
                                          prompt_file=prompt_file)
        if active.stop:
            self._end_stopped(active)
            return
        active.entries = run.entries
        # The worker starts on its first episodes now; the attempt's placement and the archive's
        # plan.json / worker.json are written meanwhile (before any record: this thread handles
        # the results, and only after this returns).
        for _ in range(LOOKAHEAD):
            self._submit_next(active)
        run.t_first = time.perf_counter()
        run.loaded(start, active.token_ids)
        model_state = start.get("model_state")
        self._when_db(lambda: self._place(active, model_state))

    def _place(self, active: Active, model_state: str | None) -> None:
        try:
            self.store.place_attempt(active.run.attempt.id, model_state=model_state)
        except DatabaseUnavailable:
            raise
        except PackbenchError as e:  # no longer running (reaped, say): the renewal decides what ends it
            log.warning("screen %s: placement not recorded: %s", active.run.screen.id, e)

    def _submit_next(self, active: Active) -> None:
        if active.submitted >= len(active.entries) or active.stop or self.outage is not None:
            return  # an outage pauses the screen: _database_back submits again
        entry = active.entries[active.submitted]
        active.submitted += 1
        active.inflight += 1
        ref = active.slot.actor.run.remote(entry, active.token_ids[entry["prompt"]])
        self.refs[ref] = ("episode", active.slot, active)

    def _episode(self, active: Active, record: dict) -> None:
        if active.stop == "lost":
            if active.inflight == 0:
                self._end_stopped(active)
            return  # reaped: another attempt may run the screen now; this one writes nothing more
        # The next episode goes to the worker before this one is persisted (archive + row).
        self._submit_next(active)
        self._note_host_sharing(active, record)
        try:
            active.run.record(record, persist=self.outage is None)  # archived either way
        except DatabaseUnavailable:
            if self.follow:
                self._after_outage.append(lambda: self._recorded(active))
            raise
        self._recorded(active)

    def _recorded(self, active: Active) -> None:
        if active.ended:
            return
        if active.stop:
            if active.inflight == 0:
                self._end_stopped(active)
            return
        if active.run.done_count == len(active.entries):
            # Verdicts, seal and rows now, before the next screen's first episodes go out. Deferring
            # them behind those episodes (tried) cut the worker's switch between screens from ~20
            # to ~4 ms but put 10-25 ms of driver work inside the next screen, and the queue path
            # per episode rose by 1-5 ms in 6 of 6 paired runs (docs/benchmarks.md).
            self._when_db(lambda: self._finish(active))

    def _finish(self, active: Active) -> None:
        if active.ended or active.stop:  # reaped over an outage: the renewal ended it as lost
            return
        self._end(active, active.run.finish())

    def _note_host_sharing(self, active: Active, record: dict) -> None:
        """Say once per attempt when a packbench worker that is not this dispatcher's (another
        cluster's, or another dispatcher's) was busy on the same host during an episode: it shared
        the host's cores and memory. Every episode's record keeps the list (`host_workers`); the
        report names them."""
        host = active.slot.env.get("host")
        cores = other_cores(record)
        if not active.host_busy and cores is not None and cores >= NOISY_CORES:
            active.host_busy = True
            self.progress(f"screen {active.run.screen.id}: host {host} was busy: other processes kept {cores:.2g} "
                          f"cores busy during episode {record.get('plan_index')} (threshold {NOISY_CORES:g}); its "
                          f"times may be inflated (each episode records it: host_load)")
        if active.host_shared:
            return
        mine = {s.env.get("pid") for s in self.slots if s.env.get("host") == host}
        foreign = [p for p in record.get("host_workers") or [] if p[0] not in mine]
        if foreign:
            active.host_shared = True
            self.progress(f"screen {active.run.screen.id}: host {host} was shared with packbench worker "
                          + ", ".join(f"pid {pid} ({device})" for pid, device in foreign)
                          + ", not this dispatcher's, busy during its episodes (each episode records it)")

    def _end_stopped(self, active: Active) -> None:
        if active.ended:
            return
        if active.stop == "cancelled":
            self._fail(active, "cancelled", "cancelled by the user")
        else:
            run = active.run
            self._end(active, ScreenOutcome(run.screen.id, run.attempt.id, run.archive_path, None, "lost",
                                            "the lease expired; the screen was requeued by a reaper"))

    def _fail(self, active: Active, status: str, error: str, *, requeue: bool = False,
              bad_input: bool = False) -> None:
        self._when_db(lambda: self._fail_now(active, status, error, requeue=requeue, bad_input=bad_input))

    def _fail_now(self, active: Active, status: str, error: str, *, requeue: bool = False,
                  bad_input: bool = False) -> None:
        if active.ended:
            return
        try:
            self._end(active, active.run.fail(status, error, requeue=requeue, bad_input=bad_input))
        except DatabaseUnavailable:
            raise
        except PackbenchError as e:
            log.error("could not record the end of screen %s: %s", active.run.screen.id, e)
            self._end(active, None)

    def _end(self, active: Active, outcome: ScreenOutcome | None) -> None:
        """The screen is over for this slot: its next screen (if claimed) becomes the active one."""
        if active.ended:
            return
        active.ended = True
        slot = active.slot
        active.run.episodes = [{**e, "logits": None, "calls": None} for e in active.run.episodes]
        if outcome is not None:
            self.outcomes.append(outcome)
            self.on_outcome(outcome)
        if slot.next is active:
            slot.next = None
            return
        if slot.active is not active:
            return
        slot.active, slot.next = slot.next, None
        following = slot.active
        if following is not None and following.start is not None and following.inflight == 0:
            start, following.start = following.start, None
            self._guarded(following, self._loaded, start)

    def _worker_died(self, slot: Slot, e: BaseException) -> None:
        cause = f"worker {slot.name} (pid {slot.env.get('pid')}, node {slot.node[:8] or '?'}) died: {cause_of(e)}"
        log.warning(cause)
        held = [a for a in (slot.active, slot.next) if a is not None]
        slot.active = slot.next = None  # nothing is promoted onto a dead actor
        never_ready = not slot.ready
        self._drop(slot)
        for active in held:
            if active.stop != "lost":
                self._fail(active, "failed", cause, requeue=True)
        self._dead_on_arrival += never_ready
        if self._dead_on_arrival >= 3:
            # Workers that cannot even start (a broken install on a node, say) are not replaced forever.
            self.refusals.append(f"{self._dead_on_arrival} workers died before they were ready; last: {cause}")
            log.error("not replacing %s: %d workers died before they were ready", slot.name, self._dead_on_arrival)
        elif not self.stopping:
            self._add_slot()  # a replacement; Ray places it wherever a GPU is free
