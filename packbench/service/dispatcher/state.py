"""Everything a dispatcher changes as it runs, in one place (`State`): the workers (`Slot`), the
screens they run (`Active`), the calls in flight (`Call`), a database outage waited out
(`Outage`), what became of each screen, and the clocks of the upkeep. Its one owner is
`Dispatcher` (loop.py), which makes one `State` and hands it to each part; no part keeps state
of its own. What an observer hears (`ScreenEvent`) is here too; the pure decisions read from it
are rules.py's.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from packbench.core.protocol import Protocol

LOOKAHEAD = 2  # episodes submitted to a worker at once: one running, one waiting


class Stop(enum.StrEnum):
    """Why a running screen gets no more episodes (its lease renewal was refused)."""

    CANCELLED = "cancelled"  # the user cancelled it: it ends after the episode in flight
    LOST = "lost"  # reaped as lost: another attempt may run the screen; this one writes nothing more


class CallKind(enum.Enum):
    DESCRIBE = "describe"  # a started worker says where it is
    LOAD = "load"  # a screen's model load
    EPISODE = "episode"  # one planned episode


@dataclass(eq=False)
class Call:
    """The tag of a call in flight: a late reply of an ended screen is recognised as such
    even when its slot already runs the next one (`screen` is compared by identity)."""

    kind: CallKind
    slot: "Slot"
    screen: "Active | None" = None


@dataclass(eq=False)
class Slot:
    """One worker and what the dispatcher knows of it."""

    name: str
    worker: Any  # the pool's handle
    env: dict = field(default_factory=dict)  # its description: host, pid, gpu, node_id, gpu_uuid, ...
    gpu_type: str | None = None  # its node's accelerator type, e.g. "H200"
    resources: dict[str, float] = field(default_factory=dict)  # its node's custom resources (totals)
    machine_id: int | None = None
    active: "Active | None" = None
    next: "Active | None" = None  # claimed while `active` runs its last episodes; its load queued behind them
    placing_since: float | None = None  # set while the pool has not placed it yet
    # Episode and load calls sent to the worker and not back, oldest first, whatever became of their
    # screen (one that failed leaves its look-ahead episode on the worker, ahead of the next screen's
    # load), and time.monotonic() the worker began the oldest of them: the episode timeout's clock.
    owed: list[dict] = field(default_factory=list)
    since: float | None = None

    @property
    def node(self) -> str:
        """Node id: distinct for two nodes on one host (hostnames are not)."""
        return self.env.get("node_id", "")

    @property
    def ready(self) -> bool:
        return self.placing_since is None

    def screens(self) -> list["Active"]:
        return [a for a in (self.active, self.next) if a is not None]

    def describe(self) -> dict:
        """As `packbench status` lists it (Store.heartbeat)."""
        return {"name": self.name, "node": self.node, "host": self.env.get("host", ""),
                "gpu": self.env.get("gpu") or "cpu", "gpu_index": gpu_index(self.env),
                "state": "busy" if self.active else "idle",
                **({"screen_id": self.active.run.screen.id} if self.active else {})}


@dataclass(eq=False)  # identity: `in`, `remove` and the calls' ownership checks compare objects, not fields
class Active:
    """A screen running on a slot (`run` is its service.screen.ScreenRun)."""

    slot: Slot
    run: Any
    protocol: Protocol
    entries: list[dict] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    submitted: int = 0  # episodes handed to the worker
    inflight: int = 0  # calls not back yet (load included)
    stop: Stop | None = None  # no more episodes are submitted
    start: dict | None = None  # a `next` screen's load result, kept until it becomes the slot's active
    looked_ahead: bool = False  # its slot tried to claim its next screen (once: an empty queue is not polled)
    host_shared: bool = False  # said once: another dispatcher's or cluster's worker was busy on its host
    host_busy: bool = False  # said once: other processes kept its host's cores busy during an episode
    ended: bool = False  # its outcome is taken (an ending deferred over an outage never runs twice)

    @property
    def handed_out(self) -> bool:
        """Every planned episode is with the worker (the slot may claim its next screen)."""
        return bool(self.entries) and self.submitted >= len(self.entries)


class Moment(enum.Enum):
    """What an observer of the dispatcher hears about an attempt (bench/cluster.py times them)."""

    CLAIMED = "claimed"  # the attempt was claimed; `seconds`: the claim's own duration
    LOADED = "loaded"  # its model's load came back to the driver
    FIRST_OUT = "first-out"  # its first episodes were handed to the worker
    RECORDED = "recorded"  # an episode came back (`at`) and was recorded (`seconds`: archive + row)


@dataclass(frozen=True)
class ScreenEvent:
    moment: Moment
    run: Any  # the attempt's service.screen.ScreenRun
    at: float  # time.perf_counter()
    seconds: float = 0.0


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


@dataclass(eq=False)
class State:
    """Everything a dispatcher changes while it runs, in one place. `Dispatcher` owns it; the
    parts (claims.py, lifecycle.py, upkeep.py, fleet.py, outage.py) are handed it and hold
    nothing else that changes."""

    slots: list[Slot] = field(default_factory=list)  # one per worker
    outcomes: list[Any] = field(default_factory=list)  # ScreenOutcome of every screen ended, in order
    refusals: list[str] = field(default_factory=list)  # workers refused (their GPU taken) or dead before ready
    started: int = 0  # workers ever started (their names count up)
    dead_on_arrival: int = 0  # workers that died before ever being ready
    outage: Outage | None = None  # the database is down and `follow` waits for it
    waited: list[dict] = field(default_factory=list)  # each outage waited out: seconds, probes, rows reconciled
    deferred: list[Callable[[], None]] = field(default_factory=list)  # database writes that wait for it
    next_upkeep: float = 0.0  # time.monotonic() of the next upkeep
    no_reap_until: float = 0.0  # after an outage: time.monotonic() before which no lease is reaped
    id: int | None = None  # this dispatcher's row
    stopping: str | None = None  # SIGINT | SIGTERM | database | archive, or set by a caller to stop
    fatal: str | None = None  # why the dispatcher had to stop (the database stayed down, the archive disk)
    held: list[str] = field(default_factory=list)  # with nothing queued: screens silent dispatchers hold
    done: bool = False

    def ready(self) -> list[Slot]:
        return [s for s in self.slots if s.ready]

    def screens(self) -> list[Active]:
        """Every screen a worker holds: the one it runs and the one claimed behind it."""
        return [a for s in self.slots for a in s.screens()]


def now() -> float:
    return time.perf_counter()


def gpu_index(env: dict) -> int:
    return int((env.get("gpu_index") or "-1").split(",")[0])
