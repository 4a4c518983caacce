"""The GPU worker actor: a thin Ray shell around engine.worker.Worker."""

from __future__ import annotations

import os

import ray

from core.settings import Settings
from engine.worker import Worker


class RayWorker(Worker):
    """engine.worker.Worker plus where Ray placed it (the engine knows nothing of Ray)."""

    def describe(self) -> dict:
        env = super().describe()
        env["node_id"] = ray.get_runtime_context().get_node_id()
        env["gpu_uuid"] = self.gpu_uuid or ""
        return env


# max_task_retries=0: retried calls ran out of submission order (shared/ray.md); a failed
# attempt is recorded and a new attempt is the dispatcher's decision, never Ray's.
GpuWorker = ray.remote(num_gpus=1, max_restarts=0, max_task_retries=0)(RayWorker)


def start_worker(settings: Settings, *, workers_on_host: int = 1, **options):
    """One worker actor with its share of the host's cores for its gathers (OMP follows num_cpus
    otherwise): two workers of all the cores each oversubscribe the host (a CUDA worker also
    divides the cores by the GPUs NVML sees, engine/worker.py).

    `options` go to `.options()` (e.g. a name or a scheduling strategy).
    """
    env = settings.worker_env(threads=max(1, (os.cpu_count() or 1) // max(1, workers_on_host)))
    return GpuWorker.options(num_cpus=1, runtime_env={"env_vars": env}, **options).remote()
