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

3. The caches (`--only cache`): bench/moe_cache_device.sh's conditions (Qwen3-30B-A3B 12 layers:
   packet, LRU 16/32/64, LFU 32, expert-forecast, LRU 32 + forecast; Mixtral-8x7B 4 layers:
   packet, LRU 2/4/6, LFU 4, expert-forecast, LRU 4 + forecast). A cache's bytes depend on which
   experts are routed, so uniform draws will not do: the synthetic checkpoint of the same shape
   (same recipe and seed as the device script, fewer layers: `--cache-layers`, default 2, as host
   memory allows) is traced by the CPU-first engine in fp16 (`packbench model stats --trace`: the
   routed sets and the next layer's forecast), and every condition simulated on it. Per decode
   token the bytes of the full depth are layer 0's (no forecast before it) plus the mean of the
   other recorded layers' times (depth - 1): the routing of the recorded layers stands for the
   deeper ones. Time = the measured resident compute at the full depth + those bytes at the
   pinned copy rate, serial: a hit costs no copy, a prefetch costs its copy (its overlap with the
   previous layer's compute is not modelled, so a forecast is predicted at its worst).

Appends a dated section to the output (never rewrites what is there) and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

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


# bench/moe_cache_device.sh's shapes, depths, and capacities (low, middle, high).
CACHE_SHAPES = {"qwen3-30b-a3b": (12, (16, 32, 64)), "mixtral-8x7b": (4, (2, 4, 6))}


def cache_conditions(caps: tuple[int, int, int]) -> dict[str, str]:
    lo, mid, hi = caps
    return {"packet": "packet:gather=device", f"lru-{lo}": f"expert-cache:capacity={lo},rule=lru",
            f"lru-{mid}": f"expert-cache:capacity={mid},rule=lru", f"lru-{hi}": f"expert-cache:capacity={hi},rule=lru",
            f"lfu-{mid}": f"expert-cache:capacity={mid},rule=lfu", "expert-forecast": "expert-forecast",
            f"lru-{mid}-forecast": f"expert-cache:capacity={mid},rule=lru,forecast=on"}


def full_depth_bytes(calls: list[dict], depth: int) -> float:
    """Host-to-device bytes per decode token at `depth` layers from a trace of fewer: layer 0 as
    recorded, plus the mean of the other recorded layers times (depth - 1) (module docstring)."""
    decode = [c for c in calls if c["phase"] == "decode"]
    tokens = sum(c["tokens"] for c in decode)
    per_layer = [sum(c["h2d_weight_bytes"][i] + c["h2d_index_bytes"][i] for c in decode) / tokens
                 for i in range(len(decode[0]["h2d_weight_bytes"]))]
    rest = per_layer[1:] or per_layer
    return per_layer[0] + sum(rest) / len(rest) * (depth - 1)


def cache_section(work: Path, machine_name: str, *, prefix: int, cont: int, layers: dict[str, int]) -> list[str]:
    """The cache conditions' predictions (module docstring, 3), as markdown lines."""
    from packbench.cli.simulate_cmd import load_machine

    machine = load_machine(machine_name)
    rate = float(machine["pinned_h2d_gbps"]["value"])
    today = datetime.date.today().isoformat()
    rows, notes = [], []
    recorded = {}
    for shape, (depth, caps) in CACHE_SHAPES.items():
        model, trace = work / shape, work / f"{shape}.trace"
        if not trace.exists():  # a trace already in --work is reused (it is what this step writes)
            if not (model / "config.json").exists():
                pb("model", "synth", "--out", str(model), "--shape", shape, "--layers", str(layers[shape]),
                   "--dtype", "float16", "--seed", "0")
            pb("model", "stats", str(model), "--prefix", str(prefix), "--continuation", str(cont), "--count", "1",
               "--seed", "0", "--dtype", "float16", "--trace", str(trace), "--json")
            shutil.rmtree(model)  # GBs: the next shape needs the disk
        conditions = cache_conditions(caps)
        t = read_trace(trace)
        recorded[shape] = t.model.layers
        if t.model.layers < 2:  # no layer before the recorded one: no forecast to replay
            conditions = {k: v for k, v in conditions.items() if "forecast" not in v}
        args = ["simulate", str(trace), "--json"]
        for spec in conditions.values():
            args += ["--policy", spec]
        out = json.loads(pb(*args))
        compute = machine["decode_compute_ms"].get(f"{shape}:{depth}")
        for (name, spec), p in zip(conditions.items(), out["policies"]):
            d = p["totals"]["decode"]
            b = full_depth_bytes(p["calls"], depth)
            ms = None if compute is None else float(compute["value"]) + b / (rate * 1e9) * 1e3
            rows.append((shape, depth, name, spec, ms, b / 1e6, d.get("hit_rate"), d.get("belady_rate"),
                         d.get("prefetched"), d.get("used"), d["rows_wasted"]))
        if recorded[shape] < 2:
            notes.append(f"{shape}: forecast conditions not predicted: a forecast needs a recorded layer before "
                         f"the one it is for, and only {recorded[shape]} layer was recorded.")
        notes.append(f"Compute of {shape} ({depth}): " + (f"{compute['value']} ms, {compute['source']}" if compute
                                                           else f"none in the machine file: no time predicted"))
    lines = [f"## Predicted before the runs: bench/moe_cache_device.sh on {machine['name']} ({today})", "",
             f"`python -m bench.simulate_predict --only cache --machine {machine_name} --qwen-layers "
             f"{layers['qwen3-30b-a3b']} --mixtral-layers {layers['mixtral-8x7b']}` (CPU), {today}. The synthetic "
             f"checkpoints of bench/moe_cache_device.sh's shapes (seed 0, fp16) with fewer layers (host memory: "
             + ", ".join(f"{k} {v} of {CACHE_SHAPES[k][0]}" for k, v in recorded.items()) + "; synth draws layer "
             f"by layer from one seeded generator, so the recorded layers hold the device checkpoints' first layers' "
             f"weights, but the greedy tokens, and so the decode routing, are the shallower model's), "
             f"traced by the CPU-first engine on the CPU: 1 generated prompt (seed 0) x {prefix} "
             f"+ {cont} tokens, as the device script's protocol asks. Decode bytes of the full depth: layer 0's plus "
             f"the mean of the other recorded layers x (depth - 1). Time: the measured resident compute + those bytes "
             f"at the pinned copy rate {rate} GB/s, serial; a hit costs no copy, a prefetch costs its copy (overlap "
             f"not modelled). Hit and Belady rates: decode calls of the recorded layers. A prediction, not a "
             f"measurement; routing recorded on the CPU may differ from the GPU's at near-ties.", "",
             "| shape (layers) | condition | predicted decode ms/token | MB per decode token | hit % | Belady % "
             "| prefetched | used | wasted |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
    for shape, depth, name, spec, ms, mb, hit, belady, pre, used, wasted in rows:
        lines.append(f"| {shape} ({depth}) | {name} (`{spec}`) | {'-' if ms is None else f'{ms:.2f}'} | {mb:,.1f} | "
                     f"{pct(hit)} | {pct(belady)} | {'-' if pre is None else pre} | {'-' if used is None else used} | "
                     f"{wasted} |")
    return lines + [""] + notes


def append(out: Path, text: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    head = "" if out.exists() else ("# Simulation: predictions written before the runs\n\n"
                                    "Each section is appended by `python -m bench.simulate_predict` (bench/simulate_predict.sh) "
                                    "before the device runs it predicts; the measurements are compared in a later "
                                    "section of their own, never edited into these.\n\n")
    with open(out, "a") as f:
        f.write(head + text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine", default="h200")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "experiments" / "simulate.md")
    ap.add_argument("--only", choices=("all", "packets", "cache"), default="all",
                    help="packets: bench/moe_device.sh's conditions; cache: bench/moe_cache_device.sh's")
    ap.add_argument("--qwen-layers", type=int, default=2, help="layers of the traced Qwen3-30B-A3B checkpoint")
    ap.add_argument("--mixtral-layers", type=int, default=1,
                    help="layers of the traced Mixtral-8x7B checkpoint (2 and more: ~2.8 GB of fp16 experts a layer, "
                         "drawn in float32; 1 fits a 16 GiB host, and has no forecast)")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep the cache checkpoints and traces here (SHAPE/, SHAPE.trace; reused when present)")
    a = ap.parse_args()
    if a.only in ("all", "cache"):
        layers = {"qwen3-30b-a3b": a.qwen_layers, "mixtral-8x7b": a.mixtral_layers}
        with tempfile.TemporaryDirectory() as tmp:
            work = a.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            text = "\n".join(cache_section(work, a.machine, prefix=a.prefix, cont=a.continuation,
                                           layers=layers)) + "\n"
        append(a.out, text)
        print(text)
        if a.only == "cache":
            return
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
    append(a.out, text)
    print(text)
    if not all(ok for _, ok in checks):
        raise SystemExit("the byte check failed: the simulated packets do not move k experts a layer")


if __name__ == "__main__":
    main()
