"""Predicted decode ms/token of bench/moe_device.sh's MoE conditions on a machine, written down
before the runs they predict (docs/traces.md, "Time"; docs/experiments/simulate.md).

Usage (CPU, no weights of the real shapes):  python -m bench.simulate_predict [--machine h200] [--out FILE]

1. The byte check: a tiny twin of each shape (qwen3-moe-tiny, mixtral-tiny) is synthesized, its
   episodes traced by the CPU-first engine (`packbench model stats --trace`), and every policy
   simulated on that trace; a decode call at batch 1 routes exactly k experts a layer, so the
   packets must move k x layers experts a decode call and dense-stream every expert.
2. The prediction: a trace of the real shape and depth bench/moe_device.sh runs (Qwen3-30B-A3B 12
   layers, Mixtral-8x7B 4 layers, fp16, 2 prompts x PREFIX + CONT tokens) whose calls route
   k distinct experts a token, drawn uniformly (seeded): at batch 1 a decode call's bytes do not
   depend on which k experts (each moves one expert's bytes), so the decode bytes are exact; the
   prefill sets are an upper estimate (independent tokens) and enter no decode figure. Every
   condition is simulated with the machine's rates (`packbench simulate --machine`).

Appends a dated section to the output (never rewrites what is there) and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from packbench.core import simulate as sim
from packbench.core.moe import MOE_SHAPES, MoeShape
from packbench.core.trace import Trace, TraceCall, TraceModel, read_trace, write_trace

ROOT = Path(__file__).resolve().parents[1]
# bench/moe_device.sh's shapes and depths, and bench/moe.py's CONDITIONS as simulate names them.
SHAPES = {"qwen3-30b-a3b": (12, "qwen3-moe-tiny"), "mixtral-8x7b": (4, "mixtral-tiny")}
CONDITIONS = {"dense-stream": "dense-stream", "resident": "resident", "packet": "packet:gather=device",
              "packet-host": "packet:gather=host", "phase-switched": "phase-switched:gather=device"}


def pb(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "packbench", *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"packbench {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return r.stdout


def byte_check(work: Path, tiny: str, prefix: int, cont: int) -> str:
    """Trace the tiny twin through the engine and check the simulated packets move k x layers a call."""
    model = work / tiny
    pb("model", "synth", "--out", str(model), "--shape", tiny, "--seed", "0")
    trace = work / f"{tiny}.trace"
    pb("model", "stats", str(model), "--prefix", str(prefix), "--continuation", str(cont), "--count", "2",
       "--trace", str(trace), "--json")
    out = json.loads(pb("simulate", str(trace), "--json"))
    s = MOE_SHAPES[tiny]
    rows = {p["policy"]: p for p in out["policies"]}
    per_call = {c["rows_copied"] and sum(c["rows_copied"]) for c in rows["packet"]["calls"] if c["phase"] == "decode"}
    dense = rows["dense-stream"]["totals"]["decode"]["rows_copied"] / rows["dense-stream"]["totals"]["decode"]["calls"]
    ok = per_call == {s["k"] * s["layers"]} and dense == s["experts"] * s["layers"]
    return (f"{tiny}: {len(out['policies'])} policies simulated on its engine-recorded trace "
            f"({out['calls']} calls); packet moves {sorted(per_call)} experts a decode call "
            f"(k x layers = {s['k'] * s['layers']}), dense-stream {dense:.0f} ({s['experts']} x {s['layers']}): "
            f"{'ok' if ok else 'MISMATCH'}"), ok


def real_trace(shape: str, layers: int, *, prefix: int, cont: int, prompts: int, seed: int) -> Trace:
    s = MoeShape.of(shape, layers=layers)
    rng = np.random.Generator(np.random.PCG64(seed))
    model = TraceModel(family=MOE_SHAPES[shape]["family"], unit="expert", layers=layers, units=s.experts,
                       unit_bytes=s.expert_bytes("float16"), hidden=s.hidden, dtype="float16", k=s.k, shape=shape)
    calls, sets = [], []
    for e in range(prompts):
        for c in range(cont):
            tokens = prefix if c == 0 else 1
            calls.append(TraceCall(episode=e, phase="prefill" if c == 0 else "decode", tokens=tokens))
            sets.append([np.unique(np.concatenate([rng.choice(s.experts, s.k, replace=False) for _ in range(tokens)]))
                         for _ in range(layers)])
    return Trace(model=model, calls=calls, sets=sets,
                 source={"tool": "bench/simulate_predict.py", "note": "k distinct experts a token, drawn uniformly "
                         f"(seed {seed}); decode bytes exact at batch 1, prefill sets an upper estimate"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine", default="h200")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "experiments" / "simulate.md")
    a = ap.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checks = [byte_check(work, tiny, 32, 6) for _, tiny in SHAPES.values()]
        rows = []
        for shape, (layers, _) in SHAPES.items():
            path = write_trace(real_trace(shape, layers, prefix=a.prefix, cont=a.continuation, prompts=2, seed=0),
                               work / f"{shape}.trace")
            args = ["simulate", str(path), "--machine", a.machine, "--json"]
            for spec in CONDITIONS.values():
                args += ["--policy", spec]
            out = json.loads(pb(*args))
            assert read_trace(path).model.shape == shape
            for (name, spec), p in zip(CONDITIONS.items(), out["policies"]):
                d = p["totals"]["decode"]
                rows.append((shape, layers, name, spec, p["prediction"],
                             (d["h2d_weight_bytes"] + d["h2d_index_bytes"]) / d["tokens"] / 1e6))
        machine = out["machine"]
    today = datetime.date.today().isoformat()
    lines += [f"## Predicted before the runs: bench/moe_device.sh on {machine['name']} ({today})", "",
              f"`python -m bench.simulate_predict --machine {a.machine}` (CPU), {today}. Shapes and depths of "
              f"bench/moe_device.sh, fp16, 2 prompts x {a.prefix} + {a.continuation} tokens. Byte check on the "
              "engine's own traces of the tiny twins:", ""]
    lines += [f"- {text}" for text, _ in checks]
    lines += ["", f"Rates: pinned copy {machine['pinned_h2d_gbps']['value']} GB/s ({machine['pinned_h2d_gbps']['source']}); "
                  "compute per shape below. Model: resident compute + decode bytes at the pinned rate, serial "
                  "(docs/traces.md, \"Time\"); a prediction, not a measurement.", "",
              "| shape (layers) | condition | predicted decode ms/token | MB per decode token | compute ms |",
              "| --- | --- | ---: | ---: | ---: |"]
    sources = {}
    for shape, layers, name, spec, pred, mb in rows:
        ms = pred.get("decode_ms_per_token")
        sources[f"{shape} ({layers})"] = pred.get("compute_source") or pred.get("why")
        lines.append(f"| {shape} ({layers}) | {name} (`{spec}`) | {'-' if ms is None else f'{ms:.2f}'} | {mb:,.1f} | "
                     f"{pred.get('compute_ms_per_token', '-')} |")
    lines += [""] + [f"Compute of {k}: {v}." for k, v in sources.items()]
    text = "\n".join(lines) + "\n"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    head = "" if a.out.exists() else ("# Simulation: predictions written before the runs\n\n"
                                      "Each section is appended by `python -m bench.simulate_predict` (bench/simulate_predict.sh) "
                                      "before the device runs it predicts; the measurements are compared in a later "
                                      "section of their own, never edited into these.\n\n")
    with open(a.out, "a") as f:
        f.write(head + text + "\n")
    print(text)
    if not all(ok for _, ok in checks):
        raise SystemExit("the byte check failed: the simulated packets do not move k experts a layer")


if __name__ == "__main__":
    main()
