"""The dispatcher's workers (`Fleet`): started on the pool, placed or refused, lost, replaced.

What happens to the screens a lost worker held is the loop's (loop.py hands them to
lifecycle.py); this part only keeps `State.slots` true to what the pool says of its workers.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from packbench.service.dispatcher.pool import WorkerPool
from packbench.service.dispatcher.state import Active, Call, CallKind, Slot, State

log = logging.getLogger("packbench.service.dispatcher")

DEAD_ON_ARRIVAL_MAX = 3  # workers that die before they are ready, after which none is replaced


class Fleet:
    """One slot per worker; `planned` workers (None: one per GPU of the pool's cluster)."""

    def __init__(self, state: State, pool: WorkerPool, *, planned: int | None,
                 progress: Callable[..., None]) -> None:
        self.state, self.pool, self.planned, self.progress = state, pool, planned, progress

    def start(self) -> None:
        for _ in range(self.planned or self.pool.gpus()):
            self.add()

    def add(self) -> None:
        self.state.started += 1
        slot = Slot(name=f"worker-{self.state.started}", worker=None, placing_since=time.monotonic())
        slot.worker = self.pool.start_worker(Call(CallKind.DESCRIBE, slot), pool_size=self.planned or self.pool.gpus())
        self.state.slots.append(slot)

    def placed(self, slot: Slot, env: dict) -> None:
        """The worker said where it is: ready, or refused (its GPU taken, or another worker's)."""
        if env.get("gpu_busy"):
            # Its GPU is held by a worker of another cluster on this host: never share it.
            self.state.refusals.append(env["gpu_busy"])
            log.warning("%s refused: %s", slot.name, env["gpu_busy"])
            self.drop(slot)
            return
        slot.env, slot.placing_since = env, None
        info = self.pool.nodes().get(slot.node)
        slot.gpu_type, slot.resources = (info.accelerator, dict(info.resources or {})) if info else (None, {})
        twin = next((s for s in self.state.slots if s is not slot and s.ready and env.get("gpu_uuid")
                     and s.env.get("gpu_uuid") == env["gpu_uuid"] and s.node == slot.node), None)
        if twin is not None:
            # Two workers on one physical GPU would contaminate each other's measurements.
            log.warning("%s landed on the GPU of %s (%s); refused: one worker per GPU", slot.name, twin.name,
                        env["gpu_uuid"])
            self.drop(slot)
            return
        self.progress(f"{slot.name} ready on {env.get('host')} ({env.get('gpu') or 'cpu'}, node {slot.node[:8]})")

    def drop(self, slot: Slot) -> None:
        self.pool.kill(slot.worker)  # its calls in flight are dropped with it
        self.state.slots.remove(slot)

    def drop_unplaced(self, timeout_s: float) -> None:
        now = time.monotonic()
        for slot in [s for s in self.state.slots if not s.ready]:
            if now - slot.placing_since > timeout_s:
                log.warning("%s was not placed within %.0f s; dropped", slot.name, timeout_s)
                self.drop(slot)

    def lose(self, slot: Slot, what: str, *, stopping: bool) -> tuple[str, list[Active]]:
        """The worker died, or hung and is killed (`what` ends the cause: "died: ...", "timed
        out: ..."): dropped, and replaced unless workers keep dying before they are ready (or
        the dispatcher is stopping). Returns the cause naming it and the screens it held
        (nothing is promoted onto a lost worker)."""
        cause = f"worker {slot.name} (pid {slot.env.get('pid')}, node {slot.node[:8] or '?'}) {what}"
        log.warning(cause)
        held = slot.screens()
        slot.active = slot.next = None
        never_ready = not slot.ready
        self.drop(slot)
        self.state.dead_on_arrival += never_ready
        if self.state.dead_on_arrival >= DEAD_ON_ARRIVAL_MAX:
            # Workers that cannot even start (a broken install on a node, say) are not replaced forever.
            self.state.refusals.append(f"{self.state.dead_on_arrival} workers died before they were ready; "
                                       f"last: {cause}")
            log.error("not replacing %s: %d workers died before they were ready", slot.name,
                      self.state.dead_on_arrival)
        elif not stopping:
            self.add()  # the pool places it wherever a GPU is free
        return cause, held

    def kill_all(self) -> None:
        for slot in self.state.slots:
            self.pool.kill(slot.worker)
