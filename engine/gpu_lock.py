"""One worker per physical GPU on a host, whoever started it.

Two embedded Ray clusters on one host do not know about each other: both placed their worker
on GPU 0 and ran there at once (measured on nvidia-h200-x2; issue 13). A benchmark must never
be contaminated silently, so a worker takes an exclusive lock on its GPU's UUID for its life:
a lock file under /tmp/packbench-gpu-locks held with flock(LOCK_EX | LOCK_NB), released by
the kernel when the process ends, even by SIGKILL. A second worker on that GPU learns who holds it.

A worker on another GPU of the host, or on its CPU, still shares the host's cores and memory:
two workers of separate clusters on one two-GPU host slowed each other's host gathers by 30-50 %
(docs/benchmarks.md, "Queue on two GPUs"). So every worker, whatever its device, also marks the
host (`HostPresence`), and each episode records which other packbench workers were alive there.
"""

from __future__ import annotations

import fcntl
import os
import uuid as uuidlib
from pathlib import Path

DEFAULT_LOCK_DIR = Path("/tmp/packbench-gpu-locks")  # one per host: every user's workers see it


class GpuLock:
    """An exclusive, process-lifetime lock on one GPU (by NVML UUID)."""

    def __init__(self, uuid: str, *, directory: Path = DEFAULT_LOCK_DIR) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if directory == DEFAULT_LOCK_DIR and directory.stat().st_uid == os.getuid():
            directory.chmod(0o1777)  # shared by every user's workers on the host, like /tmp
        self.path = directory / f"{uuid}.lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        self.held = False
        self.holder = ""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            self.fd = -1
            return
        self.held = True
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)

    def busy_message(self, uuid: str) -> str:
        return (f"GPU {uuid} is already used by another packbench worker ({self.holder}); one worker per GPU: "
                f"join that cluster with --address, or wait until it ends")

    def release(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.held = False


class HostPresence:
    """This worker's mark on the host, and the other packbench workers alive on it.

    Each worker holds `worker-<pid>-<tag>.lock` in the lock directory with flock(LOCK_EX) for its
    life and writes its device in it; the kernel drops the lock when the process ends, however
    it ends. `others()` lists every other file whose lock is still held: those workers are alive
    (the tag tells apart workers of one process, as tests make them). Files left by dead workers
    are removed by the next worker to start, under the directory's own lock, so none is removed
    between another worker's creating and locking it.
    """

    def __init__(self, device: str, *, directory: Path | None = None) -> None:
        self.fd = -1
        self.directory = directory or DEFAULT_LOCK_DIR  # read now: tests point it elsewhere
        self.path = self.directory / f"worker-{os.getpid()}-{uuidlib.uuid4().hex[:8]}.lock"
        self.error: str | None = None  # why this host's workers cannot be told (a directory not ours)
        try:
            self._mark(device)
        except OSError as e:
            self.release()
            self.error = f"{type(e).__name__}: {e}"

    def _mark(self, device: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.directory == DEFAULT_LOCK_DIR and self.directory.stat().st_uid == os.getuid():
            self.directory.chmod(0o1777)
        with _directory_lock(self.directory):
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: nobody else holds it
            os.pwrite(self.fd, device.encode(), 0)
            for path, fd in _marks(self.directory, skip=self.path):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
                finally:
                    os.close(fd)
                try:
                    path.unlink(missing_ok=True)  # its worker is gone
                except OSError:
                    pass  # another user's, in a sticky directory: theirs to sweep

    def others(self) -> list[list] | None:
        """[pid, device] of every other packbench worker alive on this host, by pid; None where
        the lock directory could not be used (then nobody's presence can be told)."""
        if self.error is not None:
            return None
        alive = []
        for path, fd in _marks(self.directory, skip=self.path):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: a dead worker's
            except BlockingIOError:
                pid = path.name.split("-")[1]
                device = os.pread(fd, 200, 0).decode(errors="replace").strip() or "?"
                alive.append([int(pid), device] if pid.isdigit() else [-1, device])
            except OSError:
                continue  # not a lock file one can read: nobody's mark
            finally:
                os.close(fd)
        return sorted(alive)

    def release(self) -> None:
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)  # drops the lock
            self.fd = -1

    def __del__(self) -> None:  # a Worker dropped inside a process that goes on (tests, the CLI)
        self.release()


def _marks(directory: Path, *, skip: Path):
    """(path, read-only fd) of each worker mark in `directory` but `skip` (files that vanish or
    cannot be opened are skipped)."""
    for path in sorted(directory.glob("worker-*.lock")):
        if path == skip:
            continue
        try:
            yield path, os.open(path, os.O_RDONLY)
        except OSError:
            continue


class _directory_lock:
    """flock on the directory's own `workers.lock` while marks are created and swept."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "workers.lock"

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)  # flock needs no write access
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def host_gpus() -> int:
    """GPUs NVML sees on this host, whatever CUDA_VISIBLE_DEVICES says (0 without NVML or GPUs)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def host_gpu_index(uuid: str) -> int | None:
    """NVML's index of the GPU `uuid` on this host (None without NVML or if it is not here)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    except Exception:
        return None
