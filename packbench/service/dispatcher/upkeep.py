"""The scheduler's upkeep (`Upkeep`), every third of a lease (at most UPKEEP_MAX_S): reap expired
leases of any dispatcher, renew this one's (a refusal ends a screen as cancelled or lost),
heartbeat, drop workers never placed, and say why queued screens cannot be placed.
"""

from __future__ import annotations

import time
from typing import Callable

from packbench.core.settings import Settings
from packbench.service.scheduler_fleet import Fleet
from packbench.service.scheduler_lifecycle import Lifecycle
from packbench.service.scheduler_state import UPKEEP_MAX_S, Active, Stop, unplaceable_reason


class Upkeep:
    """Leases, heartbeat and placement kept true on a clock; `tick` does what is due."""

    def __init__(self, store, settings: Settings, fleet: Fleet, lifecycle: Lifecycle, *, lease_s: float,
                 progress: Callable[..., None]) -> None:
        self.store, self.settings, self.fleet, self.lifecycle = store, settings, fleet, lifecycle
        self.lease_s, self.progress = lease_s, progress
        self._next = 0.0  # time.monotonic() of the next upkeep
        self._no_reap_until = 0.0  # after an outage: time.monotonic() before which no lease is reaped

    def tick(self, dispatcher_id: int) -> None:
        """Reap expired leases, renew ours, heartbeat, unplaced workers: when a third of a lease
        (at most UPKEEP_MAX_S) has passed since the last time."""
        now_s = time.monotonic()
        if now_s < self._next:
            return
        # A third of a lease keeps it alive; at most 2 s so a cancel is seen within 2 s.
        self._next = now_s + min(self.lease_s / 3, UPKEEP_MAX_S)
        if now_s >= self._no_reap_until:
            self.reap()
        self.renew(self.fleet.screens())
        self.fleet.drop_unplaced(self.settings.placement_timeout_s)
        self.store.heartbeat(dispatcher_id, [s.describe() for s in self.fleet.ready()])
        self.explain_unplaceable()

    def after_outage(self) -> None:
        """The database is back: renew and heartbeat on the next turn. Other dispatchers waited
        out the same outage and their leases expired too: give them one lease to renew before
        reaping theirs (a dead dispatcher's screens wait that much longer)."""
        self._next = 0.0
        self._no_reap_until = time.monotonic() + self.lease_s

    def reap(self) -> None:
        for reaped in self.store.reap_expired():
            self.progress(f"screen {reaped.screen_id}: attempt {reaped.attempt_id} lost (lease expired), "
                          f"screen {reaped.screen_status}")

    def renew(self, screens: list[Active]) -> None:
        """Renew the leases of `screens` still running; a refusal stops the screen."""
        for active in screens:
            if active.stop is None and not active.ended and not self.store.renew_lease(active.run.attempt.id,
                                                                                     self.lease_s):
                self._refused(active)

    def _refused(self, active: Active) -> None:
        """A renewal was refused: cancelled (finish after the episode in flight) or lost."""
        attempt = next(a for a in self.store.attempts(active.run.screen.id) if a.id == active.run.attempt.id)
        active.stop = Stop.CANCELLED if attempt.status == "running" else Stop.LOST
        self.progress(f"screen {active.run.screen.id}: {active.stop}; stopping after the episode in flight")
        if active.inflight == 0:
            self.lifecycle.end_stopped(active)

    def explain_unplaceable(self) -> None:
        """Queued screens no worker of this pool can ever take say why in `packbench status`."""
        ready = self.fleet.ready()
        if not ready:
            return
        for screen in self.store.queued_screens():
            reason = unplaceable_reason(screen, ready, replica_nodes=self.store.replica_nodes)
            if reason != screen.unplaceable_reason:
                self.store.set_unplaceable(screen.id, reason)
