"""engine/host_load.py: the CPU time other processes took during an episode, from /proc/stat's
busy fields less this process's own time, checked by hand on stated snapshots."""

import io
import os
from types import SimpleNamespace

from packbench.engine import host_load


def test_busy_seconds_are_the_busy_fields_without_idle_or_iowait(monkeypatch):
    """Busy = user, nice, system, irq, softirq, steal (module docstring): idle and iowait are
    not busy. Catches the planted bug "host load: iowait counted as busy"."""
    stat = "cpu  100 20 30 1000 50 5 5 7 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    monkeypatch.setattr(host_load, "open", lambda path, encoding=None: io.StringIO(stat), raising=False)
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 100 if name == "SC_CLK_TCK" else real(name))
    monkeypatch.setattr(os, "times", lambda: SimpleNamespace(user=1.25, system=0.5))
    assert host_load.cpu_snapshot() == ((100 + 20 + 30 + 5 + 5 + 7) / 100, 1.75)


def test_other_cpu_seconds_leave_out_this_processs_own(monkeypatch):
    """other_cpu_s = the host's busy seconds over the episode minus this process's own (never
    below 0). Catches the planted bug "host load: the worker's own CPU counted as others'"."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.75, 0.5, 0.25))
    load = host_load.host_load((10.0, 2.0), (13.0, 4.5))
    assert load == {"other_cpu_s": 0.5, "cores": os.cpu_count(), "loadavg_1m": 0.75}
    assert host_load.host_load((10.0, 2.0), (11.0, 4.0))["other_cpu_s"] == 0.0  # rounding of ticks: not negative
    assert host_load.host_load(None, (11.0, 4.0)) is None
