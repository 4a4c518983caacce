"""The values a pool of GPU workers hands back to the dispatcher.

The dispatcher (service/dispatcher/) drives a `WorkerPool` (service/dispatcher/pool.py) that
`cluster/pool.py` implements on Ray; both sides build and read these, so they live below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class NodeInfo:
    """A node of the pool: its accelerator type (e.g. "H200") and the custom resources it
    declares (totals), which a screen's `placement.resources` is matched against."""

    accelerator: str | None = None
    resources: dict[str, float] | None = None


@dataclass(eq=False)
class Reply:
    """A call that came back with the `tag` it was sent with: its value, or the exception it raised.

    `died`: the worker itself is gone (its process, or its node); otherwise an `error` is the
    call's own failure and the worker lives on."""

    tag: Any
    value: Any = None
    error: BaseException | None = None
    died: bool = False


def in_worker_order(calls: list, ready: set, *, worker_of: Callable[[Any], Any]) -> list:
    """The calls of `ready` that may be handed over now, in the order `calls` went out: a call
    waits while an earlier call to the same worker is not back (a worker runs its calls in
    order, so the dispatcher records its episodes in plan order, whatever order the runtime
    reports them in)."""
    waiting, out = set(), []
    for call in calls:
        worker = worker_of(call)
        if call in ready and worker not in waiting:
            out.append(call)
        else:
            waiting.add(worker)
    return out
