"""Claims for the scheduler's workers (`Claims`): an idle worker claims a screen, a worker
handing out its screen's last episodes claims its next one (look-ahead); a claimed screen's
archive is opened and its load sent (`Claims.start`). What follows is service/scheduler_lifecycle.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from packbench.core.errors import PackbenchError
from packbench.core.protocol import expand
from packbench.core.provenance import Signer
from packbench.core.settings import Settings
from packbench.service.scheduler_fleet import Fleet
from packbench.service.scheduler_lifecycle import Lifecycle
from packbench.service.scheduler_pool import WorkerPool
from packbench.service.scheduler_state import Active, Call, CallKind, Moment, Slot, gpu_index, now
from packbench.service.screen import ScreenRun


class Claims:
    """Claim screens (`Store.claim_screen`: atomic, a lease) for the fleet's workers and start them.

    `only_screen`: claim that screen only; `look_ahead` False: claim only for idle workers
    (bench/cluster.py --no-look-ahead measures the difference)."""

    def __init__(self, store, settings: Settings, pool: WorkerPool, fleet: Fleet, lifecycle: Lifecycle, *,
                 lease_s: float, freeze: dict, signer: Signer | None, only_screen: int | None,
                 look_ahead: bool, progress: Callable[..., None]) -> None:
        self.store, self.settings, self.pool, self.fleet, self.lifecycle = store, settings, pool, fleet, lifecycle
        self.lease_s, self.freeze, self.signer = lease_s, freeze, signer
        self.only_screen, self.look_ahead, self.progress = only_screen, look_ahead, progress

    def fill(self, dispatcher_id: int) -> bool:
        """Claim for idle workers first, then a next screen for workers handing out their last
        episodes (an idle worker elsewhere must not lose a screen to a busy one's look-ahead).
        True when anything was claimed."""
        claimed = False
        for slot in self.fleet.slots:
            if slot.ready and slot.active is None and self._claim(dispatcher_id, slot) is not None:
                claimed = True
        if self.only_screen is None and self.look_ahead:
            for slot in self.fleet.slots:
                active = slot.active
                if (slot.ready and active is not None and slot.next is None and active.stop is None
                        and active.handed_out and not active.looked_ahead):
                    active.looked_ahead = True
                    claimed = self._claim(dispatcher_id, slot, follows=active) is not None or claimed
        return claimed

    def _claim(self, dispatcher_id: int, slot: Slot, *, follows: Active | None = None) -> Active | None:
        t0 = now()
        claim = self.store.claim_screen(
            dispatcher_id, lease_s=self.lease_s, archive_dir=str(self.settings.archive_dir.resolve()),
            source_freeze=self.freeze, worker=f"{slot.name} pid {slot.env.get('pid')}", node=slot.node,
            gpu_name=slot.env.get("gpu") or "cpu", gpu_index=gpu_index(slot.env),
            machine_id=self._machine(slot), gpu_types=[slot.gpu_type] if slot.gpu_type else [],
            node_resources=slot.resources, screen_id=self.only_screen,
            follows_attempt=None if follows is None else follows.run.attempt.id)
        if claim is None:
            return None
        return self.start(slot, claim, queued=follows is not None, claim_s=now() - t0)

    def _machine(self, slot: Slot) -> int:
        env = slot.env
        if slot.machine_id is None:  # one row per worker: its host, GPU and software do not change
            slot.machine_id = self.store.put_machine(host=env["host"], gpu_name=env["gpu"], driver=env["driver"],
                                                     torch=env["torch"], cuda=env["cuda"])
        return slot.machine_id

    def start(self, slot: Slot, claim, *, queued: bool = False, claim_s: float = 0.0) -> Active:
        """Open the claimed screen's archive and send its load; `queued`: as the slot's next
        screen (the load waits on the worker behind the running screen's last episodes)."""
        protocol = expand(json.loads(claim.protocol.canonical_json))
        run = ScreenRun(self.store, screen=claim.screen, attempt=claim.attempt, protocol=protocol,
                        archive_path=Path(claim.attempt.archive_path), freeze=self.freeze,
                        progress=self.progress, signer=self.signer)
        self.lifecycle.tell(Moment.CLAIMED, run, now(), claim_s)
        active = Active(slot=slot, run=run, protocol=protocol)
        if queued:
            slot.next = active
        else:
            slot.active = active
        try:
            run.begin(slot.env)
        except PackbenchError as e:  # the archive cannot be written: the attempt fails, never stays running
            # bad_input as when the archive fails mid-screen (Lifecycle.guarded): one cause, one exit code.
            self.lifecycle.end(active, run.fail("failed", str(e), bad_input=True))
            return active
        cache = None if self.settings.model_cache is None else str(self.settings.model_cache)
        # A protocol that judges the cold start gets a cold model; any other reuses a warm one.
        reuse = protocol.gates.useful_latency is None
        self.pool.load(slot.worker, Call(CallKind.LOAD, slot, active), protocol, claim.screen.model_dir,
                       model_cache=cache, reuse=reuse)
        active.inflight += 1
        return active
