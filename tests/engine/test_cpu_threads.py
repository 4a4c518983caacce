"""A CPU worker's thread count. Its logits come from host arithmetic, and some CPU kernels split
their sums by thread count: on the 2-core CI machine a tiny Qwen3-MoE's float32 logits at 2
threads differ from those at 1, 3 and 4, while the same run twice at one count is identical
(`python -m bench.cpu_threads`). So a
CPU worker takes the count it is given (`--worker-threads`, or a re-execution's archived count:
service/audit.py, tests/cluster/test_submit_audit.py), and records the count it ran. The same holds
for experts computed on the host by a GPU worker (host-experts), so every re-execution takes the
archive's count."""

import torch

from packbench.engine.worker import Worker
from packbench.service.audit import MAX_THREADS, archived_threads


def test_a_cpu_worker_runs_on_the_threads_it_is_given_and_records_them():
    """Catches a CPU worker that ignores `threads` (it once applied them on CUDA only), so a
    re-execution of a CPU archive ran on whatever count its host had."""
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        worker = Worker(device="cpu", threads=want)
        assert torch.get_num_threads() == want
        assert worker.describe()["threads"] == want
    finally:
        torch.set_num_threads(before)


def test_only_a_count_a_worker_can_take_is_read_from_an_archive():
    """worker.json is archive input: a forged or old environment gives None (the deployment's own
    count), never a value set_num_threads would refuse or a bool taken as 1."""
    assert archived_threads({"threads": 3}) == 3
    assert archived_threads({"threads": 1}) == 1 and archived_threads({"threads": MAX_THREADS}) == MAX_THREADS
    for bad in (0, -2, MAX_THREADS + 1, True, 2.0, "2", None, [2]):
        assert archived_threads({"threads": bad}) is None, bad
    assert archived_threads({}) is None
