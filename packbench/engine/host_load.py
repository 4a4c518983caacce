"""The host's load during an episode, from /proc: how much CPU time processes other than this
worker took, and the load average. packbench's own record of a shared host (`host_workers`)
sees only other packbench workers; another job on the host (a build, a second user's tests)
shows only here.

`other_cpu_s` = the CPU time every core spent busy (user, nice, system, irq, softirq, steal:
/proc/stat's first line) minus this process's own (os.times), over the episode. Divided by the
episode's wall it is the number of cores other processes kept busy on average (core/dispersion.py
`noisy_host` flags it). It also counts Ray's own daemons and the driver's work meanwhile.
"""

from __future__ import annotations

import os


def cpu_snapshot() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole host, this process's CPU seconds) now; None where the
    host has no /proc/stat (not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            first = f.readline().split()
    except OSError:
        return None
    if len(first) < 5 or first[0] != "cpu":
        return None
    ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def host_load(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict | None:
    """The record's `host_load` between two snapshots: other processes' CPU seconds, the host's
    cores and its 1-minute load average at the end; None when either snapshot is missing."""
    if before is None or after is None:
        return None
    other = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = None
    return {"other_cpu_s": round(other, 3), "cores": os.cpu_count(), "loadavg_1m": load1}
