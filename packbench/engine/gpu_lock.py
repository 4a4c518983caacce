"""One worker per physical GPU on a host, whoever started it.

Two embedded Ray clusters on one host do not know about each other: both placed their worker
on GPU 0 and ran there at once (measured on nvidia-h200-x2; issue 13). A benchmark must never
be contaminated silently, so a worker takes an exclusive lock on its GPU's UUID for its life:
a lock file under /tmp/packbench-gpu-locks held with flock(LOCK_EX | LOCK_NB), released by
the kernel when the process ends, even by SIGKILL. A second worker on that GPU learns who holds it.

A worker on another GPU of the host, or on its CPU, still shares the host's cores and memory:
two workers on one two-GPU host slowed each other's host gathers by 30-50 % (docs/experiments/queue.md,
"Queue on two GPUs"), and one of another cluster was on no record. So every worker, whatever its
device, also marks the host (`HostPresence`), and each episode records which other packbench
workers were busy there meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
import uuid as uuidlib
from pathlib import Path

DEFAULT_LOCK_DIR = Path("/tmp/packbench-gpu-locks")  # one per host: every user's workers see it


class GpuLock:
    """An exclusive, process-lifetime lock on one GPU (by NVML UUID)."""

    def __init__(self, uuid: str, *, directory: Path = DEFAULT_LOCK_DIR) -> None:
        _prepare(directory)
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


MARK_BYTES = 200  # a mark is rewritten whole, at one length: a reader never sees a shorter old tail


class HostPresence:
    """This worker's mark on the host, and the other packbench workers alive or at work on it.

    Each worker holds `worker-<pid>-<tag>.lock` in the lock directory with flock(LOCK_EX) for its
    life; the kernel drops the lock when the process ends, however it ends. The file says the
    worker's state (busy while it loads a model or runs an episode, else idle), when that last
    changed, and its device. `others()` lists every other file whose lock is still held: those
    workers are alive (the tag tells apart workers of one process, as tests make them);
    `others(since=t)` only those that were busy at some moment since t: busy now, or changed
    state since (each change starts or ends busy time). Files left by dead workers are removed by
    the next worker to start, under the directory's own lock, so none is removed between another
    worker's creating and locking it.
    """

    def __init__(self, device: str, *, directory: Path | None = None) -> None:
        self.fd = -1
        self.device = device
        self.directory = directory or DEFAULT_LOCK_DIR  # read now: tests point it elsewhere
        self.path = self.directory / f"worker-{os.getpid()}-{uuidlib.uuid4().hex[:8]}.lock"
        self.error: str | None = None  # why this host's workers cannot be told (a directory not ours)
        try:
            self._mark()
        except OSError as e:
            self.release()
            self.error = f"{type(e).__name__}: {e}"

    def _mark(self) -> None:
        _prepare(self.directory)
        with _directory_lock(self.directory):
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: nobody else holds it
            self.idle()
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

    def busy(self) -> None:
        self._state("busy")

    def idle(self) -> None:
        self._state("idle")

    def _state(self, state: str) -> None:
        if self.fd < 0:
            return
        try:
            os.pwrite(self.fd, f"{state} {time.time():.6f} {self.device}".encode()[:MARK_BYTES].ljust(MARK_BYTES), 0)
        except OSError:
            pass  # a full /tmp must not fail the episode; others read the last state written

    def others(self, *, since: float | None = None) -> list[list] | None:
        """[pid, device] of every other packbench worker alive on this host, by pid; with `since`
        (a time.time()), only those busy at some moment since then. None where the lock directory
        could not be used (then nobody's presence can be told)."""
        if self.error is not None:
            return None
        found = []
        for path, fd in _marks(self.directory, skip=self.path):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: a dead worker's
            except BlockingIOError:
                pid = path.name.split("-")[1]
                state, changed, device = _parse(os.pread(fd, MARK_BYTES, 0))
                if since is None or state != "idle" or changed >= since:
                    found.append([int(pid), device] if pid.isdigit() else [-1, device])
            except OSError:
                continue  # not a lock file one can read: nobody's mark
            finally:
                os.close(fd)
        return sorted(found)

    def release(self) -> None:
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)  # drops the lock
            self.fd = -1

    def __del__(self) -> None:  # a Worker dropped inside a process that goes on (tests, the CLI)
        self.release()


def _parse(raw: bytes) -> tuple[str, float, str]:
    """(state, time of its last change, device) of a mark; one that cannot be read counts as busy
    now (a record then names a worker that may have been idle, never the reverse)."""
    fields = raw.decode(errors="replace").split(maxsplit=2)
    try:
        return fields[0], float(fields[1]), (fields[2].strip() if len(fields) > 2 else "") or "?"
    except (IndexError, ValueError):
        return "busy", float("inf"), "?"


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


@contextmanager
def _directory_lock(directory: Path):
    """flock on the directory's own `workers.lock` while marks are created and swept."""
    fd = os.open(directory / "workers.lock", os.O_RDONLY | os.O_CREAT, 0o666)  # flock needs no write access
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _prepare(directory: Path) -> None:
    """The lock directory, made if missing; the host's default one is shared by every user's
    workers, like /tmp."""
    directory.mkdir(parents=True, exist_ok=True)
    if directory == DEFAULT_LOCK_DIR and directory.stat().st_uid == os.getuid():
        directory.chmod(0o1777)


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


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: a process of another user
        return True
    return True
