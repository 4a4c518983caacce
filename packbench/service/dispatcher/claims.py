"""Claims for the dispatcher's workers (`Claims`): an idle worker claims a screen, a worker
handing out its screen's last episodes claims its next one (look-ahead). A claim is a row and a
lease (`Store.claim_screen`: atomic); starting the claimed screen is lifecycle.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from packbench.service.dispatcher.state import Active, Slot, State, gpu_index, now


@dataclass(frozen=True)
class Claimed:
    """A screen claimed for `slot`: `queued` as its next one (behind its running screen)."""

    slot: Slot
    claim: object  # the db Claim: screen, attempt, protocol
    queued: bool
    claim_s: float  # the claim's own duration


class Claims:
    """Claim screens for the workers of `State.slots`, their archives in `archive_dir` (absolute).

    `only_screen`: claim that screen only; `look_ahead` False: claim only for idle workers
    (bench/cluster.py --no-look-ahead measures the difference)."""

    def __init__(self, state: State, store, *, archive_dir: str, lease_s: float, freeze: dict,
                 only_screen: int | None, look_ahead: bool) -> None:
        self.state, self.store, self.archive_dir = state, store, archive_dir
        self.lease_s, self.freeze, self.only_screen, self.look_ahead = lease_s, freeze, only_screen, look_ahead

    def fill(self) -> list[Claimed]:
        """Claim for idle workers first, then a next screen for workers handing out their last
        episodes (an idle worker elsewhere must not lose a screen to a busy one's look-ahead).
        Returns the claims, in order, for the caller to start."""
        out = []
        for slot in self.state.slots:
            if slot.ready and slot.active is None:
                out += self._claim(slot)
        if self.only_screen is None and self.look_ahead:
            for slot in self.state.slots:
                active = slot.active
                if (slot.ready and active is not None and slot.next is None and active.stop is None
                        and active.handed_out and not active.looked_ahead):
                    active.looked_ahead = True
                    out += self._claim(slot, follows=active)
        return out

    def _claim(self, slot: Slot, *, follows: Active | None = None) -> list[Claimed]:
        t0 = now()
        claim = self.store.claim_screen(
            self.state.id, lease_s=self.lease_s, archive_dir=self.archive_dir,
            source_freeze=self.freeze, worker=f"{slot.name} pid {slot.env.get('pid')}", node=slot.node,
            gpu_name=slot.env.get("gpu") or "cpu", gpu_index=gpu_index(slot.env),
            machine_id=self._machine(slot), gpu_types=[slot.gpu_type] if slot.gpu_type else [],
            node_resources=slot.resources, screen_id=self.only_screen,
            follows_attempt=None if follows is None else follows.run.attempt.id)
        if claim is None:
            return []
        return [Claimed(slot, claim, queued=follows is not None, claim_s=now() - t0)]

    def _machine(self, slot: Slot) -> int:
        env = slot.env
        if slot.machine_id is None:  # one row per worker: its host, GPU and software do not change
            slot.machine_id = self.store.put_machine(host=env["host"], gpu_name=env["gpu"], driver=env["driver"],
                                                     torch=env["torch"], cuda=env["cuda"])
        return slot.machine_id
