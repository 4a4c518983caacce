"""The GPU worker actor: a thin Ray shell around engine.worker.Worker."""

import os

import ray

from engine.worker import Worker

# max_task_retries=0: retried calls ran out of submission order (shared/ray.md); a failed
# attempt is recorded and a new attempt is the dispatcher's decision, never Ray's.
GpuWorker = ray.remote(num_gpus=1, max_restarts=0, max_task_retries=0)(Worker)


# Near an allowance, a fragmented allocator fails where a compact one fits: on the H200 an
# opt-2.7b fp16 screen at 4800 MiB lost 15 of 66 episodes to OOM with the default allocator and
# none with expandable segments (docs/benchmarks.md).
ALLOC_CONF = "expandable_segments:True"


def start_worker():
    """One worker actor with the host's cores for its gathers (OMP follows num_cpus otherwise)."""
    env = {"OMP_NUM_THREADS": str(os.cpu_count() or 1),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)}
    return GpuWorker.options(num_cpus=1, runtime_env={"env_vars": env}).remote()
