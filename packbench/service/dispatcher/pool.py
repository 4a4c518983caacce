"""What the dispatcher needs of a pool of GPU workers, and nothing more.

`cluster/pool.py` implements it on Ray (`RayPool`); tests drive the dispatcher with an in-process
fake (tests/service/fake_pool.py). The dispatcher never learns what the transport is: a worker
is an opaque handle, a call is sent with a `tag` the dispatcher chose, and what comes back is a
`Reply` carrying that tag (core/pool.py: the values both sides share).
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

from packbench.core.pool import NodeInfo, Reply
from packbench.core.protocol import Protocol as ScreenProtocol

__all__ = ["NodeInfo", "Reply", "WorkerPool"]


class WorkerPool(Protocol):
    """GPU workers that load a screen's model and run its episodes, one call after another
    per worker (calls to one worker run in the order they were sent)."""

    def connect(self) -> None:
        """Start or join the runtime the workers live in (seconds: only when there is work)."""

    def gpus(self) -> int:
        """GPUs of the pool's cluster (at least 1): the default number of workers."""

    def start_worker(self, tag: Any, *, pool_size: int) -> Any:
        """Start one worker (of `pool_size` that the dispatcher intends to run); returns its
        handle. Its environment (host, pid, gpu, node_id, ...) comes back as a reply to `tag`."""

    def load(self, worker: Any, tag: Any, protocol: ScreenProtocol, model_dir: str | None, *,
             model_cache: str | None, reuse: bool) -> None:
        """Send a screen's model load to `worker`; its start record comes back as a reply to `tag`."""

    def run(self, worker: Any, tag: Any, entry: dict, prompt: list[int] | list[list[int]]) -> None:
        """Send one planned episode to `worker`; its record comes back as a reply to `tag`."""

    def in_flight(self) -> int:
        """Calls sent whose replies have not been taken."""

    def wait(self, timeout: float, *, every: bool = False) -> Iterator[Reply]:
        """Replies back within `timeout` seconds: as soon as one is (with every other one back
        by then), or with `every`, as many as are back when all are or the time is up. Each
        reply is taken as it is iterated, so a call of a worker killed meanwhile never comes."""

    def kill(self, worker: Any) -> None:
        """Stop `worker` (already dead is fine); its calls in flight are dropped, never replied."""

    def nodes(self) -> dict[str, NodeInfo]:
        """Per node id: what a screen's placement is matched against."""
