"""Settings: every knob packbench reads from the command line or the environment, read once.

The CLI builds one `Settings` from its options (each option names its environment variable,
so `--help` lists them) and passes it down explicitly. Nothing below the CLI reads
`os.environ` for a packbench setting; what a Ray worker needs travels in `worker_env()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import PackbenchError

DEFAULT_PLACEMENT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 15.0
# Near an allowance a fragmented allocator fails where a compact one fits: on the H200 an
# opt-2.7b fp16 screen at 4800 MiB lost 15 of 66 episodes to OOM with the default allocator and
# none with expandable segments (docs/benchmarks.md).
DEFAULT_CUDA_ALLOC_CONF = "expandable_segments:True"
# Set where the dispatcher runs: each GPU worker's host threads (default: its share of the cores).
WORKER_THREADS_ENV = "PACKBENCH_WORKER_THREADS"
# Set where the dispatcher runs, "1": each GPU worker pins itself to its share of the host's
# cores (the share of its GPU's index), so two workers' host gathers never meet on one core.
WORKER_PIN_ENV = "PACKBENCH_WORKER_PIN"


@dataclass(frozen=True)
class Settings:
    """What one packbench command runs with.

    db_url: the results database (None: $PACKBENCH_DB_URL or sqlite:///packbench.db, db/session.py).
    archive_dir: where raw archives are written.
    address: a Ray cluster to join; None starts an embedded local Ray.
    placement_timeout_s: how long a GPU worker may stay unplaced before the screen waits queued.
    connect_timeout_s: how long joining a Ray cluster may take before one line and exit 2.
    model_cache: where workers generate synthetic checkpoints (None: ~/.cache/packbench/models
      on each worker's node); passed to Worker.load explicitly.
    verbose: log events (logging at INFO) and let worker logs reach the driver.
    embedded_gpus: GPUs the embedded Ray declares (None: the host's, at least one logical GPU
      on a CPU-only machine, where the engine runs on the CPU). More than the host has would
      put two workers on one GPU: the dispatcher refuses that (one worker per physical GPU).
    cuda_alloc_conf: PYTORCH_CUDA_ALLOC_CONF for worker processes.
    signing_key: the deployment's Ed25519 private key file (`packbench keys init`); the driver
      signs every sealed archive with it (core.provenance; None: archives are unsigned).
    """

    db_url: str | None = None
    archive_dir: Path = Path("archives")
    address: str | None = None
    placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    model_cache: Path | None = None
    verbose: bool = False
    embedded_gpus: int | None = None
    cuda_alloc_conf: str = DEFAULT_CUDA_ALLOC_CONF
    extra_worker_env: dict[str, str] = field(default_factory=dict)
    signing_key: Path | None = None

    def __post_init__(self) -> None:
        if not self.placement_timeout_s > 0:
            raise ValueError(f"placement timeout {self.placement_timeout_s} s must be > 0")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect timeout {self.connect_timeout_s} s must be > 0")

    @property
    def embedded(self) -> bool:
        """True when no cluster address is given: packbench starts its own private Ray."""
        return not self.address

    def worker_env(self, *, threads: int) -> dict[str, str]:
        """Environment variables of every GPU worker actor (set by the actor before it imports torch).

        $PACKBENCH_WORKER_THREADS, when set where the dispatcher runs, fixes each worker's host
        threads (its gathers' OMP threads) instead of its share of the host's cores;
        $PACKBENCH_WORKER_PIN=1 pins each worker to that share (engine/worker.py core_share)."""
        fixed = os.environ.get(WORKER_THREADS_ENV)
        if fixed is not None and not (fixed.isdigit() and int(fixed) > 0):
            raise PackbenchError(f"{WORKER_THREADS_ENV}={fixed!r} is not a number of threads; set it to a positive "
                                 f"integer or unset it (each worker then takes its share of the host's cores)")
        env = {"OMP_NUM_THREADS": fixed or str(threads), "PYTORCH_CUDA_ALLOC_CONF": self.cuda_alloc_conf}
        if fixed:
            env[WORKER_THREADS_ENV] = fixed
        pin = os.environ.get(WORKER_PIN_ENV)
        if pin is not None:
            if pin not in ("0", "1"):
                raise PackbenchError(f"{WORKER_PIN_ENV}={pin!r} must be 1 (pin each GPU worker to its share of the "
                                     f"host's cores) or 0; or unset it")
            env[WORKER_PIN_ENV] = pin
        return {**env, **self.extra_worker_env}
