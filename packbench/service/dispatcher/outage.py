"""A database outage as a following dispatcher waits it out (`dispatch --follow`): `OutageWatch`
enters it (`State.outage`, probed on rules.py's `outage_delays`), defers the database writes
that come due during it (`State.deferred`) and catches up, in order, when the database answers.

A one-shot dispatcher never waits: it stops at the first `DatabaseUnavailable` (loop.py). The
loop probes (`Dispatcher._ride_out`); this part decides what a probe's answer changes.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Callable

from packbench.core.errors import PackbenchError
from packbench.db.errors import DatabaseUnavailable
from packbench.service.dispatcher.rules import OUTAGE_BACKOFF_S, outage_delays
from packbench.service.dispatcher.state import Active, Outage, State

log = logging.getLogger("packbench.service.dispatcher")


class OutageWatch:
    """The outage a following dispatcher waits out (`State.outage`, None while the database
    answers), and the database writes it interrupted or that came due during it, run in order
    once it answers again (each is idempotent or resumes where it stopped)."""

    def __init__(self, state: State, store, *, follow: bool, lease_s: float,
                 backoff: tuple[float, float] = OUTAGE_BACKOFF_S, progress: Callable[..., None]) -> None:
        self.state, self.store, self.follow, self.lease_s = state, store, follow, lease_s
        self.backoff, self.progress = backoff, progress

    def when_db(self, action: Callable[[], None]) -> None:
        """Run a database step now; while the database is down (`follow`), once it is back, in order."""
        if self.state.outage is not None:
            self.state.deferred.append(action)
            return
        try:
            action()
        except DatabaseUnavailable:
            self.defer(action)
            raise

    def defer(self, action: Callable[[], None]) -> None:
        """A database step the outage just interrupted: with `follow`, it runs once the database is back."""
        if self.follow:
            self.state.deferred.append(action)

    def probe_in(self) -> float:
        """Seconds until the next probe is due (0: now), at most 0.2 so the loop stays responsive."""
        return max(0.0, min(0.2, self.state.outage.next_probe - time.monotonic()))

    def went_down(self, e: DatabaseUnavailable) -> None:
        """The database stopped answering (`follow`): wait for it, saying so once; the screens the
        workers hold get rows for their episodes when it is back."""
        now_s = time.monotonic()
        outage = self.state.outage
        if outage is not None:  # it failed again while we were catching up: keep waiting
            outage.probes += 1
            outage.schedule(now_s)
            return
        first, cap = self.backoff
        # It was failing through the Store's retries before it was raised: the outage began then.
        began = datetime.now(timezone.utc) - timedelta(seconds=e.failing_s)
        outage = self.state.outage = Outage(cause=e.cause, since=now_s - e.failing_s,
                                            started_at=began.strftime("%H:%M:%S UTC"),
                                            delays=outage_delays(first, cap))
        outage.schedule(now_s)
        screens = self.state.screens()
        in_flight = sum(a.submitted - a.run.done_count for a in screens if a.entries)
        held = in_flight + sum(len(a.run.unpersisted) for a in screens)
        self.progress(f"database unavailable since {outage.started_at} ({e.cause}); waiting for it, probing "
                      f"every {first:g}-{cap:g} s: no claims and no new episodes meanwhile; {held} episode"
                      f"{'s' if held != 1 else ''} in flight or archived without a row get their rows from the "
                      f"archives when it answers")

    def came_back(self, *, renew: Callable[[list[Active]], None]) -> None:
        """The database answers again: reconcile the rows the archives of the held screens hold,
        `renew` their leases, run the deferred writes in order, reconcile this host's attempts
        that ended meanwhile, and say so in one line. Raises DatabaseUnavailable (the same
        outage goes on) when it fails again on the way."""
        from packbench.service.reconcile import reconcile

        state = self.state
        outage = state.outage
        down_s = time.monotonic() - outage.since
        own = {a.run.attempt.id: a for a in state.screens() if a.run.writer is not None}
        report = reconcile(self.store, attempt_ids=list(own),
                           expected={i: a.run.writer.members for i, a in own.items()})
        for done in report.attempts:
            own[done.attempt_id].run.unpersisted.clear()
        renew(list(own.values()))  # reaped meanwhile (lost) or cancelled: its ending is deferred below
        # The deferred writes run now (and whatever they start writes at once, not deferred again).
        state.outage = None
        pending, state.deferred = state.deferred, []
        while pending:
            action = pending.pop(0)
            try:
                action()
            except DatabaseUnavailable:
                state.deferred = [action, *pending, *state.deferred]
                state.outage = outage  # the same outage goes on: no second line
                raise
            except PackbenchError as e:
                log.error("a write deferred over the database outage failed: %s", e)
        try:
            # Every attempt on this host that ended since the outage began (a lease before it, to
            # cover the attempts it cut short): not the whole history, which `db reconcile` reads.
            since = datetime.now(timezone.utc) - timedelta(seconds=down_s + self.lease_s)
            others = reconcile(self.store, finished_since=since)
        except DatabaseUnavailable:
            state.outage = outage
            raise
        rows = report.inserted + others.inserted
        state.waited.append({"seconds": down_s, "probes": outage.probes, "reconciled": rows,
                             "attempts": [r.line() for r in report.attempts + others.attempts]})
        detail = "; ".join(r.line() for r in report.attempts + others.attempts)
        self.progress(f"database back after {down_s:.1f} s ({outage.probes} failed probe"
                      f"{'s' if outage.probes != 1 else ''}); reconciled {rows} episode row"
                      f"{'s' if rows != 1 else ''} from archives{f' ({detail})' if detail else ''}; continuing")
