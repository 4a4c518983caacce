"""Plan-position check on the CPU: one protocol screened several times through `packbench submit
--wait` (the dispatcher, Ray and the worker as a user runs them), each archive's walls checked by
core.serving.position_check, then all of them together.

Usage:  python -m bench.positions [--runs 3] [--episodes 48] [--out DIR] [--gc-log]

Prints, per run and over all runs, the positions more than 2x their neighbours' median (each
wall over its condition's median), the worst factor, and how many cores other processes kept
busy meanwhile (each record's host_load); exits 1 when the combined check flags a position that
a busy host does not explain (other processes below half a core, or an episode too short to
judge). `--gc-log` adds a sitecustomize that writes every full (generation 2) collection of
every packbench process (driver and worker) with its duration to DIR/gc.log, so a slow position
can be matched with a collection: the cause issue 43 found (docs/metrics.md, "Plan position").

CPU timings on a shared host are noisy: compare only within one run, and read each run's
`host_load` warnings (`packbench results`) before believing a flagged position.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from packbench.core.report import plan_positions, read_screen
from packbench.core.serving import position_text

ROOT = Path(__file__).resolve().parents[1]
GC_HOOK = '''import gc, os, sys, time
_t = [0.0]
def _cb(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        with open(os.environ["PACKBENCH_GC_LOG"], "a") as f:
            f.write(f"{time.time():.3f} pid {os.getpid()} {sys.argv[0][-40:]} full collection "
                    f"{(time.perf_counter() - _t[0]) * 1e3:.1f} ms\\n")
gc.callbacks.append(_cb)
'''


def protocol(episodes: int, model: Path) -> dict:
    """Three exact conditions, one warmup each, alternated: 3 + 3 x prompts episodes."""
    prompts = max(1, (episodes - 3) // 3)
    return {"schema": 7, "name": f"positions-{3 + 3 * prompts}", "model": {"path": str(model)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": prompts}}, "prefix_tokens": 32, "continuation_tokens": 8,
            "conditions": [{"name": "dense-stream", "policy": "dense-stream"}, {"name": "packet", "policy": "packet"},
                           {"name": "resident", "policy": "resident"}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 4800,
            "gates": {"faithfulness": {"tolerance": 0.0}, "runtime": {"control": "dense-stream", "max_ratio": 1.5}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None, help="default: a temp dir")
    ap.add_argument("--gc-log", action="store_true")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="packbench-positions-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.gc_log:
        hook = out / "gchook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(GC_HOOK)
        env["PYTHONPATH"] = f"{hook}{os.pathsep}{env['PYTHONPATH']}"
        env["PACKBENCH_GC_LOG"] = str(out / "gc.log")
    py = [sys.executable, "-m", "packbench", "--db", f"sqlite:///{out / 'packbench.db'}"]
    model = out / "tiny"
    if not (model / "config.json").exists():
        subprocess.run([*py, "model", "synth", "--shape", "tiny", "--dtype", "float32", "--profile", "opt",
                        "--seed", "0", "--out", str(model)], env=env, check=True, capture_output=True)
    (out / "protocol.yaml").write_text(yaml.safe_dump(protocol(args.episodes, model)))
    subprocess.run([*py, "db", "upgrade"], env=env, check=True, capture_output=True)
    screens = []
    for run in range(args.runs):
        before = set((out / "archives").glob("*.zip")) if (out / "archives").exists() else set()
        done = subprocess.run([*py, "submit", str(out / "protocol.yaml"), "--wait"], cwd=out, env=env,
                              capture_output=True, text=True)
        (out / f"run-{run}.log").write_text(done.stdout + done.stderr)
        made = sorted(set((out / "archives").glob("*.zip")) - before)
        if done.returncode not in (0, 1) or not made:  # 1: a gate failed, which is not this check's concern
            raise SystemExit(f"run {run} failed (exit {done.returncode}); see {out / f'run-{run}.log'}")
        screens.append(read_screen(made[-1]))
        check = plan_positions([screens[-1]])
        print(f"run {run} ({screens[-1].planned} episodes): {position_text(check)}")
    combined = plan_positions(screens)
    print(f"\nall {len(screens)} runs (median per position): {position_text(combined)}")
    rows = sorted(combined["positions"], key=lambda r: -(r["over_neighbours"] or 0))[:8]
    print(f"{'position':>8} {'condition':13} {'median wall ms':>14} {'x condition':>11} {'x neighbours':>12} "
          f"{'other cores':>11}")
    for r in rows:
        taken = "-" if r["other_cores"] is None else f"{r['other_cores']:.2f}"
        print(f"{r['index']:8d} {r['condition']:13} {r['wall_s'] * 1e3:14.2f} {r['relative']:11.2f} "
              f"{r['over_neighbours'] or float('nan'):12.2f} {taken:>11}")
    print(f"flagged positions not explained by other processes on the host (host_load): "
          f"{combined['unexplained'] or 'none'}")
    if args.gc_log and (out / "gc.log").exists():
        print(f"\nfull collections: {(out / 'gc.log').read_text().count('full collection')} (log {out / 'gc.log'})")
    print(f"logs and archives: {out}")
    sys.exit(1 if combined["unexplained"] else 0)


if __name__ == "__main__":
    main()
