"""The dispatcher's loop (`Dispatcher`): register, start the workers, then turn by turn run
the upkeep, start what the claims bring and hand each reply to its part; ride out a database
outage (`follow`); stop on a signal, the database gone (one-shot) or the archive storage
failing, giving every held screen back. What it does is the package's docstring (__init__.py).
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from packbench.core.errors import PackbenchError
from packbench.core.provenance import ProvenanceError, Signer
from packbench.core.settings import Settings
from packbench.core.source import source_freeze
from packbench.core.text import one_line
from packbench.db.errors import DatabaseUnavailable
from packbench.service.dispatcher.claims import Claims
from packbench.service.dispatcher.fleet import Fleet
from packbench.service.dispatcher.holders import holder_alive, process_alive
from packbench.service.dispatcher.lifecycle import Lifecycle
from packbench.service.dispatcher.outage import OutageWatch
from packbench.service.dispatcher.pool import Reply, WorkerPool
from packbench.service.dispatcher.rules import OUTAGE_BACKOFF_S, held_by_silent, overdue, revoked_key_refusal
from packbench.service.dispatcher.state import Active, CallKind, Outage, ScreenEvent, Slot, State, Stop
from packbench.service.dispatcher.upkeep import Upkeep
from packbench.service.screen import ScreenOutcome, cause_of

log = logging.getLogger("packbench.service.dispatcher")


class Dispatcher:
    """Drain the queue (or serve it, `follow`) onto a pool of GPU workers.

    Owns the one `State` the parts share (state.py); `observer(ScreenEvent)` hears each
    attempt's claim, load, first episodes out and every record (bench/cluster.py times the
    queue path from them); the product passes none.
    """

    def __init__(self, store, settings: Settings, pool: WorkerPool, *, workers: int | None = None,
                 follow: bool = False, lease_s: float = 60.0, only_screen: int | None = None,
                 progress: Callable[..., None] = lambda msg, **event: None,
                 on_outcome: Callable[[ScreenOutcome], None] = lambda outcome: None,
                 observer: Callable[[ScreenEvent], None] | None = None, look_ahead: bool = True,
                 outage_backoff: tuple[float, float] = OUTAGE_BACKOFF_S) -> None:
        self.store, self.settings, self.pool = store, settings, pool
        self.follow, self.only_screen, self.progress = follow, only_screen, progress
        self.state = state = State()
        self.fleet = Fleet(state, pool, planned=workers, progress=progress)
        self.watch = OutageWatch(state, store, follow=follow, lease_s=lease_s, backoff=outage_backoff,
                                 progress=progress)
        freeze = source_freeze()
        # The deployment's key signs every sealed archive (<archive>.sig, core/provenance.py).
        self.signer = signer = Signer.load(settings.signing_key) if settings.signing_key else None
        self.lifecycle = Lifecycle(state, store, pool, self.watch, freeze=freeze, signer=signer,
                                   model_cache=None if settings.model_cache is None else str(settings.model_cache),
                                   progress=progress, on_outcome=on_outcome, observer=observer)
        self.upkeep = Upkeep(state, store, lease_s=lease_s, progress=progress, alive=holder_alive)
        self.claims = Claims(state, store, archive_dir=str(settings.archive_dir.resolve()), lease_s=lease_s,
                             freeze=freeze, only_screen=only_screen, look_ahead=look_ahead)

    # What callers read (the CLI, the API, tests): views of the state.

    @property
    def id(self) -> int | None:
        """This dispatcher's row, once registered."""
        return self.state.id

    @property
    def outcomes(self) -> list[ScreenOutcome]:
        """What became of every screen this dispatcher ran, in order."""
        return self.state.outcomes

    @property
    def slots(self) -> list[Slot]:
        return self.state.slots

    @property
    def refusals(self) -> list[str]:
        return self.state.refusals

    @property
    def held(self) -> list[str]:
        """With nothing queued: screens that dispatchers gone silent hold (held_by_silent)."""
        return self.state.held

    @property
    def fatal(self) -> str | None:
        """Why the dispatcher had to stop (the database stayed down, the archive storage failed)."""
        return self.state.fatal

    @property
    def stopping(self) -> str | None:
        """SIGINT | SIGTERM | database | archive; a caller in another thread stops it by setting it."""
        return self.state.stopping

    @stopping.setter
    def stopping(self, why: str | None) -> None:
        self.state.stopping = why

    @property
    def outage(self) -> Outage | None:
        """The database outage `follow` is waiting out, if any."""
        return self.state.outage

    @property
    def outages(self) -> list[dict]:
        """Each outage waited out: seconds, probes, rows reconciled."""
        return self.state.waited

    # ------------------------------------------------------------------------- the loop

    def run(self) -> list[ScreenOutcome]:
        """Until drained (or stopped); returns what became of every screen this dispatcher ran."""
        if self.signer is not None and not self.follow:  # `follow` waits for a database down at start: _register
            self._refuse_revoked_key(self.store.signers())
        if self.only_screen is not None and self.store.screen(self.only_screen).status in ("done", "failed",
                                                                                         "cancelled"):
            return self.outcomes  # no such screen (NotFound) or it has ended: no pool is started for it
        if not self.follow and self.only_screen is None:
            # A dead dispatcher's screens count as queued once their leases expired, or at once
            # when it ran on this host and its process is gone.
            self.upkeep.reap()
            if not self.store.queued_screens():
                # Nothing to drain: no pool is started (seconds, for nothing). Screens a silent
                # dispatcher elsewhere still holds are said, with when their leases let them go.
                self.state.held = held_by_silent(self.store.queue_status(), host=platform.node(), alive=process_alive)
                return self.outcomes
        archive_dir(self.settings.archive_dir)  # before a claim: a claimed attempt would fail on it
        self.pool.connect()
        # Frozen out of the collector for the dispatcher's run: what is alive now (the libraries,
        # Ray's client). Unfrozen, the driver's full collections took 45-480 ms on a 2-core host,
        # a core taken from the worker mid-episode: one ran while plan index 38, the last of a
        # 39-episode screen, ran (the slow position of docs/metrics.md, "Plan position").
        gc.freeze()
        # Signals reach the main thread only; a dispatcher in another thread (tests) is stopped by
        # setting `stopping`.
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            self._register()
            if self.state.id is not None:
                self.fleet.start()
            while not self.stopping and self.state.id is not None:
                try:
                    if self.state.outage is not None:
                        self._ride_out()
                    else:
                        self._step()
                except DatabaseUnavailable as e:
                    if self.follow:
                        self.watch.went_down(e)
                        continue
                    # Retried with backoff already (Store): stop claiming; the archives hold every
                    # finished episode; leases expire and a later dispatcher requeues the screens.
                    self.state.stopping, self.state.fatal = "database", str(e)
                    held = [str(s.active.run.archive_path) for s in self.slots if s.active]
                    log.error("database unavailable; stopping. Archives kept as evidence: %s", ", ".join(held) or "none")
                    break
                if self.state.done:
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
                if self.state.outage is not None:
                    wait = self.watch.probe_in()
                    if wait > 0:
                        time.sleep(wait)
                        continue
                    self.store.ping()  # one try per probe; the register below retries on its own
                self._register_signer()
                self.state.id = self.store.register_dispatcher(name, platform.node(), pid=os.getpid())
                if self.state.outage is not None:
                    self._database_back()
                return
            except DatabaseUnavailable as e:
                if not self.follow:
                    raise
                self.watch.went_down(e)

    def _refuse_revoked_key(self, signers: list) -> None:
        """A signing key this database revoked (`packbench keys revoke`) signs nothing: one line."""
        refusal = revoked_key_refusal(self.signer.key_id, self.settings.signing_key, signers)
        if refusal is not None:
            raise ProvenanceError(refusal)

    def _register_signer(self) -> None:
        """Refuse a signing key this database revoked; register its public half as this
        deployment's own, unless the database holds it. An audit of a signed attempt checks it against the key the database names
        (service/audit.py `_signed_by`): a key made by `keys init --no-db` or for another database
        signed every archive, and every later `audit SCREEN` called them DISAGREE, "not trusted here"."""
        signer = self.signer
        if signer is None:
            return
        signers = self.store.signers()
        self._refuse_revoked_key(signers)
        if any(s.key_id == signer.key_id for s in signers):
            return
        name = f"{one_line(Path(self.settings.signing_key).name)[:150]} (--signing-key at dispatch)"
        self.store.put_signer(key_id=signer.key_id, public_key=signer.public_raw.hex(), name=name, local=True)
        self.progress(f"registered signing key {signer.key_id} as this deployment's own ({name!r}): audits of the "
                      f"archives it signs check their signatures against it")

    def _step(self) -> None:
        """One turn: upkeep, claims for idle workers, then whatever the workers returned."""
        stopped = self.upkeep.tick()
        if stopped is not None:  # the upkeep was due: so is dropping workers never placed
            self.fleet.drop_unplaced(self.settings.placement_timeout_s)
            for active in stopped:
                self.lifecycle.end_stopped(active)
        claimed = False
        if not self.stopping:
            for c in self.claims.fill():
                claimed = True
                if self.stopping:  # an earlier start of this turn found the archive storage failing
                    self.store.release(c.claim.attempt.id, f"dispatcher stopped ({self.stopping}) before it started")
                    continue
                self.lifecycle.start(c.slot, c.claim, queued=c.queued, claim_s=c.claim_s)
        if self._finished(claimed):
            self.state.done = True
            return
        if self.stopping:  # a start found the archive storage failing: leave without a pause
            return
        if not self.pool.in_flight():
            time.sleep(0.2)
            return
        # Back as soon as any call is: waiting for all of them held each result until the
        # look-ahead episode was back too, and the worker then idled while the driver caught up
        # (7.8 ms of queue path per episode, docs/benchmarks.md).
        for reply in self.pool.wait(0.2):
            self._handle(reply)
        self._time_out_hung()

    def _ride_out(self) -> None:
        """One turn while the database is down: archive what the workers return; probe on time.
        A probe that fails raises DatabaseUnavailable: `run` hands it to the watch, which waits on."""
        wait = self.watch.probe_in()
        if self.pool.in_flight():
            for reply in self.pool.wait(wait, every=True):
                self._handle(reply)
            self._time_out_hung()
        else:
            time.sleep(wait)
        if self.watch.probe_in() > 0 or self.stopping:
            return
        self.store.ping()
        self._database_back()

    def _database_back(self) -> None:
        """The database answers again: catch up, in order, then carry on (see the module doc)."""
        self.watch.came_back(renew=self._renew)
        self.upkeep.after_outage()
        self.lifecycle.resume()

    def _renew(self, screens: list[Active]) -> None:
        for active in self.upkeep.renew(screens):
            self.lifecycle.end_stopped(active)

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
        self._lose(slot, f"died: {cause_of(e)}")

    def _time_out_hung(self) -> None:
        """A worker that owes an episode's reply past the episode timeout, or a load's past the load
        timeout, is hung: it is lost as a dead one is (killed, replaced, its attempt failed and the screen queued
        again); a reply it sends later is dropped with it (the pool's `kill`)."""
        episode, load = self.settings.episode_timeout_s, self.settings.load_timeout_s
        for slot, entry in overdue(self.slots, now=time.monotonic(), limit_s=episode, load_limit_s=load):
            of = f" of screen {entry['screen']}" if entry.get("screen") is not None else ""
            if entry.get("load"):
                what, limit, option = "the load", load, "--load-timeout"
            else:
                what, limit, option = f"episode {entry['index']} ({entry['condition']})", episode, "--episode-timeout"
            self._lose(slot, f"timed out: no reply to {what}{of} within {limit:g} s ({option}); the worker was killed")

    def _lose(self, slot: Slot, what: str) -> None:
        cause, held = self.fleet.lose(slot, what, stopping=bool(self.stopping))
        for active in held:
            if active.stop != Stop.LOST:
                self.lifecycle.fail(active, "failed", cause, requeue=True)

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
        self.state.stopping = signal.Signals(signum).name
        log.warning("%s: giving back held screens and stopping", self.stopping)

    def _shutdown(self) -> None:
        reason = f"dispatcher stopped ({self.stopping})" if self.stopping else "dispatcher stopped"
        # With the database down nothing can be given back: the leases expire and a later
        # dispatcher requeues the screens; the archives keep every episode (db reconcile).
        offline = self.stopping == "database" or self.state.outage is not None
        for active in self.state.screens():
            if active.stop != Stop.LOST and not offline:
                try:
                    status = self.store.release(active.run.attempt.id, reason)
                    self.progress(f"screen {active.run.screen.id}: attempt {active.run.attempt.number} "
                                  f"interrupted, screen {status}")
                except PackbenchError as e:
                    log.error("could not give back screen %s: %s", active.run.screen.id, e)
        self.fleet.kill_all()
        if self.state.id is not None and not offline:
            try:
                self.store.stop_dispatcher(self.state.id)
            except PackbenchError as e:
                log.error("could not record the dispatcher's stop: %s", e)


def archive_dir(path: Path) -> None:
    """Create the archive directory, or say in one line why it cannot be (nothing is claimed)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PackbenchError(f"cannot create the archive directory {path} ({e.strerror or type(e).__name__}); "
                             f"give --archive-dir (PACKBENCH_ARCHIVE_DIR) a writable directory") from None
