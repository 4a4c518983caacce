"""The GPU worker actor: a thin Ray shell around engine.worker.Worker."""

from __future__ import annotations

import os
import time

import ray

from packbench.core.settings import Settings


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None elsewhere."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class RayWorker:
    """engine.worker.Worker plus where Ray placed it (the engine knows nothing of Ray).

    The engine is imported inside the actor, never by the driver: a dispatcher does not need
    torch, and importing it there cost seconds before the first worker was even asked for
    (docs/experiments/queue.md "Where the wall goes").
    """

    def __init__(self, env: dict[str, str] | None = None, *, threads: int | None = None, pin: bool = False) -> None:
        age, entered = _process_age_s(), time.time()
        # Set before torch is imported (OMP threads, the CUDA allocator's config): as arguments,
        # not a Ray runtime_env, which made Ray start the process through its runtime-env agent
        # (about 0.5 s more per worker on a 2-core machine, `bench/startup_probe.py`).
        os.environ.update(env or {})
        from packbench.engine.worker import Worker

        imported = time.time()
        self.worker = Worker(threads=threads, pin=pin)
        # Where a worker's start goes (the archive's environment keeps it): Ray's process start
        # to this constructor, the engine's import (torch), the engine's own start (CUDA, NVML).
        self.startup = {"process_s": age, "import_s": imported - entered,
                        "init_s": time.time() - imported}

    def describe(self) -> dict:
        env = self.worker.describe()
        env["node_id"] = ray.get_runtime_context().get_node_id()
        env["gpu_uuid"] = self.worker.gpu_uuid or ""
        env["startup"] = self.startup
        return env

    def load(self, *args, **kwargs) -> dict:
        return self.worker.load(*args, **kwargs)

    def run(self, *args, **kwargs) -> dict:
        return self.worker.run(*args, **kwargs)

    def drop_model(self) -> None:
        self.worker.drop_model()


# max_task_retries=0: retried calls ran out of submission order (3 of 3 runs, Ray 2.60); a failed
# attempt is recorded and a new attempt is the dispatcher's decision, never Ray's.
GpuWorker = ray.remote(num_gpus=1, max_restarts=0, max_task_retries=0)(RayWorker)


def start_worker(settings: Settings, *, workers_on_host: int = 1, **options):
    """One worker actor with its share of the host's cores for its gathers (OMP follows num_cpus
    otherwise): two workers of all the cores each oversubscribe the host (a CUDA worker also
    divides the cores by the GPUs NVML sees, engine/worker.py).

    `options` go to `.options()` (e.g. a name or a scheduling strategy).
    """
    env = settings.worker_env(threads=max(1, (os.cpu_count() or 1) // max(1, workers_on_host)))
    return GpuWorker.options(num_cpus=1, **options).remote(env, threads=settings.worker_threads,
                                                            pin=settings.worker_pin)
