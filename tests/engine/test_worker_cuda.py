"""CUDA twin of test_runtime.py's pinning test: a GPU worker with PACKBENCH_WORKER_PIN=1 pins
itself to its GPU's share of the host's cores (run with `pytest -m gpu` on a GPU machine)."""

import os

import pytest

from engine.gpu_lock import host_gpu_index, host_gpus
from engine.worker import Worker, core_share

pytestmark = pytest.mark.gpu


def test_cuda_worker_pins_itself_to_its_gpus_share_of_the_cores(monkeypatch):
    before = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("PACKBENCH_WORKER_PIN", "1")
    worker = Worker(device="cuda")
    try:
        index = host_gpu_index(worker.gpu_uuid)
        assert index is not None
        assert sorted(os.sched_getaffinity(0)) == core_share(before, index, host_gpus())
    finally:
        os.sched_setaffinity(0, before)
        if worker.gpu_lock:
            worker.gpu_lock.release()
        worker.sampler.close()
