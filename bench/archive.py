"""Archive append speed: per-member cost of ArchiveWriter at 10,000 members, sealing, verifying.

Usage:  python -m bench.archive [--members 10000] [--size 4096] [--dir DIR] [--old-rev c623fec]

Appends `--members` array members of exactly `--size` bytes each (.npy header included, STORED,
like logits/), each fsynced as the screen driver's are, and prints the median and p90 time per
member over the first 500, the 1,501st-2,000th and the last 1,000 members and over all of them;
then the time to seal (manifest of every member, SHA-256 of the file) and to verify the sealed
archive.

On a shared box fsync latency moves from second to second, so each append is paired with the
disk's floor measured at the same moment: a bare pwrite + fsync of the same size appended to a
plain file right after it. The same appends are then timed with fsync switched off, which is
the writer's own cost (framing, CRC, SHA-256, the writes) and shows whether it grows with the
member count. "append minus its paired floor" is each append's time less the bare fsync that
followed it: what the writer adds to what the disk costs at that moment.

`--old-rev REV` also times the writer of `git show REV:core/archive.py` (which re-parsed the
zip for every member) for 2,000 members. Targets (issue 9): median <= 1 ms per member at
10,000 members of 4 KiB; sealing 10,000 members <= 2 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from packbench.core.archive import ArchiveReader, ArchiveWriter, logits_member

NPY_HEADER = 128  # np.save's v1 header for a 1-D float32 array of this size


def _quantiles(times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    return f"median {statistics.median(ms):6.3f} ms  p90 {ms[int(0.9 * (len(ms) - 1))]:6.3f} ms  max {ms[-1]:7.3f} ms"


def time_appends(writer, members: int, size: int, *, floor: Path | None = None) -> tuple[list[float], list[float]]:
    """Seconds per add_array of a `size`-byte member (header included), in order; with `floor`,
    each followed by a bare pwrite + fsync of `size` bytes appended to that plain file."""
    arr = np.arange((size - NPY_HEADER) // 4, dtype=np.float32)
    block = bytes(size)
    times, floors = [], []
    fd = os.open(floor, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644) if floor else None
    try:
        for i in range(members):
            t = time.perf_counter()
            writer.add_array(logits_member(i), arr)
            times.append(time.perf_counter() - t)
            if fd is not None:
                t = time.perf_counter()
                os.pwrite(fd, block, i * size)
                os.fsync(fd)
                floors.append(time.perf_counter() - t)
    finally:
        if fd is not None:
            os.close(fd)
            floor.unlink()
    return times, floors


class _NoFsync:
    """Switch os.fsync off for the writer's-own-cost pass."""

    def __enter__(self):
        self.real, os.fsync = os.fsync, lambda fd: None

    def __exit__(self, *exc):
        os.fsync = self.real


def old_writer(rev: str) -> type:
    """ArchiveWriter as it was at `rev` (for the before/after table)."""
    source = subprocess.run(["git", "show", f"{rev}:core/archive.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    module = types.ModuleType(f"archive_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up while decorating
    exec(compile(source, f"{rev}:core/archive.py", "exec"), module.__dict__)
    return module.ArchiveWriter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=4096, help="bytes per member, .npy header included")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--old-rev", default=None, help="also time the writer of this git revision (2,000 members)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        print(f"{args.members:,} members of {args.size} B, each fsynced; {tmp} on "
              f"{platform.node() and platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
        path = tmp / "bench.zip"
        w = ArchiveWriter(path)
        times, floor = time_appends(w, args.members, args.size, floor=tmp / "floor.bin")
        t = time.perf_counter()
        w.seal({"bench": True})
        seal_s = time.perf_counter() - t
        t = time.perf_counter()
        with ArchiveReader(path) as r:
            problems = r.verify()
        verify_s = time.perf_counter() - t
        assert problems == [], problems[:3]
        with _NoFsync():
            no_sync, _ = time_appends(ArchiveWriter(tmp / "nosync.zip"), args.members, args.size)
        n = args.members
        windows = [("1-500", slice(0, 500))] + ([("1,501-2,000", slice(1500, 2000))] if n >= 2000 else [])
        windows += [(f"last 1,000 (to {n:,})", slice(-1000, None)), (f"all {n:,}", slice(None))]
        overhead = [a - b for a, b in zip(times, floor)]
        for title, series in (("appends, each fsynced", times), ("disk floor at the same moments", floor),
                              ("append minus its paired floor", overhead), ("appends without fsync", no_sync)):
            print(title)
            for label, sl in windows:
                print(f"  {label:>22}  {_quantiles(series[sl])}")
        print(f"seal {seal_s:.3f} s ({path.stat().st_size:,} B archive); verify {verify_s:.3f} s")
        if args.old_rev:
            old = old_writer(args.old_rev)
            times, floor = time_appends(old(tmp / "old.zip"), min(n, 2000), args.size, floor=tmp / "floor.bin")
            for title, series in ((f"writer of {args.old_rev}, each fsynced", times),
                                  ("disk floor at the same moments", floor)):
                print(title)
                for label, sl in windows[:-2]:
                    print(f"  {label:>22}  {_quantiles(series[sl])}")

if __name__ == "__main__":
    main()
