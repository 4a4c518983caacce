"""The worst legal archive: audit time and peak memory of archives at the reader's bounds.

Usage:  python -m bench.worst_archive --case bytes|members|json [--out PATH]

Cases (docs/experiments/storage-audit.md, "Worst legal archive"), each a sealed, consistent synthetic screen
(bench.audit.write_synthetic_screen) that audits as AGREE, so every check runs:

- bytes:   members at the total bound: 4 episodes whose float32 logits are 159 MiB each
           (continuation 825 x vocabulary 50272), ~640 MiB in all (the bound is 640 MiB);
- combined: the members case with logits filling the rest of the total bound (12,602
           episodes of (2, 6000) float32 logits, ~577 MiB, + ~47 MiB of JSON);
- members: many small episodes: 2 conditions x (1 warmup + 6,300 prompts) = 12,602
           episodes, ~38,000 members, JSON just under its 48 MiB total bound, and the runtime
           bootstraps near their bound (10,000 resamples x 6,300 pairs x 2 gate phases);
- json:    the largest episode records: continuation 8192 (the schema's bound) x 32 layers,
           ~10 MiB of JSON ledger per record, 4 episodes (40 MiB of the 48 MiB bound).

The audit runs in a fresh process; its wall time and peak RSS (ru_maxrss) are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "bytes": dict(proto=dict(prompts_n=1, repetitions=1, prefix=8, continuation=825), vocab=50272),
    "members": dict(proto=dict(prompts_n=6_300, repetitions=1, prefix=2, continuation=2), vocab=8, resamples=10_000),
    "combined": dict(proto=dict(prompts_n=6_300, repetitions=1, prefix=2, continuation=2), vocab=6000,
                     resamples=10_000),
    "json": dict(proto=dict(prompts_n=1, repetitions=1, prefix=8, continuation=8192), vocab=8),
}


def build(case: str, out: Path) -> None:
    from bench.audit import synthetic_protocol, write_synthetic_screen

    spec = CASES[case]
    raw = synthetic_protocol(**spec["proto"])
    if "resamples" in spec:
        raw["gates"]["runtime"] = [{"control": "dense-stream", "max_ratio": 0.8, "phase": ph,
                                    "resamples": spec["resamples"]} for ph in ("all", "decode")]
    real_fsync = os.fsync
    os.fsync = lambda fd: None  # building only: durability is not what is measured
    try:
        write_synthetic_screen(out, raw, vocab=spec["vocab"])
    finally:
        os.fsync = real_fsync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or Path(f"/tmp/packbench-worst-{args.case}.zip")
    if not out.exists():
        t = time.perf_counter()
        build(args.case, out)
        print(f"built {out} ({out.stat().st_size:,} B) in {time.perf_counter() - t:.1f} s")
    code = ("import json, sys, time; from packbench.core.audit import audit_archive; t = time.perf_counter(); "
            "r = audit_archive(sys.argv[1]); "
            "print(json.dumps({'s': time.perf_counter() - t, 'result': r.record['result'], "
            "'episodes': r.record['episodes'], 'problems': r.problems[:3]}))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        print(done.stderr)
        raise SystemExit(1)
    res = json.loads(done.stdout)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"case {args.case}: {out.stat().st_size:,} B, {res['episodes']} episodes, {res['result']}; "
          f"audit {res['s']:.1f} s ({wall:.1f} s with interpreter start), peak RSS {peak / 2**20:.0f} MiB "
          f"{res['problems']}")


if __name__ == "__main__":
    main()
