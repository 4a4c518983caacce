"""Where a decode token's time goes: the GPU's kernels by kind, and its idle time, inside each call.

Usage (GPU machine):  python -m bench.decode_gaps --shape opt-2.7b --dtype float16 --prefix 512
  --conditions "resident+mode=graph,packet+gather=device+mode=graph,packet+gather=device+attention=static"

For each condition (bench.engine's `policy[+key=value...]` syntax): one warm-up episode (the
capture), then `--episodes` episodes under torch.profiler. Every decode call is a window on the
host clock, from the call's start to its logits on the host; the GPU's kernels and copies that
fall in it are summed by kind, and the window's time with no GPU work at all is its idle time
(launch gaps, host work between captured pieces, the logits readback). Kineto puts CPU and GPU
events on one clock, so windows and kernels compare directly. The same conditions' unprofiled
decode ms/token come from `--plain` more episodes, alternated, after the profiled ones.

A token's floor (issue 26): resident's kernel time plus the PCIe time of the packet's bytes; the
table shows, per condition, each kind's ms per token and how much of the wall the GPU was idle.
"""

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.engine import parse_condition, pinned_h2d_gbps, set_mode, use
from core.plan import BOS
from engine.episode import run_episode
from engine.model import CpuFirstModel
from engine.shapes import dtype_of
from engine.synth import synth_checkpoint

# Kernel names -> kinds, first match wins (lower-cased substrings).
KINDS = (
    ("gather", ("gather_active", "complete_forecast")),
    ("matmul", ("gemv", "gemm", "cutlass", "xmma", "cublas", "splitk", "sm90", "sm80", "nvjet")),
    ("attention", ("flash", "fmha", "softmax", "attention", "sdpa", "bmm")),
    ("layernorm", ("layer_norm", "layernorm")),
    ("copy", ("memcpy", "memset")),
    ("elementwise", ("elementwise", "vectorized", "relu", "add", "mul", "copy", "fill", "cat", "index", "reduce")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def device_events(prof, label: str) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every GPU kernel, copy and memset the profiler saw (the
    device-side mirrors of the host's `label` ranges are annotations, not work: left out)."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != label:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def call_windows(prof, label: str) -> list[tuple[float, float]]:
    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if e.name == label and e.device_type == torch.autograd.DeviceType.CPU]


def breakdown(prof, skip_first: int) -> dict:
    """Per decode call: ms by kind, busy ms, idle ms, wall ms (medians over calls)."""
    windows = call_windows(prof, "decode_call")
    kernels = device_events(prof, "decode_call")
    per: dict[str, list[float]] = defaultdict(list)
    names: dict[str, float] = defaultdict(float)
    gathers: list[float] = []
    for w0, w1 in windows[skip_first:]:
        inside = [(n, max(a, w0), min(b, w1)) for n, a, b in kernels if b > w0 and a < w1]
        sums: dict[str, float] = defaultdict(float)
        for n, a, b in inside:
            sums[kind_of(n)] += (b - a) / 1e3
            names[n] += (b - a) / 1e3
            if kind_of(n) == "gather":
                gathers.append((b - a) / 1e3)
        busy = union_length([(a, b) for _, a, b in inside]) / 1e3
        wall = (w1 - w0) / 1e3
        for kind, _ in KINDS + (("other", ()),):
            per[kind].append(sums.get(kind, 0.0))
        per["busy"].append(busy)
        per["idle"].append(wall - busy)
        per["wall"].append(wall)
        per["kernels"].append(len(inside))
    calls = max(1, len(windows) - skip_first)
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return {"median": {k: statistics.median(v) for k, v in per.items() if v},
            "top": [(n, ms / calls) for n, ms in top], "gather_ms": gathers, "calls": calls}


def episode(model, prompt, continuation, mode, label=None):
    """run_episode, with each decode call a profiler range that ends once its logits are back."""
    forward = model.forward
    count = {"call": 0}

    def marked(ids, cache):
        count["call"] += 1
        if count["call"] <= 2 or label is None:  # the prefill, and the decode call that captures
            return forward(ids, cache)
        with record_function(label):
            out = forward(ids, cache)
            torch.cuda.synchronize()
        return out

    model.forward = marked
    try:
        return run_episode(model, prompt, continuation=continuation, mode=mode)
    finally:
        model.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-2.7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--profile", default="opt")
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--plain", type=int, default=3)
    ap.add_argument("--conditions", default="resident+mode=graph,packet+gather=device+mode=graph")
    args = ap.parse_args()
    device = torch.device("cuda")
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"packbench-{args.shape}-{args.dtype}-profile-{args.profile}"
    if not (model_dir / "config.json").exists():
        synth_checkpoint(model_dir, shape=args.shape, dtype=args.dtype, seed=0, profile=args.profile)
    model = CpuFirstModel(model_dir, dtype=dtype_of(args.dtype), device=device)
    bw = pinned_h2d_gbps(device)
    rng = np.random.Generator(np.random.PCG64(0))
    prompts = [[BOS] + rng.integers(4, model.vocab, size=args.prefix - 1).tolist() for _ in range(args.episodes)]
    names = args.conditions.split(",")
    results, plain, refs = {}, defaultdict(list), {}
    for name in names:
        policy, params, _, mode = parse_condition(name)
        params.pop("unbounded", None)
        mode = set_mode(model, mode)
        use(model, policy, params)
        warm = episode(model, prompts[0], args.continuation, mode)  # warm-up and capture
        refs[name] = warm.logits
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            outs = [episode(model, p, args.continuation, mode, label="decode_call") for p in prompts]
        results[name] = breakdown(prof, skip_first=0)
        results[name]["bytes"] = statistics.mean(
            sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for o in outs for c in o.calls[1:])
        results[name]["graph"] = outs[0].decode_graph
        results[name]["exact"] = bool(np.array_equal(outs[0].logits, warm.logits))
    for r in range(args.plain):  # unprofiled, alternated, rotated
        for name in names[r % len(names):] + names[:r % len(names)]:
            policy, params, _, mode = parse_condition(name)
            params.pop("unbounded", None)
            mode = set_mode(model, mode)
            use(model, policy, params)
            for p in prompts:
                out = run_episode(model, p, continuation=args.continuation, mode=mode)
                plain[name] += [c.wall_s * 1e3 for c in out.calls[2:]]
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; {args.shape} {args.dtype} profile "
          f"{args.profile}; {args.episodes} prompts x {args.prefix} + {args.continuation}; pinned H2D {bw:.1f} GB/s\n")
    kinds = [k for k, _ in KINDS] + ["other"]
    head = f"{'condition':44}{'plain ms':>9}{'prof ms':>8}{'busy':>7}{'idle':>7}" + "".join(f"{k[:9]:>10}" for k in kinds)
    print(head + f"{'kernels':>8}{'MB/tok':>8}{'PCIe ms':>8}")
    for name in names:
        m = results[name]["median"]
        pcie = results[name]["bytes"] / (bw * 1e9) * 1e3
        print(f"{name:44}{statistics.median(plain[name]):9.2f}{m['wall']:8.2f}{m['busy']:7.2f}{m['idle']:7.2f}"
              + "".join(f"{m.get(k, 0.0):10.3f}" for k in kinds)
              + f"{m['kernels']:8.0f}{results[name]['bytes'] / 1e6:8.1f}{pcie:8.2f}")
    print()
    for name in names:
        res = results[name]
        g = res["gather_ms"]
        if g:
            per_layer = res["bytes"] / max(1, len(g) / res["calls"])
            print(f"{name}: gather kernel median {statistics.median(g) * 1e3:.1f} us per layer, "
                  f"{per_layer / 1e6:.2f} MB per layer -> {per_layer / (statistics.median(g) / 1e3) / 1e9:.1f} GB/s")
        print(f"{name}: decode step {res['graph']}; profiled episode exact against its warm-up: {res['exact']}")
        for n, ms in res["top"]:
            print(f"    {ms:8.3f} ms/call  {kind_of(n):11} {n[:100]}")


if __name__ == "__main__":
    main()
