"""A local Ray cluster in a process of its own, for `packbench` subprocesses to join
(`PACKBENCH_RAY_ADDRESS`): tests/conftest.py's session-wide `ray_address`, and a module's own
where its workers must run other code (tests/cli/test_history_commits.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]

# One logical GPU and a small object store, as packbench's embedded Ray declares on a CPU host.
HEAD = """
import os, sys
import ray
ray.init("local", num_cpus=os.cpu_count() or 1, num_gpus=1, object_store_memory=256 * 2**20,
         include_dashboard=False, logging_level="WARNING")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


def clean_environment() -> dict[str, str]:
    """This process's environment without packbench's settings or a Ray address, with this
    checkout first on PYTHONPATH and Ray's token authentication off (the embedded default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PACKBENCH_", "RAY_ADDRESS"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               RAY_AUTH_MODE="disabled")
    return env


@contextmanager
def ray_head(env: dict[str, str]) -> Iterator[str]:
    """A local Ray cluster whose workers start with `env` (their PYTHONPATH: the code they run);
    yields its GCS address, and stops it on the way out."""
    env = {**env, "RAY_prestart_worker_first_driver": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
    head = subprocess.Popen([sys.executable, "-c", HEAD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        address = head.stdout.readline().strip()
        assert address, f"the Ray head did not start (exit {head.poll()})"
        yield address
    finally:
        head.stdin.close()  # the head shuts its cluster down and exits
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
