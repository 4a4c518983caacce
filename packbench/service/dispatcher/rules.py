"""The dispatcher's pure decisions: which episode hung, who holds a screen silently, why a queued
screen cannot be placed, when to probe a database that is down, whether its signing key is revoked. Values in, values out; tested in milliseconds.
"""

from __future__ import annotations

import json
from typing import Callable, Iterator

from packbench.core.protocol import resources_fit
from packbench.service.dispatcher.state import Slot

UPKEEP_MAX_S = 2.0  # longest pause between lease renewals (and so before a cancel is seen)
SILENT_AFTER_S = 5 * UPKEEP_MAX_S  # a dispatcher heartbeats at least every UPKEEP_MAX_S

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


def overdue(slots: list[Slot], *, now: float, limit_s: float, load_limit_s: float) -> list[tuple[Slot, dict]]:
    """Each worker that has waited for a reply longer than its limit (a hung episode or load), with
    what it owes: the oldest call not back (`Slot.owed`: an episode's plan entry, `limit_s`, or
    `{"load": True, "screen": id}`, `load_limit_s`), of a screen still running or not. The clock
    runs only while a call is owed (an idle worker is not hung)."""
    return [(s, s.owed[0]) for s in slots if s.owed and s.since is not None
            and now - s.since > (load_limit_s if s.owed[0].get("load") else limit_s)]


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
        here = d.host == host and d.pid is not None
        lives = here and alive(d.pid)
        if here and not lives:
            why = f"its process (pid {d.pid} on this host) is gone"
        elif silent_s > SILENT_AFTER_S:
            why = f"no heartbeat for {silent_s:.0f} s"
        else:
            continue
        if lives:
            # Its process lives on this host, so no dispatcher here reaps its lease (db/queue.py
            # reap_expired: it renews once it can, as after a database outage). Before, this line
            # promised that a `dispatch` after the lease would run the screen again, which never
            # happened while the holder hung (seen with a SIGSTOPped `dispatch`).
            out.append(f"screen {r.screen_id} is held by dispatcher {d.name} ({why}), whose process (pid "
                       f"{d.pid}) still runs on this host: no dispatcher here takes attempt {r.attempt} from it while "
                       f"it lives; if it hangs, stop it (`kill {d.pid}`) and a `packbench dispatch` then marks the "
                       f"attempt lost and runs the screen again")
            continue
        left = max(0.0, (r.lease_expires_at - status.now).total_seconds())
        out.append(f"screen {r.screen_id} is held by dispatcher {d.name} ({why}): attempt {r.attempt}'s lease "
                   f"expires at {r.lease_expires_at.isoformat(timespec='seconds')} (in {left:.0f} s); a "
                   f"`packbench dispatch` after that marks the attempt lost and runs the screen again")
    return out


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


def revoked_key_refusal(key_id: str, path: object, signers: list) -> str | None:
    """Why the dispatcher must not sign with the key `key_id` of file `path` (one line naming the
    file, the key, when it was revoked and the fix), or None: `packbench keys revoke` revoked it
    in this database (the key was lost, or is no longer trusted), so what it signs proves nothing."""
    row = next((s for s in signers if s.key_id == key_id and s.revoked_at is not None), None)
    if row is None:
        return None
    return (f"the signing key {path} (key id {key_id}) was revoked at {row.revoked_at:%Y-%m-%d %H:%M} UTC; create a "
            f"new one with `packbench keys init --key NEW.pem` and pass --signing-key NEW.pem")
