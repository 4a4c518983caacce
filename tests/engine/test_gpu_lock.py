"""One worker per physical GPU on a host: the lock is exclusive across processes and dies with them."""

import subprocess
import sys
import textwrap

from engine.gpu_lock import GpuLock


def test_a_second_holder_is_refused_and_told_who_holds_it(tmp_path):
    first = GpuLock("GPU-test-0", directory=tmp_path)
    assert first.held
    # flock locks belong to the open file description: another process is refused.
    code = textwrap.dedent(f"""
        from pathlib import Path
        from engine.gpu_lock import GpuLock
        lock = GpuLock("GPU-test-0", directory=Path({str(tmp_path)!r}))
        print(lock.held, lock.busy_message("GPU-test-0"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False") and "already used by another packbench worker (pid" in out
    assert GpuLock("GPU-test-1", directory=tmp_path).held  # another GPU is free
    first.release()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("True")


def test_the_lock_dies_with_its_process(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from engine.gpu_lock import GpuLock
        lock = GpuLock("GPU-test-2", directory=Path({str(tmp_path)!r}))
        assert lock.held
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert GpuLock("GPU-test-2", directory=tmp_path).held
