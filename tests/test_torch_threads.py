"""Collected after tests/engine/ (whose modules set one torch thread for their own tests): each
module must start with the host's thread count (tests/conftest.py `_torch_threads_per_module`), so a
test's speed and arithmetic do not depend on which modules ran before it in the same process."""

import subprocess
import sys


def test_a_module_starts_with_the_hosts_torch_thread_count():
    """Catches a `torch.set_num_threads(1)` in an earlier module leaking into every later one."""
    import torch

    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert torch.get_num_threads() == int(fresh.stdout.strip())

