"""One worker per physical GPU on a host, whoever started it.

Two embedded Ray clusters on one host do not know about each other: both placed their worker
on GPU 0 and ran there at once (measured on nvidia-h200-x2; issue 13). A benchmark must never
be contaminated silently, so a worker takes an exclusive lock on its GPU's UUID for its life:
a lock file under /tmp/packbench-gpu-locks held with flock(LOCK_EX | LOCK_NB), released by
the kernel when the process ends, even by SIGKILL. A second worker on that GPU learns who holds it.
"""

from __future__ import annotations

import fcntl
import os
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
