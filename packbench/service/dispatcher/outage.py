"""A database outage as a following scheduler waits it out (`dispatch --follow`): the outage
itself (`Outage`, probed on `outage_delays`), and `OutageWatch`, which enters it, defers the
database writes that come due during it and catches up, in order, when the database answers.

A one-shot scheduler never waits: it stops at the first `DatabaseUnavailable`
(service/scheduler.py). The scheduler's loop probes (`Scheduler._ride_out`); this module decides
what a probe's answer changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterator

from packbench.core.errors import PackbenchError
from packbench.db.errors import DatabaseUnavailable
from packbench.service.scheduler_state import Active

log = logging.getLogger("packbench.service.scheduler")

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


class OutageWatch:
    """The outage a following scheduler waits out (`outage`, None while the database answers),
    and the database writes it interrupted or that came due during it, run in order once it
    answers again (each is idempotent or resumes where it stopped)."""

    def __init__(self, store, *, follow: bool, lease_s: float, backoff: tuple[float, float] = OUTAGE_BACKOFF_S,
                 progress: Callable[..., None]) -> None:
        self.store, self.follow, self.lease_s, self.backoff, self.progress = store, follow, lease_s, backoff, progress
        self.outage: Outage | None = None  # the database is down and `follow` waits for it
        self.waited: list[dict] = []  # each outage waited out: seconds, probes, rows reconciled
        self._deferred: list[Callable[[], None]] = []

    def when_db(self, action: Callable[[], None]) -> None:
        """Run a database step now; while the database is down (`follow`), once it is back, in order."""
        if self.outage is not None:
            self._deferred.append(action)
            return
        try:
            action()
        except DatabaseUnavailable:
            self.defer(action)
            raise

    def defer(self, action: Callable[[], None]) -> None:
        """A database step the outage just interrupted: with `follow`, it runs once the database is back."""
        if self.follow:
            self._deferred.append(action)

    def probe_in(self) -> float:
        """Seconds until the next probe is due (0: now), at most 0.2 so the loop stays responsive."""
        return max(0.0, min(0.2, self.outage.next_probe - time.monotonic()))

    def went_down(self, e: DatabaseUnavailable, screens: list[Active]) -> None:
        """The database stopped answering (`follow`): wait for it, saying so once; `screens`: those
        the scheduler's workers hold (their episodes get rows when it is back)."""
        now_s = time.monotonic()
        if self.outage is not None:  # it failed again while we were catching up: keep waiting
            self.outage.probes += 1
            self.outage.schedule(now_s)
            return
        first, cap = self.backoff
        # It was failing through the Store's retries before it was raised: the outage began then.
        began = datetime.now(timezone.utc) - timedelta(seconds=e.failing_s)
        self.outage = Outage(cause=e.cause, since=now_s - e.failing_s, started_at=began.strftime("%H:%M:%S UTC"),
                             delays=outage_delays(first, cap))
        self.outage.schedule(now_s)
        in_flight = sum(a.submitted - a.run.done_count for a in screens if a.entries)
        held = in_flight + sum(len(a.run.unpersisted) for a in screens)
        self.progress(f"database unavailable since {self.outage.started_at} ({e.cause}); waiting for it, probing "
                      f"every {first:g}-{cap:g} s: no claims and no new episodes meanwhile; {held} episode"
                      f"{'s' if held != 1 else ''} in flight or archived without a row get their rows from the "
                      f"archives when it answers")

    def came_back(self, screens: list[Active], *, renew: Callable[[list[Active]], None]) -> None:
        """The database answers again: reconcile the rows the archives of `screens` hold, `renew`
        their leases, run the deferred writes in order, reconcile this host's attempts that ended
        meanwhile, and say so in one line. Raises DatabaseUnavailable (the same outage goes on)
        when it fails again on the way."""
        from packbench.service.reconcile import reconcile

        outage = self.outage
        down_s = time.monotonic() - outage.since
        own = {a.run.attempt.id: a for a in screens if a.run.writer is not None}
        report = reconcile(self.store, attempt_ids=list(own),
                           expected={i: a.run.writer.members for i, a in own.items()})
        for done in report.attempts:
            own[done.attempt_id].run.unpersisted.clear()
        renew(list(own.values()))  # reaped meanwhile (lost) or cancelled: its ending is deferred below
        # The deferred writes run now (and whatever they start writes at once, not deferred again).
        self.outage = None
        pending, self._deferred = self._deferred, []
        while pending:
            action = pending.pop(0)
            try:
                action()
            except DatabaseUnavailable:
                self._deferred = [action, *pending, *self._deferred]
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
        rows = report.inserted + others.inserted
        self.waited.append({"seconds": down_s, "probes": outage.probes, "reconciled": rows,
                            "attempts": [r.line() for r in report.attempts + others.attempts]})
        detail = "; ".join(r.line() for r in report.attempts + others.attempts)
        self.progress(f"database back after {down_s:.1f} s ({outage.probes} failed probe"
                      f"{'s' if outage.probes != 1 else ''}); reconciled {rows} episode row"
                      f"{'s' if rows != 1 else ''} from archives{f' ({detail})' if detail else ''}; continuing")
