"""What becomes of a claimed screen on its worker (`Lifecycle`): it starts (its archive opened,
its load sent), its load comes back, its episodes go out one ahead and come back to be archived
and recorded, and it ends (done, failed, cancelled, lost), handing its worker to the screen
claimed behind it.

Which screen a worker claims is claims.py's; a database outage pauses the episodes and defers
the writes through outage.py's `OutageWatch`. A write the archive's storage refuses (a full
disk) fails that screen only and stops the dispatcher from claiming more (`State.fatal`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from packbench.core.dispersion import NOISY_CORES, other_cores
from packbench.core.errors import ArchiveStorageError, PackbenchError
from packbench.core.plan import episode_input
from packbench.core.protocol import expand
from packbench.core.provenance import Signer
from packbench.db.errors import DatabaseUnavailable
from packbench.service.dispatcher.outage import OutageWatch
from packbench.service.dispatcher.pool import Reply, WorkerPool
from packbench.service.dispatcher.state import (LOOKAHEAD, Active, Call, CallKind, Moment, ScreenEvent, Slot, State,
                                                Stop, now)
from packbench.service.screen import ScreenOutcome, ScreenRun, cause_of, is_bad_input
from packbench.service.submit import screen_prompts

log = logging.getLogger("packbench.service.dispatcher")


class Lifecycle:
    """The screens the workers run, from their start to their end (`State.outcomes`: what
    became of each one ended, in order)."""

    def __init__(self, state: State, store, pool: WorkerPool, watch: OutageWatch, *, freeze: dict,
                 signer: Signer | None, model_cache: str | None, progress: Callable[..., None],
                 on_outcome: Callable[[ScreenOutcome], None], observer: Callable[[ScreenEvent], None] | None) -> None:
        self.state, self.store, self.pool, self.watch = state, store, pool, watch
        self.freeze, self.signer, self.model_cache = freeze, signer, model_cache
        self.progress, self.on_outcome, self.observer = progress, on_outcome, observer

    def start(self, slot: Slot, claim, *, queued: bool = False, claim_s: float = 0.0) -> Active:
        """Open the claimed screen's archive and send its load; `queued`: as the slot's next
        screen (the load waits on the worker behind the running screen's last episodes)."""
        protocol = expand(json.loads(claim.protocol.canonical_json))
        run = ScreenRun(self.store, screen=claim.screen, attempt=claim.attempt, protocol=protocol,
                        archive_path=Path(claim.attempt.archive_path), freeze=self.freeze,
                        progress=self.progress, signer=self.signer)
        self.tell(Moment.CLAIMED, run, now(), claim_s)
        active = Active(slot=slot, run=run, protocol=protocol)
        if queued:
            slot.next = active
        else:
            slot.active = active
        try:
            run.begin(slot.env)
        except PackbenchError as e:  # the archive cannot be written: the attempt fails, never stays running
            self.refused(active, e)
            return active
        # A protocol that judges the cold start gets a cold model; any other reuses a warm one.
        reuse = protocol.gates.useful_latency is None
        self._owe(slot, {"load": True, "screen": claim.screen.id})  # a load that hangs is timed too
        self.pool.load(slot.worker, Call(CallKind.LOAD, slot, active), protocol, claim.screen.model_dir,
                       model_cache=self.model_cache, reuse=reuse)
        active.inflight += 1
        return active

    def refused(self, active: Active, e: PackbenchError) -> None:
        """A step of the screen was refused (`e`). By the archive's storage (a full disk, a
        read-only mount, an I/O error): not the screen's fault, so the attempt fails with its
        screen requeued, and the dispatcher claims nothing more (every later screen would fail
        the same way; they stay queued). Anything else (the archive, the prompts) is the
        screen's input (exit 2)."""
        if isinstance(e, ArchiveStorageError):
            if self.state.fatal is None:
                self.state.fatal = f"the archive storage failed: {e}"
            self.state.stopping = self.state.stopping or "archive"
            self.fail(active, "failed", str(e), requeue=True, storage=True)
        else:
            self.fail(active, "failed", str(e), bad_input=True)

    def tell(self, moment: Moment, run: ScreenRun, at: float, seconds: float = 0.0) -> None:
        if self.observer is not None:
            self.observer(ScreenEvent(moment, run, at, seconds))

    # ------------------------------------------------------------------------- replies

    def reply(self, call: Call, reply: Reply) -> None:
        """A screen's load or episode came back, or raised (the screen fails, the worker lives)."""
        slot, active = call.slot, call.screen
        if call.kind in (CallKind.EPISODE, CallKind.LOAD) and slot.owed:  # the worker has gone on to the call behind it
            slot.owed.pop(0)
            slot.since = time.monotonic()
        if active is None or active not in (slot.active, slot.next):
            return  # a result for a screen already ended (a cancelled screen's look-ahead)
        active.inflight -= 1
        if reply.error is not None:
            self.fail(active, "failed", cause_of(reply.error), bad_input=is_bad_input(reply.error))
            return
        if call.kind is CallKind.LOAD and active is slot.next:
            active.start = reply.value  # the slot's screen is still finishing: it starts when that ends
            if active.stop:
                self.end_stopped(active)
            return
        self.guarded(active, self._loaded if call.kind is CallKind.LOAD else self._episode, reply.value)

    def guarded(self, active: Active, step: Callable[[Active, dict], None], value: dict) -> None:
        try:
            step(active, value)
        except DatabaseUnavailable:
            raise
        except PackbenchError as e:  # the archive or the prompts refused it
            self.refused(active, e)

    def _loaded(self, active: Active, start: dict) -> None:
        run = active.run
        # The bench's clock of the screen starts here, before any of the driver's own work.
        self.tell(Moment.LOADED, run, now())
        vocab = start.pop("vocab")
        prompt_file = Path(run.screen.prompt_file) if run.screen.prompt_file else None
        active.token_ids = screen_prompts(active.protocol, vocab=vocab, model_dir=Path(start["model_dir"]),
                                          prompt_file=prompt_file)
        if active.stop:
            self.end_stopped(active)
            return
        active.entries = run.entries
        # The worker starts on its first episodes now; the attempt's placement and the archive's
        # plan.json / worker.json are written meanwhile (before any record: this thread handles
        # the results, and only after this returns).
        for _ in range(LOOKAHEAD):
            self._submit_next(active)
        self.tell(Moment.FIRST_OUT, run, now())
        run.loaded(start, active.token_ids)
        model_state = start.get("model_state")
        self.watch.when_db(lambda: self._place(active, model_state))

    def _place(self, active: Active, model_state: str | None) -> None:
        try:
            self.store.place_attempt(active.run.attempt.id, model_state=model_state)
        except DatabaseUnavailable:
            raise
        except PackbenchError as e:  # no longer running (reaped, say): the renewal decides what ends it
            log.warning("screen %s: placement not recorded: %s", active.run.screen.id, e)

    def _submit_next(self, active: Active) -> None:
        if active.submitted >= len(active.entries) or active.stop or self.state.outage is not None:
            return  # an outage pauses the screen: `resume` submits again
        entry = active.entries[active.submitted]
        slot = active.slot
        self._owe(slot, {**entry, "screen": active.run.screen.id})  # whose episode, should it hang
        active.submitted += 1
        active.inflight += 1
        self.pool.run(active.slot.worker, Call(CallKind.EPISODE, active.slot, active), entry,
                      episode_input(active.token_ids, entry))

    @staticmethod
    def _owe(slot: Slot, what: dict) -> None:
        """A call sent to the worker that it must answer in time: an episode's plan entry (the
        episode timeout), or `{"load": True}` for a screen's load (the load timeout: a read from a
        hung file system, a conversion that never ends). The worker runs its calls in order, so
        the clock runs from when it begins the oldest one not back."""
        if not slot.owed:  # the worker starts on it now (after an outage, too): its clock starts
            slot.since = time.monotonic()
        slot.owed.append(what)

    def resume(self) -> None:
        """After an outage: every running screen gets its look-ahead episodes again."""
        for active in self.state.screens():
            if active.entries and active.stop is None and not active.ended:
                while active.submitted - active.run.done_count < LOOKAHEAD and active.submitted < len(active.entries):
                    self._submit_next(active)

    def _episode(self, active: Active, record: dict) -> None:
        if active.stop == Stop.LOST:
            if active.inflight == 0:
                self.end_stopped(active)
            return  # reaped: another attempt may run the screen now; this one writes nothing more
        # The next episode goes to the worker before this one is persisted (archive + row).
        self._submit_next(active)
        self._note_host_sharing(active, record)
        t0 = now()
        try:
            active.run.record(record, persist=self.state.outage is None)  # archived either way
        except DatabaseUnavailable:
            self.tell(Moment.RECORDED, active.run, t0, now() - t0)  # archived, its row deferred
            self.watch.defer(lambda: self._recorded(active))
            raise
        self.tell(Moment.RECORDED, active.run, t0, now() - t0)
        self._recorded(active)

    def _recorded(self, active: Active) -> None:
        if active.ended:
            return
        if active.stop:
            if active.inflight == 0:
                self.end_stopped(active)
            return
        if active.run.done_count == len(active.entries):
            # Verdicts, seal and rows now, before the next screen's first episodes go out. Deferring
            # them behind those episodes (tried) cut the worker's switch between screens from ~20
            # to ~4 ms but put 10-25 ms of driver work inside the next screen, and the queue path
            # per episode rose by 1-5 ms in 6 of 6 paired runs (docs/benchmarks.md).
            self.watch.when_db(lambda: self._finish(active))

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
        mine = {s.env.get("pid") for s in self.state.slots if s.env.get("host") == host}
        foreign = [p for p in record.get("host_workers") or [] if p[0] not in mine]
        if foreign:
            active.host_shared = True
            self.progress(f"screen {active.run.screen.id}: host {host} was shared with packbench worker "
                          + ", ".join(f"pid {pid} ({device})" for pid, device in foreign)
                          + ", not this dispatcher's, busy during its episodes (each episode records it)")

    # ------------------------------------------------------------------------- endings

    def _finish(self, active: Active) -> None:
        if active.ended or active.stop:  # reaped over an outage: the renewal ended it as lost
            return
        self.end(active, active.run.finish())

    def end_stopped(self, active: Active) -> None:
        """End a screen whose renewal was refused: cancelled by the user, or lost to a reaper."""
        if active.ended:
            return
        if active.stop == Stop.CANCELLED:
            self.fail(active, "cancelled", "cancelled by the user")
        else:
            run = active.run
            self.end(active, ScreenOutcome(run.screen.id, run.attempt.id, run.archive_path, None, "lost",
                                           "the lease expired; the screen was requeued by a reaper"))

    def fail(self, active: Active, status: str, error: str, *, requeue: bool = False,
             bad_input: bool = False, storage: bool = False) -> None:
        self.watch.when_db(lambda: self._fail_now(active, status, error, requeue=requeue, bad_input=bad_input,
                                                  storage=storage))

    def _fail_now(self, active: Active, status: str, error: str, *, requeue: bool = False,
                  bad_input: bool = False, storage: bool = False) -> None:
        if active.ended:
            return
        try:
            self.end(active, active.run.fail(status, error, requeue=requeue, bad_input=bad_input, storage=storage))
        except DatabaseUnavailable:
            raise
        except PackbenchError as e:
            log.error("could not record the end of screen %s: %s", active.run.screen.id, e)
            self.end(active, None)

    def end(self, active: Active, outcome: ScreenOutcome | None) -> None:
        """The screen is over for this slot: its next screen (if claimed) becomes the active one."""
        if active.ended:
            return
        active.ended = True
        slot = active.slot
        active.run.episodes = [{**e, "logits": None, "calls": None} for e in active.run.episodes]
        if outcome is not None:
            self.state.outcomes.append(outcome)
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
            self.guarded(following, self._loaded, start)
