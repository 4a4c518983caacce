"""Device memory and energy sampled by NVML while an episode runs, from a separate process.

The allocator's own peak misses what the allocator does not see (the CUDA context, cuBLAS
workspaces, lazily loaded kernels); the sampled value is what NVML reports the worker process
as using on the device. Where NVML cannot see the process (some containers), it falls back to
the whole device's used memory, which also counts the driver's reservation, and says so in
`scope`. It also lists every other process NVML shows computing on the device during the
episode (`other_processes`: [pid, most bytes seen]; None where NVML does not show this process,
so its pids cannot be told apart), so a shared GPU is on the record.

Why a process and not a thread: a sampler thread in the worker competes with the episode's own
Python for the interpreter lock; on the H200 a 2 ms thread slowed packet decode by about 7 ms
per token (docs/benchmarks.md). The sampler process shares nothing with the episode but the
device, and reports its own cost per sample so the overhead stays visible.
"""

import multiprocessing as mp
import os
import time

import numpy as np


def device_uuid(device_index: int) -> str | None:
    """NVML's UUID of torch's CUDA device `device_index` (NVML ignores CUDA_VISIBLE_DEVICES,
    which Ray sets), or None where NVML is unavailable."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return uuid
    except Exception:
        return None


def nvml_handle(uuid: str | None):
    if uuid is None:
        return None
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetHandleByUUID(uuid)


def process_used_bytes(handle, pid: int | None = None, others: dict[int, int] | None = None) -> tuple[int, str]:
    """(bytes, scope): process `pid`'s device memory per NVML, else the device's used memory.
    Every other compute process NVML lists on the device goes into `others` (pid -> the most
    device memory seen), when given: a screen must not share its GPU silently (issue 13). Only
    when NVML lists `pid` itself (scope "process"): otherwise its pids are not this process's
    namespace, and any of them could be this very process."""
    import pynvml

    pid = os.getpid() if pid is None else pid
    mine, seen = None, {}
    try:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid:
                mine = None if p.usedGpuMemory is None else int(p.usedGpuMemory)
            else:
                seen[p.pid] = max(seen.get(p.pid, 0), int(p.usedGpuMemory or 0))
    except pynvml.NVMLError:
        pass
    if mine is None:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), "device"
    if others is not None:
        for other, used in seen.items():
            others[other] = max(others.get(other, 0), used)
    return mine, "process"


def _energy_mj(handle) -> int | None:
    import pynvml

    try:
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:  # not every device offers the counter
        return None


def _serve(conn, uuid: str, pid: int, period_s: float) -> None:
    """The sampler process: on "start", sample until "stop", then send the episode's summary."""
    handle = nvml_handle(uuid)
    while True:
        try:
            if conn.recv() != "start":
                return
        except EOFError:  # the worker went away: nothing left to sample for
            return
        t_start = time.perf_counter()
        energy0 = _energy_mj(handle)
        trace, cost, scope, others, visible = [], 0.0, None, {}, True
        while True:
            t0 = time.perf_counter()
            used, scope = process_used_bytes(handle, pid, others)
            visible = visible and scope == "process"
            cost += time.perf_counter() - t0
            trace.append((t0 - t_start, used))
            if conn.poll(period_s):
                conn.recv()  # "stop"
                break
        used, scope = process_used_bytes(handle, pid, others)  # the state at stop counts too
        trace.append((time.perf_counter() - t_start, used))
        energy1 = _energy_mj(handle)
        conn.send({"peak_sampled_bytes": max(b for _, b in trace), "samples": len(trace), "period_s": period_s,
                   "sampler_overhead_s": cost, "scope": scope,
                   "energy_j": None if energy0 is None or energy1 is None else (energy1 - energy0) / 1e3,
                   # None: NVML did not show this process, so who else was there cannot be told
                   "other_processes": [[p, b] for p, b in sorted(others.items())] if visible else None,
                   "trace": np.array(trace, dtype=np.float64).reshape(-1, 2)})


NO_SAMPLES = {"peak_sampled_bytes": None, "samples": 0, "period_s": None, "sampler_overhead_s": 0.0,
              "scope": None, "energy_j": None, "other_processes": None}


class MemorySampler:
    """Samples this process's device memory every `period_s` (<= 5 ms) between start() and
    stop(), from a helper process started once. Without NVML (the CPU) it records nothing."""

    def __init__(self, uuid: str | None, *, period_s: float = 0.005) -> None:
        self.uuid, self.period_s = uuid, period_s
        self._conn = self._proc = None
        self._running = False
        if uuid is not None:
            parent, child = mp.get_context("spawn").Pipe()
            self._proc = mp.get_context("spawn").Process(
                target=_serve, args=(child, uuid, os.getpid(), period_s), name="packbench-nvml", daemon=True)
            self._proc.start()
            self._conn = parent

    def start(self) -> None:
        if self._conn is not None:
            self._conn.send("start")
            self._running = True

    def stop(self) -> dict:
        """The summary since start(); an empty one if nothing was sampled (or never started)."""
        if self._conn is None or not self._running:
            return {**NO_SAMPLES, "trace": np.zeros((0, 2))}
        self._running = False
        self._conn.send("stop")
        return self._conn.recv()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.send("exit")
            self._proc.join(timeout=5)
            self._conn = None
