"""One worker per physical GPU on a host: the lock is exclusive across processes and dies with them."""

import subprocess
import sys
import textwrap

from packbench.engine.gpu_lock import GpuLock


def test_a_second_holder_is_refused_and_told_who_holds_it(tmp_path):
    first = GpuLock("GPU-test-0", directory=tmp_path)
    assert first.held
    # flock locks belong to the open file description: another process is refused.
    code = textwrap.dedent(f"""
        from pathlib import Path
        from packbench.engine.gpu_lock import GpuLock
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
        from packbench.engine.gpu_lock import GpuLock
        lock = GpuLock("GPU-test-2", directory=Path({str(tmp_path)!r}))
        assert lock.held
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert GpuLock("GPU-test-2", directory=tmp_path).held


def _holder(directory, device):
    """A process holding a HostPresence in `directory` until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from packbench.engine.gpu_lock import HostPresence
        mark = HostPresence({device!r}, directory=Path({str(directory)!r}))
        print("ready", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_host_presence_lists_the_live_workers_of_other_processes_and_sweeps_dead_ones(tmp_path):
    """Every worker marks the host, whatever its device: another process's mark is listed while
    it lives, not after a SIGKILL, and the next worker to start removes the dead one's file."""
    from packbench.engine.gpu_lock import HostPresence

    me = HostPresence("cpu", directory=tmp_path)
    assert me.others() == []
    other = _holder(tmp_path, "GPU-other-1")
    try:
        assert me.others() == [[other.pid, "GPU-other-1"]]
    finally:
        other.kill()
        other.wait()
    assert me.others() == []  # the kernel dropped its lock with the process
    assert len(list(tmp_path.glob("worker-*.lock"))) == 2  # its file is left behind ...
    HostPresence("cuda", directory=tmp_path)
    assert not list(tmp_path.glob(f"worker-{other.pid}-*.lock"))  # ... until the next worker starts


def test_workers_of_one_process_see_each_other_until_released(tmp_path):
    import os

    from packbench.engine.gpu_lock import HostPresence

    a, b = HostPresence("cpu", directory=tmp_path), HostPresence("GPU-b", directory=tmp_path)
    assert a.others() == [[os.getpid(), "GPU-b"]] and b.others() == [[os.getpid(), "cpu"]]
    b.release()
    assert a.others() == [] and not b.path.exists()


def test_a_lock_directory_that_cannot_be_used_leaves_the_workers_unknown_not_failed(tmp_path):
    """A path that is not a directory (or one another user made unwritable): the worker still
    starts; who else is on the host is unknown (None), never claimed to be nobody ([])."""
    from packbench.engine.gpu_lock import HostPresence

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    mark = HostPresence("cpu", directory=blocked)
    assert mark.others() is None and mark.error
    mark.release()


def test_others_since_a_moment_are_the_workers_busy_at_some_point_after_it(tmp_path):
    """Busy now, or a change of state since then (each change starts or ends busy time): the
    worker overlapped; idle since before then: it did not."""
    import os
    import time

    from packbench.engine.gpu_lock import HostPresence

    me, other = HostPresence("cpu", directory=tmp_path), HostPresence("GPU-o", directory=tmp_path)
    t0 = time.time()
    assert me.others(since=t0) == [] and me.others() == [[os.getpid(), "GPU-o"]]
    other.busy()
    assert me.others(since=t0) == [[os.getpid(), "GPU-o"]]
    other.idle()
    assert me.others(since=t0) == [[os.getpid(), "GPU-o"]]  # busy for a while after t0
    assert me.others(since=time.time()) == []
    other.busy()
    assert me.others(since=time.time() + 60) == [[os.getpid(), "GPU-o"]]  # busy now: whatever the moment


def test_a_mark_that_cannot_be_read_counts_as_busy(tmp_path):
    """A torn or foreign mark names a worker that may have been idle, never hides a busy one."""
    import fcntl
    import os
    import time

    from packbench.engine.gpu_lock import HostPresence

    me = HostPresence("cpu", directory=tmp_path)
    fd = os.open(tmp_path / "worker-77-feed.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"garbage")
    try:
        assert me.others(since=time.time()) == [[77, "?"]]
    finally:
        os.close(fd)
