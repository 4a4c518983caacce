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
"""

from __future__ import annotations

import json
import logging
import os
import platform
import signal
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from core.dispersion import NOISY_CORES, other_cores
from core.errors import PackbenchError
from core.plan import episode_input
from core.protocol import expand
from core.provenance import Signer
from core.settings import Settings
from core.source import source_freeze
from db.errors import DatabaseUnavailable
from service.scheduler_fleet import Fleet
from service.scheduler_pool import Reply, WorkerPool
from service.scheduler_state import (LOOKAHEAD, OUTAGE_BACKOFF_S, UPKEEP_MAX_S, Active, Call, CallKind, Moment,
                                     Outage, ScreenEvent, Slot, Stop, archive_dir, gpu_index, held_by_silent, now,
                                     outage_delays, unplaceable_reason)
from service.screen import ScreenOutcome, ScreenRun, cause_of, is_bad_input
from service.submit import screen_prompts

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
        self.workers, self.follow, self.lease_s = workers, follow, lease_s
        self.only_screen = only_screen
        self.progress, self.on_outcome, self.observer = progress, on_outcome, observer
        # Claim a worker's next screen while its last episodes run (False: only when idle;
        # bench/cluster.py --no-look-ahead measures the difference).
        self.look_ahead = look_ahead
        self.fleet = Fleet(pool, planned=workers, progress=progress)
        self.outcomes: list[ScreenOutcome] = []
        self.stopping: str | None = None  # SIGINT | SIGTERM | database, or set by a caller to stop
        self.fatal: str | None = None  # why the scheduler had to stop (the database stayed down)
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

    def _tell(self, moment: Moment, run: ScreenRun, at: float, seconds: float = 0.0) -> None:
        if self.observer is not None:
            self.observer(ScreenEvent(moment, run, at, seconds))

    # ------------------------------------------------------------------------- lifecycle

    def run(self) -> list[ScreenOutcome]:
        """Until drained (or stopped); returns what became of every screen this scheduler ran."""
        if not self.follow and self.only_screen is None:
            self._reap()  # a dead dispatcher's screens count as queued once their leases expired
            if not self.store.queued_screens():
                from engine.gpu_lock import process_alive  # torch-free: /proc only

                # Nothing to drain: no pool is started (seconds, for nothing). Screens a dead
                # dispatcher still holds are said, with when their leases let them go.
                self.held = held_by_silent(self.store.queue_status(), host=platform.node(), alive=process_alive)
                return self.outcomes
        archive_dir(self.settings.archive_dir)  # before a claim: a claimed attempt would fail on it
        self.pool.connect()
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

    def _step(self) -> None:
        """One turn: upkeep, claims for idle workers, then whatever the workers returned."""
        self._upkeep()
        claimed = self._fill_idle_slots()
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
            for active in slot.screens():
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

    # ------------------------------------------------------------------------- database outages

    def _database_down(self, e: DatabaseUnavailable) -> None:
        """The database stopped answering (`follow`): wait for it, saying so once."""
        now_s = time.monotonic()
        if self.outage is not None:  # it failed again while we were catching up: keep waiting
            self.outage.probes += 1
            self.outage.schedule(now_s)
            return
        first, cap = self.outage_backoff
        # It was failing through the Store's retries before it was raised: the outage began then.
        began = datetime.now(timezone.utc) - timedelta(seconds=e.failing_s)
        self.outage = Outage(cause=e.cause, since=now_s - e.failing_s, started_at=began.strftime("%H:%M:%S UTC"),
                             delays=outage_delays(first, cap))
        self.outage.schedule(now_s)
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
        return [a for s in self.slots for a in s.screens()]

    def _ride_out(self) -> None:
        """One turn while the database is down: archive what the workers return; probe on time."""
        wait = max(0.0, min(0.2, self.outage.next_probe - time.monotonic()))
        if self.pool.in_flight():
            for reply in self.pool.wait(wait, every=True):
                self._handle(reply)
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
        from service.reconcile import reconcile

        outage = self.outage
        down_s = time.monotonic() - outage.since
        own = {a.run.attempt.id: a for a in self._actives() if a.run.writer is not None}
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

    # ------------------------------------------------------------------------- workers

    @property
    def slots(self) -> list[Slot]:
        return self.fleet.slots

    @property
    def refusals(self) -> list[str]:
        return self.fleet.refusals

    def _worker_died(self, slot: Slot, e: BaseException) -> None:
        cause, held, never_ready = self.fleet.lose(slot, e)
        for active in held:
            if active.stop != Stop.LOST:
                self._fail(active, "failed", cause, requeue=True)
        self.fleet.replace(slot, cause, never_ready=never_ready, stopping=bool(self.stopping))

    # ------------------------------------------------------------------------- upkeep

    def _upkeep(self) -> None:
        """Every third of a lease (at most UPKEEP_MAX_S): reap expired leases, renew ours,
        heartbeat, unplaced workers."""
        now_s = time.monotonic()
        if now_s < self._next_upkeep:
            return
        # A third of a lease keeps it alive; at most 2 s so a cancel is seen within 2 s.
        self._next_upkeep = now_s + min(self.lease_s / 3, UPKEEP_MAX_S)
        if now_s >= self._no_reap_until:
            self._reap()
        for active in self._actives():
            if active.stop is None and not self.store.renew_lease(active.run.attempt.id, self.lease_s):
                self._refused(active)
        self.fleet.drop_unplaced(self.settings.placement_timeout_s)
        self.store.heartbeat(self.id, [s.describe() for s in self.fleet.ready()])
        self._explain_unplaceable()

    def _reap(self) -> None:
        for reaped in self.store.reap_expired():
            self.progress(f"screen {reaped.screen_id}: attempt {reaped.attempt_id} lost (lease expired), "
                          f"screen {reaped.screen_status}")

    def _refused(self, active: Active) -> None:
        """A renewal was refused: cancelled (finish after the episode in flight) or lost."""
        attempt = next(a for a in self.store.attempts(active.run.screen.id) if a.id == active.run.attempt.id)
        active.stop = Stop.CANCELLED if attempt.status == "running" else Stop.LOST
        self.progress(f"screen {active.run.screen.id}: {active.stop}; stopping after the episode in flight")
        if active.inflight == 0:
            self._end_stopped(active)

    def _explain_unplaceable(self) -> None:
        """Queued screens no worker of this pool can ever take say why in `packbench status`."""
        ready = self.fleet.ready()
        if not ready:
            return
        for screen in self.store.queued_screens():
            reason = unplaceable_reason(screen, ready, replica_nodes=self.store.replica_nodes)
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
        t0 = now()
        claim = self.store.claim_screen(
            self.id, lease_s=self.lease_s, archive_dir=str(self.settings.archive_dir.resolve()),
            source_freeze=self.freeze, worker=f"{slot.name} pid {slot.env.get('pid')}", node=slot.node,
            gpu_name=slot.env.get("gpu") or "cpu", gpu_index=gpu_index(slot.env),
            machine_id=self._machine(slot), gpu_types=[slot.gpu_type] if slot.gpu_type else [],
            node_resources=slot.resources, screen_id=self.only_screen,
            follows_attempt=None if follows is None else follows.run.attempt.id)
        if claim is None:
            return None
        return self._start(slot, claim, queued=follows is not None, claim_s=now() - t0)

    def _machine(self, slot: Slot) -> int:
        env = slot.env
        if slot.machine_id is None:  # one row per worker: its host, GPU and software do not change
            slot.machine_id = self.store.put_machine(host=env["host"], gpu_name=env["gpu"], driver=env["driver"],
                                                     torch=env["torch"], cuda=env["cuda"])
        return slot.machine_id

    def _start(self, slot: Slot, claim, *, queued: bool = False, claim_s: float = 0.0) -> Active:
        """Open the claimed screen's archive and send its load; `queued`: as the slot's next
        screen (the load waits on the worker behind the running screen's last episodes)."""
        protocol = expand(json.loads(claim.protocol.canonical_json))
        run = ScreenRun(self.store, screen=claim.screen, attempt=claim.attempt, protocol=protocol,
                        archive_path=Path(claim.attempt.archive_path), freeze=self.freeze, progress=self.progress,
                        signer=self.signer)
        self._tell(Moment.CLAIMED, run, now(), claim_s)
        active = Active(slot=slot, run=run, protocol=protocol)
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
        self.pool.load(slot.worker, Call(CallKind.LOAD, slot, active), protocol, claim.screen.model_dir,
                       model_cache=cache, reuse=reuse)
        active.inflight += 1
        return active

    # ------------------------------------------------------------------------- results

    def _handle(self, reply: Reply) -> None:
        call: Call = reply.tag
        slot, active = call.slot, call.screen
        if reply.died:
            self._worker_died(slot, reply.error)
            return
        if reply.error is not None:  # the worker raised: this screen fails, the worker lives
            if call.kind is CallKind.DESCRIBE:
                self._worker_died(slot, reply.error)
            elif active is not None and active in (slot.active, slot.next):
                active.inflight -= 1
                self._fail(active, "failed", cause_of(reply.error), bad_input=is_bad_input(reply.error))
            return
        if call.kind is CallKind.DESCRIBE:
            self.fleet.placed(slot, reply.value)
            return
        if active is None or active not in (slot.active, slot.next):
            return  # a result for a screen already ended (a cancelled screen's look-ahead)
        active.inflight -= 1
        if call.kind is CallKind.LOAD and active is slot.next:
            active.start = reply.value  # the slot's screen is still finishing: it starts when that ends
            if active.stop:
                self._end_stopped(active)
            return
        self._guarded(active, self._loaded if call.kind is CallKind.LOAD else self._episode, reply.value)

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
        self._tell(Moment.LOADED, run, now())
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
        self._tell(Moment.FIRST_OUT, run, now())
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
        self.pool.run(active.slot.worker, Call(CallKind.EPISODE, active.slot, active), entry,
                      episode_input(active.token_ids, entry))

    def _episode(self, active: Active, record: dict) -> None:
        if active.stop == Stop.LOST:
            if active.inflight == 0:
                self._end_stopped(active)
            return  # reaped: another attempt may run the screen now; this one writes nothing more
        # The next episode goes to the worker before this one is persisted (archive + row).
        self._submit_next(active)
        self._note_host_sharing(active, record)
        t0 = now()
        try:
            active.run.record(record, persist=self.outage is None)  # archived either way
        except DatabaseUnavailable:
            self._tell(Moment.RECORDED, active.run, t0, now() - t0)  # archived, its row deferred
            if self.follow:
                self._after_outage.append(lambda: self._recorded(active))
            raise
        self._tell(Moment.RECORDED, active.run, t0, now() - t0)
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

    # ------------------------------------------------------------------------- endings

    def _end_stopped(self, active: Active) -> None:
        if active.ended:
            return
        if active.stop == Stop.CANCELLED:
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
