"""Starting or joining Ray, with its traps defused: token authentication on by default
(`RAY_AUTH_MODE` is set explicitly), a plain `ray.init()` silently joining a local `ray start`
cluster (the embedded default is `ray.init("local", ...)`), tasks with `num_gpus=0` seeing every
GPU (`RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1`), and an address where nothing answers retried for
minutes (checked first, in one line)."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Callable

from packbench.core import signals
from packbench.core.errors import ClusterUnreachable, PackbenchError
from packbench.core.settings import Settings
from packbench.engine.gpu_lock import host_gpus  # torch-free: NVML only

log = logging.getLogger(__name__)


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail in one line, fast, for an address nobody could join (before Ray retries for minutes)."""
    if address.startswith("ray://"):
        try:
            import ray.util.client  # noqa: F401
            import grpc  # noqa: F401  (the client extra)
        except ImportError:
            raise ClusterUnreachable(f"--address {address}: ray:// needs Ray's client extra (`pip install 'ray[client]'`); "
                                 f"or give the GCS address host:6379 of the head node") from None
        hostport = address[len("ray://"):]
    elif address == "auto":
        return  # Ray finds a local cluster itself, or says there is none
    else:
        hostport = address
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterUnreachable(f"--address {address!r} is not host:port; give the head node's GCS address, e.g. 10.0.0.1:6379")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except socket.gaierror:
        raise ClusterUnreachable(f"--address {address}: unknown host {host!r}; check the head node's name") from None
    except OSError as e:
        raise ClusterUnreachable(f"--address {address}: nothing answers there ({e.strerror or e}); start the head with "
                             f"`ray start --head` or fix the address") from None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
raylet_log = logging.getLogger("packbench.raylet")


def _route_driver_message(original: Callable[..., None], data: dict[str, Any], ignore_prefix: bool) -> None:
    """Ray's driver-side printer, with the raylet's messages sent to logging instead.

    Ray prints every error the raylet publishes for this job ("A worker died or was killed
    ...") to the driver's stdout as a raw, colour-coded `(raylet)` line, whatever
    `log_to_driver` says; it lands in the middle of progress bars and `--json` lines. The
    dispatcher already records why a worker died (the attempt's error, `screens show`), so
    the line becomes an INFO event of `packbench.raylet`: shown with --verbose, without colour
    codes. Worker output (log_to_driver, on with --verbose) still goes through Ray's printer.
    """
    if data.get("pid") != "raylet":
        original(data, ignore_prefix=ignore_prefix)
        return
    for line in data.get("lines") or []:
        text = _ANSI.sub("", str(line)).strip()
        if text:
            raylet_log.info("raylet: %s", text)


def _quiet_raylet_lines() -> None:
    """Install `_route_driver_message` in front of Ray's driver printer (idempotent).

    Ray 2.60 has no public switch for these lines: its error-listener thread calls
    `ray._private.worker.print_to_stdstream` by its module-global name on every message, so
    replacing that name reroutes them, already-started threads included. Should a Ray
    release move the name, nothing is replaced and the lines print as before.
    """
    try:
        import ray._private.worker as ray_worker
    except ImportError:  # a Ray without the module: leave its printing alone
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "packbench_routed", False):
        return

    def print_to_stdstream(data: dict[str, Any], ignore_prefix: bool) -> None:
        _route_driver_message(original, data, ignore_prefix)

    print_to_stdstream.packbench_routed = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


@contextmanager
def _fd2_held(*, replay: bool):
    """File descriptor 2 sent to a temporary file while Ray's C++ client tries the head: a
    service that is not Ray's GCS but answers (another gRPC server, an HTTP/2 proxy) gets one
    `gcs_client.cc: Failed to get cluster ID from GCS server` warning a second, written straight
    to fd 2, ahead of the one-line refusal. Restored on leaving, the held text written out with
    `replay` (--verbose). A join that goes on failing in the background may still write to
    fd 2 after this; the CLI exits at once after its line (cli/main.py)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 to hold (a closed stderr): nothing to keep quiet
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if replay:
                sink.seek(0)
                held = sink.read()
                if held:
                    sys.stderr.write(held.decode("utf-8", "backslashreplace"))
                    sys.stderr.flush()


def ensure_ray(settings: Settings | None = None):
    """Start an embedded local Ray, or join `settings.address`. Idempotent within a process.

    A machine without a GPU declares one logical GPU, so the `num_gpus=1` worker actor is placed
    and its engine runs on the CPU. Joining a cluster is bounded by `connect_timeout_s`.
    """
    settings = settings or Settings()
    if settings.embedded:
        # Token auth is on by default in 2.60; the embedded cluster is private to this process.
        # A joined cluster's auth mode is the user's to set (RAY_AUTH_MODE=token on shared clusters).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Ray prestarts one idle Python worker per CPU when the first driver connects; packbench
        # starts one GPU actor per GPU, and 32 idle workers starting at once slowed the
        # dispatcher's own start (ray.init 6.5 -> 4.1 s on the H200 host, bench/startup_probe.py).
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # Tasks with num_gpus=0 would otherwise see every GPU.
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")
    import ray

    _quiet_raylet_lines()
    if ray.is_initialized():
        return ray
    common = dict(include_dashboard=False, logging_level="INFO" if settings.verbose else "WARNING",
                  log_to_driver=settings.verbose)
    if settings.embedded:
        # "local" never silently joins a cluster started by `ray start` on this machine.
        gpus = settings.embedded_gpus or max(1, host_gpus())
        ray.init("local", num_cpus=os.cpu_count() or 1, num_gpus=gpus,
                 object_store_memory=256 * 2**20, **common)
        signals.install()  # over Ray's own SIGTERM handlers (core/signals.py)
        return ray
    address = settings.address
    _check_reachable(address, settings.connect_timeout_s)
    done = threading.Event()
    failure: list[BaseException] = []

    def join() -> None:
        try:
            # Ray warns that a driver joined from another thread sets no SIGTERM handler: the
            # dispatcher sets its own (service/dispatcher/loop.py), so the warning is only noise.
            loggers = [logging.getLogger(name) for name in ("ray", "ray._private.worker")]
            levels = [lg.level for lg in loggers]
            for lg in loggers:
                lg.setLevel(logging.ERROR)
            try:
                ray.init(address=address, **common)
            finally:
                for lg, level in zip(loggers, levels):
                    lg.setLevel(level)
        except BaseException as e:  # handed to the caller's thread below
            failure.append(e)
        finally:
            done.set()

    # Another service on the port, or a head that never answers: Ray would retry for minutes.
    with _fd2_held(replay=settings.verbose):
        threading.Thread(target=join, daemon=True, name="ray-join").start()
        answered = done.wait(settings.connect_timeout_s)
    if not answered:
        raise ClusterUnreachable(f"--address {address}: no Ray cluster answered within {settings.connect_timeout_s:.0f} s "
                             f"(another service on that port?); check `ray status` on the head node or raise "
                             f"`packbench --connect-timeout S` (an option before the command)")
    if failure:
        e = failure[0]
        raise ClusterUnreachable(f"cannot join the Ray cluster at {address!r} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                             f"start it with `ray start --head` or drop --address") from None
    log.info("joined Ray cluster at %s", address)
    signals.install()
    return ray
