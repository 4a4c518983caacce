"""Where a decode call's time goes on the GPU (issue 11): kernel time by kind, GPU busy, idle.

For each condition, one episode warms the decoder up (its capture included), then a second
episode's decode calls after its first are profiled with torch.profiler (CUPTI sees the kernels
inside CUDA graph replays). Per decode call it prints the host wall, the time some kernel or copy
was running (the union of their intervals), the rest (the GPU waiting for the host or between
kernels), the kernel count, and kernel time by kind. The matmuls' achieved bandwidth is the
device-resident weight bytes they read per call over their time.

    python -m bench.step_profile --shape opt-2.7b --dtype float16 \\
        --conditions "resident,resident+attention=static,packet+gather=device,dense-stream"

Every condition runs mode graph; conditions are bench.engine's, with its measured variants
(`+attention=static`: one graph over the static span, not stock-exact; `+attend=matmul`;
`+kv=serial`). GPU only.
"""

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.engine import parse_condition, set_mode
from packbench.engine.model import CpuFirstModel
from packbench.engine.synth import synth_checkpoint

# Kernel kinds by name fragment, first match wins (CUDA kernel names are mangled C++).
KINDS = (
    ("gather (Triton)", ("_gather_active_rows",)),
    ("matmul", ("gemv", "gemm", "cutlass", "xmma", "splitk", "sm90", "sm80", "ampere")),
    ("softmax", ("softmax",)),
    ("layer_norm", ("layer_norm", "LayerNorm")),
    ("kv write (index_copy)", ("index_copy", "indexFunc", "index_put", "index_elementwise")),
    ("copy (memcpy)", ("Memcpy", "memcpy")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce")),
)


def kind_of(name: str) -> str:
    for kind, fragments in KINDS:
        if any(f in name for f in fragments):
            return kind
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_condition(model: CpuFirstModel, prompt: list[int], continuation: int, spec: str, trace: Path) -> dict:
    policy, params, _, mode = parse_condition(spec)
    set_mode(model, mode if mode.startswith("graph") else "graph")
    recorder, device = model.recorder, model.device

    def call(ids, cache, phase) -> tuple[torch.Tensor, float]:
        recorder.begin(phase=phase, tokens=ids.shape[1])
        t0 = time.perf_counter()
        logits = model.forward(ids, cache).float().cpu()
        wall = time.perf_counter() - t0
        recorder.end(wall_s=wall, logits_d2h_bytes=logits.numel() * 4)
        return torch.tensor([[int(logits.argmax())]], dtype=torch.long, device=device), wall * 1e6

    walls: list[float] = []
    for episode in range(2):  # the first warms the decoder up for this policy class
        model.use(policy, **params)
        recorder.calls = []
        cache = model.new_cache(len(prompt) + continuation, mode="graph")
        ids, _ = call(torch.tensor([prompt], dtype=torch.long, device=device), cache, "prefill")
        ids, _ = call(ids, cache, "decode")  # the capture's call
        if episode == 0:
            for _ in range(continuation - 2):
                ids, _ = call(ids, cache, "decode")
            continue
        torch.cuda.synchronize(device)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(continuation - 2):
                ids, wall = call(ids, cache, "decode")
                walls.append(wall)
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_kind: dict[str, float] = defaultdict(float)
    for e in gpu:
        by_kind[kind_of(e["name"]) if e["cat"] == "kernel" else "copy (memcpy)"] += e["dur"]
    calls = len(walls)
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    return {"calls": calls, "wall_us": statistics.median(walls), "wall_sum_us": sum(walls), "busy_us": busy / calls,
            "kernels": sum(e["cat"] == "kernel" for e in gpu) / calls,
            "by_kind": {k: v / calls for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-2.7b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--conditions", default="resident,resident+attention=static,packet+gather=device,dense-stream")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--profile", help="a calibrated profile (core/registry.py PROFILES, e.g. opt) instead of sparsity 0.94")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.step_profile needs a CUDA device: it profiles CUDA graph replays")
    device = torch.device("cuda")
    if args.profile:  # bench.engine's model folder for the same checkpoint
        model_dir = Path(tempfile.gettempdir()) / f"packbench-{args.shape}-{args.dtype}-profile-{args.profile}"
        recipe = dict(profile=args.profile)
    else:
        model_dir = Path(tempfile.gettempdir()) / f"packbench-{args.shape}-{args.dtype}-0.94-hot0.05-0.0"
        recipe = dict(sparsity=0.94, hot_fraction=0.05)
    if not (model_dir / "config.json").exists():
        synth_checkpoint(model_dir, shape=args.shape, dtype=args.dtype, seed=0, **recipe)
    model = CpuFirstModel(model_dir, dtype=getattr(torch, args.dtype), device=device, mode="graph")
    resident_bytes = model.start.device_param_bytes  # everything but fc2
    fc2_bytes = model.host.host_bytes  # resident's device copy, or the dense workspace, read per call
    prompt = [2] + [(17 * i) % 5000 + 10 for i in range(args.prefix - 1)]
    print(f"{args.shape} {args.dtype}, {args.prefix} + {args.continuation} tokens, mode graph, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; weights on the device {resident_bytes / 1e9:.2f} GB (+ fc2 "
          f"{fc2_bytes / 1e9:.2f} GB: its dense workspace reads the same bytes per call)")
    rows = {}
    for spec in args.conditions.split(","):
        rows[spec] = profile_condition(model, prompt, args.continuation, spec, args.out / f"trace-{spec}.json")
    kinds = sorted({k for r in rows.values() for k in r["by_kind"]}, key=lambda k: -max(r["by_kind"].get(k, 0) for r in rows.values()))
    print("\nper decode call (medians over the profiled calls; kernel times are sums per call), microseconds")
    w = max(len(s) for s in rows) + 2
    print(f"{'condition':{w}}{'wall':>8}{'GPU busy':>9}{'idle':>7}{'kernels':>8}" + "".join(f"{k[:14]:>16}" for k in kinds))
    for spec, r in rows.items():
        print(f"{spec:{w}}{r['wall_us']:8.0f}{r['busy_us']:9.0f}{r['wall_sum_us'] / r['calls'] - r['busy_us']:7.0f}"
              f"{r['kernels']:8.0f}" + "".join(f"{r['by_kind'].get(k, 0):16.0f}" for k in kinds))
    for spec, r in rows.items():
        mm = r["by_kind"].get("matmul", 0)
        if mm:
            read = resident_bytes + fc2_bytes
            print(f"{spec}: matmuls read about {read / 1e9:.2f} GB per call in {mm / 1e3:.2f} ms = "
                  f"{read / (mm * 1e-6) / 1e12:.2f} TB/s (lm_head and embeddings included in the bytes)")


if __name__ == "__main__":
    main()
