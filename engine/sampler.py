"""Device memory and energy sampled by NVML on a thread, while an episode runs.

The allocator's own peak misses what the allocator does not see (the CUDA context, cuBLAS
workspaces, other libraries); the sampled value is what NVML reports this process as using on
the device (context included). Where NVML cannot see the process (some containers), it falls
back to the whole device's used memory, which also counts the driver's reservation, and says
so in `scope`. The sampler measures its own cost per sample so the overhead can be reported.
"""

import os
import threading
import time

import numpy as np


def nvml_handle(device_index: int):
    """The NVML handle of torch's CUDA device `device_index` (matched by UUID: NVML ignores
    CUDA_VISIBLE_DEVICES, which Ray sets), or None where NVML is unavailable."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return None


def process_used_bytes(handle) -> tuple[int, str]:
    """(bytes, scope): this process's device memory per NVML, else the device's used memory."""
    import pynvml

    try:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory), "process"
    except pynvml.NVMLError:
        pass
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), "device"


class MemorySampler:
    """Samples device memory used every `period_s` (<= 5 ms) between start() and stop()."""

    def __init__(self, handle, *, period_s: float = 0.005) -> None:
        self.handle, self.period_s = handle, period_s
        self.peak_bytes: int | None = None
        self.samples = 0
        self.sample_s = 0.0  # total time spent inside NVML calls: the sampler's own overhead
        self.energy_mj: int | None = None
        self.scope: str | None = None
        self.trace: list[tuple[float, int]] = []  # (seconds since start, bytes) per sample
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self) -> int:
        t0 = time.perf_counter()
        used, self.scope = process_used_bytes(self.handle)
        self.sample_s += time.perf_counter() - t0
        self.samples += 1
        self.trace.append((t0 - self._t0, used))
        return used

    def _energy(self) -> int | None:
        import pynvml

        try:
            return pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:  # not every device offers the counter
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes or 0, self._used())
            self._stop.wait(self.period_s)

    def start(self) -> "MemorySampler":
        if self.handle is None:
            return self
        self._energy0 = self._energy()
        self._t0 = time.perf_counter()
        self.peak_bytes = self._used()
        self._thread = threading.Thread(target=self._loop, name="packbench-nvml", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes or 0, self._used())
            end = self._energy()
            if end is not None and self._energy0 is not None:
                self.energy_mj = end - self._energy0
        return {"peak_sampled_bytes": self.peak_bytes, "samples": self.samples, "period_s": self.period_s,
                "sampler_overhead_s": self.sample_s, "scope": self.scope,
                "energy_j": None if self.energy_mj is None else self.energy_mj / 1e3,
                # (samples, 2) float64: seconds since start, bytes used (exact below 2**53)
                "trace": np.array(self.trace, dtype=np.float64).reshape(-1, 2)}
