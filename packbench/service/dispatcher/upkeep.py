"""The dispatcher's upkeep (`Upkeep`), every third of a lease (at most UPKEEP_MAX_S): reap
expired leases of any dispatcher (and at once those of a dispatcher on this host whose process
is gone), renew this one's (a refusal stops a screen as cancelled or lost), heartbeat, and say
why queued screens cannot be placed. The clocks are `State.next_upkeep` and `State.no_reap_until`.
"""

from __future__ import annotations

import platform
import time
from datetime import datetime
from typing import Callable

from packbench.service.dispatcher.rules import UPKEEP_MAX_S, unplaceable_reason
from packbench.service.dispatcher.state import Active, State, Stop


class Upkeep:
    """Leases, heartbeat and placement kept true on a clock; `tick` does what is due.
    `alive(pid, started_at)`: whether the dispatcher that registered as `pid` on this host at
    `started_at` still runs (a dead holder's lease is reaped at once, a live one's never)."""

    def __init__(self, state: State, store, *, lease_s: float, progress: Callable[..., None],
                 alive: Callable[[int, datetime], bool]) -> None:
        self.state, self.store, self.lease_s, self.progress, self.alive = state, store, lease_s, progress, alive

    def tick(self) -> list[Active] | None:
        """Reap, renew, heartbeat, explain: when a third of a lease (at most UPKEEP_MAX_S) has
        passed since the last time. None when nothing was due; else the screens a refused
        renewal stopped that have nothing in flight (the caller ends them)."""
        now_s = time.monotonic()
        if now_s < self.state.next_upkeep:
            return None
        # A third of a lease keeps it alive; at most 2 s so a cancel is seen within 2 s.
        self.state.next_upkeep = now_s + min(self.lease_s / 3, UPKEEP_MAX_S)
        if now_s >= self.state.no_reap_until:
            self.reap()
        stopped = self.renew(self.state.screens())
        self.store.heartbeat(self.state.id, [s.describe() for s in self.state.ready()])
        self.explain_unplaceable()
        return stopped

    def after_outage(self) -> None:
        """The database is back: renew and heartbeat on the next turn. Other dispatchers waited
        out the same outage and their leases expired too: give them one lease to renew before
        reaping theirs (a dead dispatcher's screens wait that much longer)."""
        self.state.next_upkeep = 0.0
        self.state.no_reap_until = time.monotonic() + self.lease_s

    def reap(self) -> None:
        """Expired leases become lost attempts, except those of a live dispatcher on this host
        (it renews them once it can: after a database outage, say); a dead one's go at once."""
        for reaped in self.store.reap_expired(host=platform.node(), alive=self.alive):
            # The attempt's number within its screen, as `screens show` lists it: before, the row
            # id was named, so a killed driver's attempt 1 of screen 2 was reported "attempt 2 lost".
            self.progress(f"screen {reaped.screen_id}: attempt {reaped.attempt_number} lost ({reaped.why}), "
                          f"screen {reaped.screen_status}")

    def renew(self, screens: list[Active]) -> list[Active]:
        """Renew the leases of `screens` still running; a refusal stops the screen. Returns the
        stopped screens with nothing in flight (they end now)."""
        stopped = []
        for active in screens:
            if active.stop is None and not active.ended and not self.store.renew_lease(active.run.attempt.id,
                                                                                     self.lease_s):
                if self._refused(active):
                    stopped.append(active)
        return stopped

    def _refused(self, active: Active) -> bool:
        """A renewal was refused: cancelled (finish after the episode in flight) or lost."""
        attempt = next(a for a in self.store.attempts(active.run.screen.id) if a.id == active.run.attempt.id)
        active.stop = Stop.CANCELLED if attempt.status == "running" else Stop.LOST
        self.progress(f"screen {active.run.screen.id}: {active.stop}; stopping after the episode in flight")
        return active.inflight == 0

    def explain_unplaceable(self) -> None:
        """Queued screens no worker of this pool can ever take say why in `packbench status`."""
        ready = self.state.ready()
        if not ready:
            return
        for screen in self.store.queued_screens():
            reason = unplaceable_reason(screen, ready, replica_nodes=self.store.replica_nodes)
            if reason != screen.unplaceable_reason:
                self.store.set_unplaceable(screen.id, reason)
