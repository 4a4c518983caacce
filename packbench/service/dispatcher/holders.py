"""Whether a dispatcher that holds screens still runs on this host: a lease is judged by its
holder's process where the process can be seen (upkeep.py reaps a dead holder's leases at
once and never a live one's; service/reconcile.py reads a dead holder's archives). Reads
/proc only; torch-free.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

HOLDER_CLOCK_SLACK_S = 60.0


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (engine/gpu_lock.py's, torch-free: /proc only)."""
    from packbench.engine.gpu_lock import process_alive as alive

    return alive(pid)


def holder_alive(pid: int, started_at: datetime) -> bool:
    """Whether the dispatcher that registered as `pid` at `started_at` still runs on this host:
    the process exists and had started by then (a pid the system gave to a later process is
    not the dispatcher). Where the start time cannot be read, the process counts as alive."""
    if not process_alive(pid):
        return False
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return True
    began = boot + ticks / os.sysconf("SC_CLK_TCK")
    # A minute of slack: btime is whole seconds and moves when the wall clock is stepped, and a
    # live holder judged dead loses its work, while a pid given again within a minute of the
    # holder's start (and still running) only holds its screens until that process ends.
    return began <= started_at.timestamp() + HOLDER_CLOCK_SLACK_S
