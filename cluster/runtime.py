"""Starting or joining Ray, with the traps of shared/ray.md defused."""

import os

from core.errors import PackbenchError


def gpu_count() -> int:
    """Physical GPUs NVML sees on this host (0 on a CPU-only machine)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def ensure_ray(address: str | None = None):
    """Start an embedded local Ray, or join `address`. Idempotent within a process.

    A machine without a GPU declares one logical GPU, so the `num_gpus=1` worker actor is placed
    and its engine runs on the CPU.
    """
    # Token auth is on by default in 2.60; the embedded cluster is private to this process.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Tasks with num_gpus=0 would otherwise see every GPU.
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")
    import ray

    if ray.is_initialized():
        return ray
    try:
        if address:
            ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        else:
            # "local" never silently joins a cluster started by `ray start` on this machine.
            ray.init("local", num_cpus=os.cpu_count() or 1, num_gpus=max(1, gpu_count()),
                     include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                     object_store_memory=256 * 2**20)
    except ConnectionError as e:
        raise PackbenchError(f"cannot reach a Ray cluster at {address!r} ({e}); start it with `ray start --head` or drop --address") from None
    return ray
