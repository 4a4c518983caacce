"""CUDA twins: a GPU worker with pin=True (PACKBENCH_WORKER_PIN=1) pins itself to its GPU's share of the
host's cores (test_runtime.py); a GPU worker marks the host with its GPU's UUID, and its episodes
list the other workers busy there (test_worker.py). Run with `pytest -m gpu` on a GPU machine."""

import os

import pytest

from packbench.engine.gpu_lock import host_gpu_index, host_gpus
from packbench.engine.worker import Worker, core_share

pytestmark = pytest.mark.gpu


def test_cuda_worker_pins_itself_to_its_gpus_share_of_the_cores(monkeypatch):
    before = sorted(os.sched_getaffinity(0))
    worker = Worker(device="cuda", pin=True)
    try:
        index = host_gpu_index(worker.gpu_uuid)
        assert index is not None
        assert sorted(os.sched_getaffinity(0)) == core_share(before, index, host_gpus())
    finally:
        os.sched_setaffinity(0, before)
        if worker.gpu_lock:
            worker.gpu_lock.release()
        worker.sampler.close()


def test_cuda_worker_marks_the_host_with_its_gpu_and_records_its_busy_neighbours(tiny, tmp_path, monkeypatch):
    import packbench.engine.gpu_lock
    from packbench.core.plan import plan, prompts
    from packbench.engine.gpu_lock import HostPresence
    from tests.engine.test_worker import body

    monkeypatch.setattr(packbench.engine.gpu_lock, "DEFAULT_LOCK_DIR", tmp_path)
    worker = Worker(device="cuda")
    try:
        watcher = HostPresence("cpu", directory=tmp_path)
        assert watcher.others() == [[os.getpid(), worker.gpu_uuid]] and worker.gpu_uuid.startswith("GPU-")
        watcher.busy()
        b = body(tiny, allowance_mib=4096)  # room for the CUDA context, which the allowance charges
        start = worker.load(b, str(tiny))
        entry = plan(b)[0]
        record = worker.run(entry, prompts(b, vocab=start["vocab"])[entry["prompt"]])
        assert record["status"] == "ok" and record["host_workers"] == [[os.getpid(), "cpu"]]
    finally:
        if worker.gpu_lock:
            worker.gpu_lock.release()
        worker.sampler.close()
