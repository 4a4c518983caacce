"""The dispatcher's worker pool on Ray: what service/dispatcher/pool.py `WorkerPool` asks for.

GPU worker actors (cluster/worker.py) on the embedded or joined runtime (cluster/runtime.py);
`ray.wait` brings back whichever call is done first. Ray's retries are off everywhere
(max_restarts=0, max_task_retries=0): ordering comes from the database, never from Ray's
retries (shared/ray.md). The engine is never imported here: the actor imports it itself.
"""

from __future__ import annotations

from typing import Any, Iterator

from packbench.core.pool import NodeInfo, Reply, in_worker_order
from packbench.core.protocol import is_builtin_resource
from packbench.core.settings import Settings


class RayPool:
    """One actor per worker; every call's object ref is kept with its worker and the
    dispatcher's tag until its reply is taken (or the worker is killed)."""

    def __init__(self, settings: Settings, *, worker_class: Any = None) -> None:
        self.settings = settings
        self.worker_class = worker_class  # the simulator passes its own actor class (bench/cluster.py)
        self.ray: Any = None
        self._calls: dict[Any, tuple[Any, Any]] = {}  # object ref -> (actor, tag)

    def connect(self) -> None:
        from packbench.cluster.runtime import ensure_ray

        self.ray = ensure_ray(self.settings)

    def gpus(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("GPU", 0)))

    def start_worker(self, tag: Any, *, pool_size: int) -> Any:
        from packbench.cluster.worker import start_worker

        if self.worker_class is not None:
            actor = self.worker_class.options(num_gpus=1, num_cpus=0).remote()
        else:
            # An embedded cluster is this host: its workers share its cores.
            share = pool_size if self.settings.embedded else 1
            actor = start_worker(self.settings, workers_on_host=share)
        self._calls[actor.describe.remote()] = (actor, tag)
        return actor

    def load(self, worker: Any, tag: Any, protocol, model_dir: str | None, *, model_cache: str | None,
             reuse: bool) -> None:
        self._calls[worker.load.remote(protocol, model_dir, model_cache=model_cache, reuse=reuse)] = (worker, tag)

    def run(self, worker: Any, tag: Any, entry: dict, prompt: list[int] | list[list[int]]) -> None:
        self._calls[worker.run.remote(entry, prompt)] = (worker, tag)

    def in_flight(self) -> int:
        return len(self._calls)

    def wait(self, timeout: float, *, every: bool = False) -> Iterator[Reply]:
        """The replies that are back (all of them with `every`, else at least one), in the
        order their calls went out. A worker runs its calls in order, but `ray.wait` may see a
        later call's result before an earlier one's (a look-ahead episode before the one the
        dispatcher must record first): a call's reply is never handed over before the replies of
        that worker's earlier calls."""
        refs = list(self._calls)
        if not refs:
            return
        if every:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        else:
            ready, rest = self.ray.wait(refs, num_returns=1, timeout=timeout)
            if ready and rest:
                ready += self.ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        ready = set(ready)
        behind = self._earlier_calls(ready)
        if behind:  # done already (the worker got past them): only their results are on the way
            ready.update(self.ray.wait(behind, num_returns=len(behind), timeout=timeout)[0])
        for ref in in_worker_order(refs, ready, worker_of=lambda r: self._calls[r][0]):
            if ref in self._calls:  # a killed worker's other calls were dropped with it
                yield self._take(ref)

    def _earlier_calls(self, ready: set) -> list:
        """The calls not seen back that went to a worker before one of its calls in `ready`."""
        later, behind = set(), []  # workers with a call in `ready` further on
        for ref, (actor, _) in reversed(self._calls.items()):
            if ref in ready:
                later.add(actor)
            elif actor in later:
                behind.append(ref)
        return behind

    def _take(self, ref) -> Reply:
        _, tag = self._calls.pop(ref)
        try:
            return Reply(tag, value=self.ray.get(ref))
        except self.ray.exceptions.RayActorError as e:
            return Reply(tag, error=e, died=True)
        except Exception as e:  # the worker raised (a RayTaskError): the call failed, the worker lives
            return Reply(tag, error=e)

    def kill(self, worker: Any) -> None:
        for ref, (actor, _) in list(self._calls.items()):
            if actor is worker:
                del self._calls[ref]
        try:
            self.ray.kill(worker)
        except Exception:  # already dead
            pass

    def nodes(self) -> dict[str, NodeInfo]:
        """Per Ray node id: its accelerator_type and the custom resources it declares
        (`ray start --resources`), which screens' `placement.resources` are matched against."""
        out = {}
        for node in self.ray.nodes():
            accelerator, custom = None, {}
            for key, amount in node.get("Resources", {}).items():
                if key.startswith("accelerator_type:"):
                    accelerator = key.split(":", 1)[1]
                elif not is_builtin_resource(key):
                    custom[key] = float(amount)
            out[node["NodeID"]] = NodeInfo(accelerator, custom)
        return out
