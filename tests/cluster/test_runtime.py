"""cluster/runtime.py without starting Ray: the raylet's raw lines on the driver become log events;
the driver's imports stay free of torch; the worker settings' environment."""

import logging
import subprocess
import sys

import pytest

ray_worker = pytest.importorskip("ray._private.worker")

from packbench.cluster.runtime import _quiet_raylet_lines  # noqa: E402

DIED = ("\x1b[33m(raylet)\x1b[0m A worker died or was killed while executing a task by an unexpected system "
        "error. Worker PID: 14068 Worker exit type: SYSTEM_ERROR")


def test_raylet_lines_are_logged_not_printed_and_worker_output_still_prints(monkeypatch, capsys, caplog):
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored after
    _quiet_raylet_lines()
    routed = ray_worker.print_to_stdstream
    _quiet_raylet_lines()
    assert ray_worker.print_to_stdstream is routed  # installed once
    with caplog.at_level(logging.INFO, logger="packbench.raylet"):
        # What Ray's error-listener thread calls, by this module-global name, when a worker dies.
        ray_worker.print_to_stdstream({"lines": [DIED], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    [record] = [r for r in caplog.records if r.name == "packbench.raylet"]
    assert record.levelno == logging.INFO  # shown with --verbose; the attempt's error keeps the cause
    assert record.getMessage().startswith("raylet: (raylet) A worker died") and "\x1b" not in record.getMessage()
    assert "Worker PID: 14068" in record.getMessage()
    # A worker's own output (log_to_driver, with --verbose) still goes through Ray's printer.
    ray_worker.print_to_stdstream({"lines": ["hello from a worker"], "pid": 4242, "is_err": False, "ip": "h",
                                   "localhost": "h"}, ignore_prefix=False)
    assert "hello from a worker" in capsys.readouterr().out


def test_the_driver_never_imports_torch():
    """The dispatcher, the CLI and the actor's class are torch-free on the driver: the engine is
    imported inside the actor (importing torch cost the dispatcher seconds before its first claim)."""
    code = ("import sys, packbench.cli.main, packbench.service.dispatcher, packbench.cluster.pool, packbench.cluster.worker, packbench.cluster.reexecute, packbench.cluster.audit; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('packbench.engine.worker')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_worker_threads_can_be_fixed_where_the_dispatcher_runs(monkeypatch):
    from packbench.core.errors import PackbenchError
    from packbench.core.settings import Settings

    monkeypatch.delenv("PACKBENCH_WORKER_THREADS", raising=False)
    assert Settings().worker_env(threads=16)["OMP_NUM_THREADS"] == "16"
    assert Settings.from_environ().worker_threads is None
    monkeypatch.setenv("PACKBENCH_WORKER_THREADS", "4")
    settings = Settings.from_environ()
    assert settings.worker_threads == 4 and settings.worker_env(threads=16)["OMP_NUM_THREADS"] == "4"
    # the count reaches the worker as a constructor argument, not through its environment
    assert "PACKBENCH_WORKER_THREADS" not in settings.worker_env(threads=16)
    for bad in ("0", "four", "-2", ""):
        with pytest.raises(PackbenchError, match="PACKBENCH_WORKER_THREADS=.* is not a number of threads"):
            Settings.from_environ({"PACKBENCH_WORKER_THREADS": bad})


def test_worker_pinning_is_a_share_of_the_cores_and_checked(monkeypatch):
    from packbench.core.errors import PackbenchError
    from packbench.core.settings import Settings
    from packbench.engine.worker import core_share

    assert core_share(list(range(32)), 0, 2) == list(range(16))
    assert core_share(list(range(32)), 1, 2) == list(range(16, 32))
    assert core_share([0, 2, 4, 6, 8], 2, 3) == [6, 8]  # uneven: every core in one slice
    assert sum((core_share(list(range(7)), i, 3) for i in range(3)), []) == list(range(7))
    assert core_share([5], 1, 2) == [5]  # fewer cores than GPUs: shared, never empty
    with pytest.raises(ValueError, match="GPU index 2 is not one of 2"):
        core_share(list(range(8)), 2, 2)
    monkeypatch.delenv("PACKBENCH_WORKER_PIN", raising=False)
    assert Settings.from_environ().worker_pin is False
    monkeypatch.setenv("PACKBENCH_WORKER_PIN", "1")
    assert Settings.from_environ().worker_pin is True
    assert "PACKBENCH_WORKER_PIN" not in Settings.from_environ().worker_env(threads=8)  # an argument instead
    monkeypatch.setenv("PACKBENCH_WORKER_PIN", "yes")
    with pytest.raises(PackbenchError, match="PACKBENCH_WORKER_PIN='yes' must be 1"):
        Settings.from_environ()
