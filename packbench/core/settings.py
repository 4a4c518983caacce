"""Settings: every knob packbench reads from the command line or the environment, read once.

`ENVIRONMENT` is the one table of packbench's environment variables: the CLI gives each to its
option (`envvar=`, so `--help` lists it), and `Settings.from_environ` reads them for a caller
without the CLI (an alembic run, a benchmark script). Below the CLI nothing reads `os.environ`
for a packbench setting: values travel as arguments, and what a Ray worker needs goes to its
actor's constructor (`worker_env()` for what must be set before torch is imported, the rest as
arguments).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packbench.core.errors import PackbenchError

DEFAULT_PLACEMENT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 15.0
# An episode with no reply for this long is taken as hung (a deadlocked CUDA call, a stuck host
# copy, a plugin that never returns): its worker is killed and replaced. The slowest episodes
# measured take well under a minute (accelerate's offload of OPT-13B: 817 ms a decode token,
# docs/benchmarks.md); a compile-mode episode's first compilation takes minutes. Half an hour
# stops a hung screen without ever cutting a slow one short.
DEFAULT_EPISODE_TIMEOUT_S = 1800.0
# A screen's model load with no reply for this long is taken as hung (a read from a file system that
# stopped answering, a conversion stuck in a library). Loads take longer than episodes and vary more:
# OPT-13B drawn on 16 threads took 34-68 s, converted for FlexGen about a minute more; a real
# checkpoint of hundreds of GB read from a slow disk takes many minutes. An hour cuts none of them.
DEFAULT_LOAD_TIMEOUT_S = 3600.0
# The longest wait a timeout or lease may ask for, on the command line or in the environment: a
# `timedelta` holds ~2.7e11 days; a day of seconds times ten thousand is far past any real lease
# or timeout and far inside every clock type.
MAX_SECONDS = 86_400 * 10_000
DEFAULT_DB_URL = "sqlite:///packbench.db"
# Near an allowance a fragmented allocator fails where a compact one fits: on the H200 an
# opt-2.7b fp16 screen at 4800 MiB lost 15 of 66 episodes to OOM with the default allocator and
# none with expandable segments (docs/benchmarks.md).
DEFAULT_CUDA_ALLOC_CONF = "expandable_segments:True"

DB_URL_ENV = "PACKBENCH_DB_URL"
RAY_ADDRESS_ENV = "PACKBENCH_RAY_ADDRESS"
ARCHIVE_DIR_ENV = "PACKBENCH_ARCHIVE_DIR"
# Set where the dispatcher runs: each GPU worker's host threads (default: its share of the cores).
WORKER_THREADS_ENV = "PACKBENCH_WORKER_THREADS"
# Set where the dispatcher runs, "1": each GPU worker pins itself to its share of the host's
# cores (the share of its GPU's index), so two workers' host gathers never meet on one core.
WORKER_PIN_ENV = "PACKBENCH_WORKER_PIN"

# variable -> (option, what it sets); README.md "Settings" prints this table (a test keeps them equal).
ENVIRONMENT: dict[str, tuple[str, str]] = {
    DB_URL_ENV: ("--db", f"the results database URL (default {DEFAULT_DB_URL})"),
    RAY_ADDRESS_ENV: ("--address", "the Ray cluster submit --wait and dispatch join (default: an embedded Ray)"),
    ARCHIVE_DIR_ENV: ("--archive-dir", "where raw archives are written (default archives)"),
    "PACKBENCH_PLACEMENT_TIMEOUT_S": ("--placement-timeout", "seconds a GPU worker may stay unplaced (300)"),
    "PACKBENCH_CONNECT_TIMEOUT_S": ("--connect-timeout", "seconds joining a Ray cluster may take (15)"),
    "PACKBENCH_EPISODE_TIMEOUT_S": ("--episode-timeout", "seconds an episode may run before its worker is taken "
                                                         "as hung, killed and replaced (1800)"),
    "PACKBENCH_LOAD_TIMEOUT_S": ("--load-timeout", "seconds a screen's model load may take before its worker is "
                                                   "taken as hung, killed and replaced (3600)"),
    "PACKBENCH_EMBEDDED_GPUS": ("--embedded-gpus", "GPUs the embedded Ray declares (default: the host's)"),
    "PACKBENCH_MODEL_CACHE": ("--model-cache", "where workers generate synthetic checkpoints"),
    "PACKBENCH_SIGNING_KEY": ("--signing-key", "the Ed25519 private key that signs sealed archives"),
    WORKER_THREADS_ENV: ("--worker-threads", "host threads of each worker: a GPU worker's gathers, a CPU "
                                             "worker's arithmetic (default: its share of the cores)"),
    WORKER_PIN_ENV: ("--worker-pin", "1: pin each GPU worker to its GPU's share of the host's cores"),
    "PACKBENCH_VERBOSE": ("--verbose", "log events and let worker logs reach the terminal"),
    "PACKBENCH_DEBUG": ("--debug", "print an error's traceback before its one-line message"),
}


def _yes(text: str | None) -> bool:
    """A boolean variable as click reads one: 1, true, yes, on (any case)."""
    return (text or "").strip().lower() in ("1", "true", "yes", "on", "t", "y")


def environ_db_url(environ: Mapping[str, str] | None = None) -> str:
    """The database URL a caller without --db uses: $PACKBENCH_DB_URL, else the SQLite default."""
    return (os.environ if environ is None else environ).get(DB_URL_ENV) or DEFAULT_DB_URL


def _given(variable: str, option: str | None, text: str) -> tuple[str, str]:
    """(the value as a message names it, how to drop it): the command line's option when `option`
    is given (it was typed there), else the environment variable."""
    if option is not None:
        return f"{option} {text!r}", f"leave {option} out"
    return f"{variable}={text!r}", "unset it"


def worker_threads(text: str | None, option: str | None = None) -> int | None:
    """$PACKBENCH_WORKER_THREADS / --worker-threads (`option`, when given on the command line) as
    a count (None: unset)."""
    if text is None:
        return None
    if not (text.isdigit() and int(text) > 0):
        value, drop = _given(WORKER_THREADS_ENV, option, text)
        raise PackbenchError(f"{value} is not a number of threads; make it a positive integer or {drop} (each worker "
                             f"then takes its share of the host's cores)")
    return int(text)


def worker_pin(text: str | None, option: str | None = None) -> bool:
    """$PACKBENCH_WORKER_PIN / --worker-pin (`option`, when given on the command line): "1" pins,
    "0" or unset does not."""
    if text is not None and text not in ("0", "1"):
        value, drop = _given(WORKER_PIN_ENV, option, text)
        raise PackbenchError(f"{value} must be 1 (pin each GPU worker to its share of the host's cores) or 0; "
                             f"or {drop}")
    return text == "1"


@dataclass(frozen=True)
class Settings:
    """What one packbench command runs with.

    db_url: the results database (None: $PACKBENCH_DB_URL or sqlite:///packbench.db, db/session.py).
    archive_dir: where raw archives are written.
    address: a Ray cluster to join; None starts an embedded local Ray.
    placement_timeout_s: how long a GPU worker may stay unplaced before the screen waits queued.
    connect_timeout_s: how long joining a Ray cluster may take before one line and exit 2.
    episode_timeout_s: how long a dispatcher waits for an episode's reply before its worker is
      taken as hung: the attempt fails (a timed-out cause), the worker is killed and replaced.
    load_timeout_s: the same for a screen's model load.
    model_cache: where workers generate synthetic checkpoints (None: ~/.cache/packbench/models
      on each worker's node); passed to Worker.load explicitly.
    verbose: log events (logging at INFO) and let worker logs reach the driver.
    embedded_gpus: GPUs the embedded Ray declares (None: the host's, at least one logical GPU
      on a CPU-only machine, where the engine runs on the CPU). More than the host has would
      put two workers on one GPU: the dispatcher refuses that (one worker per physical GPU).
    cuda_alloc_conf: PYTORCH_CUDA_ALLOC_CONF for worker processes.
    signing_key: the deployment's Ed25519 private key file (`packbench keys init`); the driver
      signs every sealed archive with it (core.provenance; None: archives are unsigned).
    worker_threads: each GPU worker's host threads (None: its share of the host's cores).
    worker_pin: each GPU worker pins itself to its GPU's share of the host's cores.
    debug: on an error, print its traceback before the one-line message.
    """

    db_url: str | None = None
    archive_dir: Path = Path("archives")
    address: str | None = None
    placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    episode_timeout_s: float = DEFAULT_EPISODE_TIMEOUT_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    model_cache: Path | None = None
    verbose: bool = False
    embedded_gpus: int | None = None
    cuda_alloc_conf: str = DEFAULT_CUDA_ALLOC_CONF
    extra_worker_env: dict[str, str] = field(default_factory=dict)
    signing_key: Path | None = None
    worker_threads: int | None = None
    worker_pin: bool = False
    debug: bool = False

    def __post_init__(self) -> None:
        for what, value in (("placement", self.placement_timeout_s), ("connect", self.connect_timeout_s),
                            ("episode", self.episode_timeout_s), ("load", self.load_timeout_s)):
            if not 0 < value <= MAX_SECONDS:  # nan fails too
                raise ValueError(f"{what} timeout {value} s must be a finite number > 0, at most {MAX_SECONDS}")
        if self.worker_threads is not None and not self.worker_threads > 0:
            raise ValueError(f"worker threads {self.worker_threads} must be > 0")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings `environ` (default: this process's environment) sets, for a caller without
        the CLI; the CLI reads the same variables through its options (ENVIRONMENT)."""
        env = os.environ if environ is None else environ

        def path(name: str) -> Path | None:
            return Path(env[name]).expanduser() if env.get(name) else None

        def number(name: str, default: float) -> float:
            try:
                value = float(env.get(name) or default)
            except ValueError:
                value = float("nan")
            if not 0 < value <= MAX_SECONDS:  # nan fails too
                raise PackbenchError(f"{name}={env[name]!r} is not a number of seconds in (0, {MAX_SECONDS}]; set it "
                                     f"to one or unset it")
            return value

        gpus = env.get("PACKBENCH_EMBEDDED_GPUS")
        if gpus and not (gpus.isdigit() and int(gpus) > 0):
            raise PackbenchError(f"PACKBENCH_EMBEDDED_GPUS={gpus!r} is not a number of GPUs; set it to a positive "
                                 f"integer or unset it")
        return cls(db_url=environ_db_url(env), archive_dir=path(ARCHIVE_DIR_ENV) or Path("archives"),
                   address=env.get(RAY_ADDRESS_ENV) or None,
                   placement_timeout_s=number("PACKBENCH_PLACEMENT_TIMEOUT_S", DEFAULT_PLACEMENT_TIMEOUT_S),
                   connect_timeout_s=number("PACKBENCH_CONNECT_TIMEOUT_S", DEFAULT_CONNECT_TIMEOUT_S),
                   episode_timeout_s=number("PACKBENCH_EPISODE_TIMEOUT_S", DEFAULT_EPISODE_TIMEOUT_S),
                   load_timeout_s=number("PACKBENCH_LOAD_TIMEOUT_S", DEFAULT_LOAD_TIMEOUT_S),
                   model_cache=path("PACKBENCH_MODEL_CACHE"), signing_key=path("PACKBENCH_SIGNING_KEY"),
                   embedded_gpus=int(gpus) if gpus else None, verbose=_yes(env.get("PACKBENCH_VERBOSE")),
                   debug=_yes(env.get("PACKBENCH_DEBUG")),
                   worker_threads=worker_threads(env.get(WORKER_THREADS_ENV)),
                   worker_pin=worker_pin(env.get(WORKER_PIN_ENV)))

    @property
    def embedded(self) -> bool:
        """True when no cluster address is given: packbench starts its own private Ray."""
        return not self.address

    def worker_env(self, *, threads: int) -> dict[str, str]:
        """Environment variables of every GPU worker actor, set by the actor before it imports
        torch: its gathers' OMP threads (`worker_threads`, else `threads`, its share of the
        host's cores) and the CUDA allocator's config. `worker_threads` and `worker_pin` also
        reach the worker as constructor arguments (cluster/worker.py start_worker)."""
        env = {"OMP_NUM_THREADS": str(self.worker_threads or threads), "PYTORCH_CUDA_ALLOC_CONF": self.cuda_alloc_conf}
        return {**env, **self.extra_worker_env}
