"""The scheduler's state, as small types: workers (`Slot`), the screens they run (`Active`),
calls in flight (`Call`), and what an observer hears (`ScreenEvent`). Plus the pure decisions
beside them (silent dispatchers, unplaceable screens). A database outage waited out is
service/scheduler_outage.py's (`Outage`).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from packbench.core.errors import PackbenchError
from packbench.core.protocol import Protocol, resources_fit

LOOKAHEAD = 2  # episodes submitted to a worker at once: one running, one waiting
UPKEEP_MAX_S = 2.0  # longest pause between lease renewals (and so before a cancel is seen)
SILENT_AFTER_S = 5 * UPKEEP_MAX_S  # a dispatcher heartbeats at least every UPKEEP_MAX_S


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
    """One worker and what the scheduler knows of it."""

    name: str
    worker: Any  # the pool's handle
    env: dict = field(default_factory=dict)  # its description: host, pid, gpu, node_id, gpu_uuid, ...
    gpu_type: str | None = None  # its node's accelerator type, e.g. "H200"
    resources: dict[str, float] = field(default_factory=dict)  # its node's custom resources (totals)
    machine_id: int | None = None
    active: "Active | None" = None
    next: "Active | None" = None  # claimed while `active` runs its last episodes; its load queued behind them
    placing_since: float | None = None  # set while the pool has not placed it yet

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
    """What an observer of the scheduler hears about an attempt (bench/cluster.py times them)."""

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


def now() -> float:
    return time.perf_counter()


def held_by_silent(status, *, host: str, alive: Callable[[int], bool]) -> list[str]:
    """One line per running screen whose dispatcher is gone (its pid on this host is not a
    process) or silent (no heartbeat for SILENT_AFTER_S): which screen, and when its lease
    expires and a dispatcher started then requeues it. `status` is a db QueueStatus."""
    by_name = {d.name: d for d in status.dispatchers}
    out = []
    for r in status.running:
        d = by_name.get(r.dispatcher)
        if d is None or r.lease_expires_at is None:
            continue
        silent_s = (status.now - d.heartbeat_at).total_seconds()
        if d.host == host and d.pid is not None and not alive(d.pid):
            why = f"its process (pid {d.pid} on this host) is gone"
        elif silent_s > SILENT_AFTER_S:
            why = f"no heartbeat for {silent_s:.0f} s"
        else:
            continue
        left = max(0.0, (r.lease_expires_at - status.now).total_seconds())
        out.append(f"screen {r.screen_id} is held by dispatcher {d.name} ({why}): attempt {r.attempt}'s lease "
                   f"expires at {r.lease_expires_at.isoformat(timespec='seconds')} (in {left:.0f} s); a "
                   f"`packbench dispatch` after that marks the attempt lost and runs the screen again")
    return out


def archive_dir(path: Path) -> None:
    """Create the archive directory, or say in one line why it cannot be (nothing is claimed)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PackbenchError(f"cannot create the archive directory {path} ({e.strerror or type(e).__name__}); "
                             f"give --archive-dir (PACKBENCH_ARCHIVE_DIR) a writable directory") from None


def unplaceable_reason(screen, ready: list[Slot], *, replica_nodes: Callable[[str], list]) -> str | None:
    """Why no ready worker of the pool can ever take the queued `screen` (a db QueuedScreen),
    or None; `replica_nodes(group)`: the nodes its replica group has run on."""
    types = {s.gpu_type for s in ready if s.gpu_type}
    nodes = {s.node for s in ready}
    needs = screen.needs
    if screen.gpu_type and screen.gpu_type not in types:
        return f"needs GPU type {screen.gpu_type}; this cluster's workers have {', '.join(sorted(types)) or 'none'}"
    if screen.placement_node and screen.placement_node not in nodes:
        return f"needs node {screen.placement_node}, which has no worker"
    if needs and not any(resources_fit(needs, s.resources) for s in ready):
        have = sorted({f"{k}: {v:g}" for s in ready for k, v in s.resources.items()})
        return (f"needs Ray resources {show(needs)} on one node; no node with a worker declares them "
                f"(declared: {', '.join(have) or 'none'}); start a node with `ray start --resources "
                f"'{json.dumps(needs)}'` or change the protocol's placement.resources")
    if screen.replica_group and len(replica_nodes(screen.replica_group)) >= len(nodes):
        return f"its replicas need distinct nodes; the cluster has {len(nodes)} with workers"
    return None


def show(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def gpu_index(env: dict) -> int:
    return int((env.get("gpu_index") or "-1").split(",")[0])
