"""engine/sampler.py without a GPU: NVML replaced by a fake module, the sampler's loop run in a
thread of this process (the worker runs it in a process of its own)."""

import multiprocessing as mp
import os
import sys
import threading
import types

import pytest

from packbench.engine import sampler


class FakeNVML(types.ModuleType):
    """The few pynvml calls the sampler makes: a device with this process and `others` on it."""

    class NVMLError(Exception):
        pass

    def __init__(self, others: dict[int, int], mine: int | None = 300 << 20) -> None:
        super().__init__("pynvml")
        self.others, self.mine, self.calls = others, mine, 0

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self.calls += 1
        procs = [types.SimpleNamespace(pid=pid, usedGpuMemory=used + self.calls) for pid, used in self.others.items()]
        if self.mine is not None:
            procs.append(types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.mine))
        return procs

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=8 << 30)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return 1000 * self.calls


@pytest.fixture
def nvml(monkeypatch):
    fake = FakeNVML({4242: 512 << 20, 77: 0})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_other_processes_on_the_device_are_collected(nvml):
    others: dict[int, int] = {}
    assert sampler.process_used_bytes("GPU-x", os.getpid(), others) == (300 << 20, "process")
    sampler.process_used_bytes("GPU-x", os.getpid(), others)
    assert others == {4242: (512 << 20) + 2, 77: 2}  # the most each held over the samples
    nvml.mine = None  # NVML does not list this process (some containers): the device's memory,
    before = dict(others)  # and no claim about the others (any of them could be this process)
    assert sampler.process_used_bytes("GPU-x", os.getpid(), others) == (8 << 30, "device")
    assert others == before


def test_the_sampling_loop_reports_the_other_processes_of_an_episode(nvml):
    parent, child = mp.Pipe()
    loop = threading.Thread(target=sampler._serve, args=(child, "GPU-x", os.getpid(), 0.001), daemon=True)
    loop.start()
    parent.send("start")
    parent.send("stop")
    summary = parent.recv()
    assert summary["scope"] == "process" and summary["samples"] >= 2
    assert summary["peak_sampled_bytes"] == 300 << 20 and summary["trace"].shape == (summary["samples"], 2)
    assert [pid for pid, _ in summary["other_processes"]] == [77, 4242]
    assert dict(summary["other_processes"])[4242] >= 512 << 20
    nvml.others = {}  # the next episode has the GPU to itself
    parent.send("start")
    parent.send("stop")
    assert parent.recv()["other_processes"] == []
    nvml.mine, nvml.others = None, {4242: 1}  # this process out of NVML's sight: unknown, not "none"
    parent.send("start")
    parent.send("stop")
    summary = parent.recv()
    assert summary["scope"] == "device" and summary["other_processes"] is None
    parent.send("exit")
    loop.join(timeout=5)
    assert not loop.is_alive()


def test_without_nvml_nothing_is_sampled_and_no_sharing_is_claimed():
    s = sampler.MemorySampler(None)
    s.start()
    summary = s.stop()
    assert summary["samples"] == 0 and summary["other_processes"] is None
