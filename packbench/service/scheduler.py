"""The scheduler: drains the database queue onto a pool of GPU workers (`packbench dispatch`).

Plain Python over a `WorkerPool` (service/scheduler_pool.py): `cluster/pool.py` runs it on Ray,
tests on an in-process fake. The database is the record and the queue; the pool is the transport
and the placement engine.

- One worker per GPU of the cluster (or `workers`), kept across screens: a worker keeps its
  loaded checkpoint for the next screen of the same model (`model_state` warm/cold).
- Each idle worker claims one screen (`Store.claim_screen`: atomic, a lease). Screens run
  concurrently, one per worker; a screen's episodes run in plan order on its worker, submitted
  one ahead (and the next one handed out before the driver persists the one that came back)
  so the worker never waits for the driver. The pool's `wait` returns as soon as any call is back.
- A worker whose screen has handed out its last episodes claims its next screen at once (the
  `next` of its slot): the new archive is opened and the load is queued on the same worker
  behind those episodes, so claim, archive creation and load overlap the screen's end. The
  claim ignores the slot's own running attempt in node checks (shared_node, exclusive_node):
  the two screens run one after the other on one worker, never side by side.
- Leases are renewed every third of their length; a renewal refused means the screen was
  cancelled (stop after the episode in flight, attempt `cancelled`) or the attempt was reaped
  as lost (stop touching it). Expired leases of any dispatcher are reaped here too.
- A worker that dies fails its attempt with a cause naming it, and the screen is requeued
  (up to its max_attempts); a replacement worker is started.
- SIGINT/SIGTERM: stop claiming, give every held attempt back (`interrupted`, requeued), exit.
- The database down (`DatabaseUnavailable`, after the Store's own retries): a one-shot
  scheduler stops (`fatal`); `follow` waits it out however long it lasts (`Outage`): no new
  claims or episodes, the episodes in flight go to their archives without rows, one probe per
  backoff step (doubling up to a cap), one line when the wait starts and one when it ends.
  When the database answers: reconcile the rows its archives hold (service/reconcile.py),
  renew its leases (an attempt reaped meanwhile ends as lost), do the writes it deferred, in
  order, reconcile the archives on this host of attempts that ended since the outage began,
  and continue, reaping no other dispatcher's lease for one lease length.

The pool's own retries are off (Ray: max_restarts=0, max_task_retries=0): ordering comes from
the database, never from the transport's retries (with max_task_retries > 0, Ray 2.60 ran
retried calls out of submission order in 3 of 3 runs, and retried a call that kills its actor
until the restart budget was gone).

`Scheduler` is the loop and its stop; each thing it reacts to has its own class:
`Claims` (service/scheduler_claims.py: idle workers and look-ahead claim, a claimed screen is
started), `Lifecycle` (service/scheduler_lifecycle.py: a screen's load and episodes come back,
it ends), `Upkeep` (service/scheduler_upkeep.py: leases, reaping, heartbeat on a clock),
`OutageWatch` (service/scheduler_outage.py: the database goes down and comes back) and `Fleet`
(service/scheduler_fleet.py: workers placed, lost, replaced).
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import signal
import threading
import time
from typing import Callable

from packbench.core.errors import PackbenchError
from packbench.core.provenance import Signer
from packbench.core.settings import Settings
from packbench.core.source import source_freeze
from packbench.db.errors import DatabaseUnavailable
from packbench.service.scheduler_claims import Claims
from packbench.service.scheduler_fleet import Fleet
from packbench.service.scheduler_lifecycle import Lifecycle
from packbench.service.scheduler_outage import OUTAGE_BACKOFF_S, Outage, OutageWatch
from packbench.service.scheduler_pool import Reply, WorkerPool
from packbench.service.scheduler_state import CallKind, ScreenEvent, Slot, Stop, archive_dir, held_by_silent
from packbench.service.scheduler_upkeep import Upkeep
from packbench.service.screen import ScreenOutcome

log = logging.getLogger(__name__)


class Scheduler:
    """Drain the queue (or serve it, `follow`) onto a pool of GPU workers.

    `observer(ScreenEvent)` hears each attempt's claim, load, first episodes out and every
    record (bench/cluster.py times the queue path from them); the product passes none.
    """

    def __init__(self, store, settings: Settings, pool: WorkerPool, *, workers: int | None = None,
                 follow: bool = False, lease_s: float = 60.0, only_screen: int | None = None,
                 progress: Callable[..., None] = lambda msg, **event: None,
                 on_outcome: Callable[[ScreenOutcome], None] = lambda outcome: None,
                 observer: Callable[[ScreenEvent], None] | None = None, look_ahead: bool = True,
                 outage_backoff: tuple[float, float] = OUTAGE_BACKOFF_S) -> None:
        self.store, self.settings, self.pool = store, settings, pool
        self.follow, self.only_screen, self.progress = follow, only_screen, progress
        self.stopping: str | None = None  # SIGINT | SIGTERM | database, or set by a caller to stop
        self.fatal: str | None = None  # why the scheduler had to stop (the database stayed down)
        self.held: list[str] = []  # with nothing queued: screens that dispatchers gone silent hold (held_by_silent)
        self.done = False
        self.id: int | None = None
        self.fleet = Fleet(pool, planned=workers, progress=progress)
        self.watch = OutageWatch(store, follow=follow, lease_s=lease_s, backoff=outage_backoff, progress=progress)
        self.lifecycle = Lifecycle(store, pool, self.fleet, self.watch, progress=progress, on_outcome=on_outcome,
                                   observer=observer)
        self.outcomes = self.lifecycle.outcomes  # what became of every screen this scheduler ran
        self.upkeep = Upkeep(store, settings, self.fleet, self.lifecycle, lease_s=lease_s, progress=progress)
        # The deployment's key signs every sealed archive (<archive>.sig, core/provenance.py).
        signer = Signer.load(settings.signing_key) if settings.signing_key else None
        self.claims = Claims(store, settings, pool, self.fleet, self.lifecycle, lease_s=lease_s,
                             freeze=source_freeze(), signer=signer, only_screen=only_screen,
                             look_ahead=look_ahead, progress=progress)

    @property
    def slots(self) -> list[Slot]:
        return self.fleet.slots

    @property
    def refusals(self) -> list[str]:
        return self.fleet.refusals

    @property
    def outage(self) -> Outage | None:
        """The database outage `follow` is waiting out, if any."""
        return self.watch.outage

    @property
    def outages(self) -> list[dict]:
        """Each outage waited out: seconds, probes, rows reconciled."""
        return self.watch.waited

    # ------------------------------------------------------------------------- the loop

    def run(self) -> list[ScreenOutcome]:
        """Until drained (or stopped); returns what became of every screen this scheduler ran."""
        if not self.follow and self.only_screen is None:
            self.upkeep.reap()  # a dead dispatcher's screens count as queued once their leases expired
            if not self.store.queued_screens():
                from packbench.engine.gpu_lock import process_alive  # torch-free: /proc only

                # Nothing to drain: no pool is started (seconds, for nothing). Screens a dead
                # dispatcher still holds are said, with when their leases let them go.
                self.held = held_by_silent(self.store.queue_status(), host=platform.node(), alive=process_alive)
                return self.outcomes
        archive_dir(self.settings.archive_dir)  # before a claim: a claimed attempt would fail on it
        self.pool.connect()
        # Frozen out of the collector for the dispatcher's run: what is alive now (the libraries,
        # Ray's client). Unfrozen, the driver's full collections took 60-260 ms on a 2-core host at
        # the same episode count of every screen, a core taken from the worker mid-episode: plan
        # index 38 of 39- and 48-episode screens ran ~10x its neighbours (docs/metrics.md).
        gc.freeze()
        # Signals reach the main thread only; a scheduler in another thread (tests) is stopped by
        # setting `stopping`.
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            self._register()
            if self.id is not None:
                self.fleet.start()
            while not self.stopping and self.id is not None:
                try:
                    if self.watch.outage is not None:
                        self._ride_out()
                    else:
                        self._step()
                except DatabaseUnavailable as e:
                    if self.follow:
                        self.watch.went_down(e, self.fleet.screens())
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
            gc.unfreeze()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.outcomes

    def _register(self) -> None:
        """Register this dispatcher (`id`); `follow` waits for a database that is down at start."""
        name = f"dispatch-{platform.node()}-{os.getpid()}"
        while not self.stopping:
            try:
                if self.watch.outage is not None:
                    wait = self.watch.probe_in()
                    if wait > 0:
                        time.sleep(wait)
                        continue
                    self.store.ping()  # one try per probe; the register below retries on its own
                self.id = self.store.register_dispatcher(name, platform.node(), pid=os.getpid())
                if self.watch.outage is not None:
                    self._database_back()
                return
            except DatabaseUnavailable as e:
                if not self.follow:
                    raise
                self.watch.went_down(e, self.fleet.screens())

    def _step(self) -> None:
        """One turn: upkeep, claims for idle workers, then whatever the workers returned."""
        self.upkeep.tick(self.id)
        claimed = not self.stopping and self.claims.fill(self.id)
        if self._finished(claimed):
            self.done = True
            return
        if not self.pool.in_flight():
            time.sleep(0.2)
            return
        # Back as soon as any call is: waiting for all of them held each result until the
        # look-ahead episode was back too, and the worker then idled while the driver caught up
        # (7.8 ms of queue path per episode, docs/benchmarks.md).
        for reply in self.pool.wait(0.2):
            self._handle(reply)

    def _ride_out(self) -> None:
        """One turn while the database is down: archive what the workers return; probe on time.
        A probe that fails raises DatabaseUnavailable: `run` hands it to the watch, which waits on."""
        wait = self.watch.probe_in()
        if self.pool.in_flight():
            for reply in self.pool.wait(wait, every=True):
                self._handle(reply)
        else:
            time.sleep(wait)
        if self.watch.probe_in() > 0 or self.stopping:
            return
        self.store.ping()
        self._database_back()

    def _database_back(self) -> None:
        """The database answers again: catch up, in order, then carry on (see the module doc)."""
        self.watch.came_back(self.fleet.screens(), renew=self.upkeep.renew)
        self.upkeep.after_outage()
        self.lifecycle.resume()

    def _handle(self, reply: Reply) -> None:
        """A reply: a worker's description, its death, or a screen's load or episode."""
        call = reply.tag
        if reply.died or (reply.error is not None and call.kind is CallKind.DESCRIBE):
            self._worker_died(call.slot, reply.error)
        elif call.kind is CallKind.DESCRIBE:
            self.fleet.placed(call.slot, reply.value)
        else:
            self.lifecycle.reply(call, reply)

    def _worker_died(self, slot: Slot, e: BaseException) -> None:
        cause, held, never_ready = self.fleet.lose(slot, e)
        for active in held:
            if active.stop != Stop.LOST:
                self.lifecycle.fail(active, "failed", cause, requeue=True)
        self.fleet.replace(slot, cause, never_ready=never_ready, stopping=bool(self.stopping))

    # ------------------------------------------------------------------------- the end

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
            self.upkeep.explain_unplaceable()  # what is left says why in `packbench status`
            return True
        return not queued

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self.stopping = signal.Signals(signum).name
        log.warning("%s: giving back held screens and stopping", self.stopping)

    def _shutdown(self) -> None:
        reason = f"dispatcher stopped ({self.stopping})" if self.stopping else "dispatcher stopped"
        # With the database down nothing can be given back: the leases expire and a later
        # dispatcher requeues the screens; the archives keep every episode (db reconcile).
        offline = self.stopping == "database" or self.watch.outage is not None
        for active in self.fleet.screens():
            if active.stop != Stop.LOST and not offline:
                try:
                    status = self.store.release(active.run.attempt.id, reason)
                    self.progress(f"screen {active.run.screen.id}: attempt {active.run.attempt.number} "
                                  f"interrupted, screen {status}")
                except PackbenchError as e:
                    log.error("could not give back screen %s: %s", active.run.screen.id, e)
        self.fleet.kill_all()
        if self.id is not None and not offline:
            try:
                self.store.stop_dispatcher(self.id)
            except PackbenchError as e:
                log.error("could not record the dispatcher's stop: %s", e)
