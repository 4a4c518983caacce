"""Loader policies head to head on one synthetic checkpoint: time, bytes, memory, exactness.

Usage (GPU machine):  python -m bench.engine --shape opt-2.7b --dtype float16 --prefix 512 --continuation 16
CPU timings are CPU timings: say so when quoting them.

Method: one process, one CPU-first model; conditions alternate (rotated per prompt and round)
so drift hits them alike; the reference (dense-stream) is first checked to reproduce itself;
decode is reported as the median ms per decode call over all scored tokens.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from core.plan import BOS
from engine.episode import run_episode
from engine.model import CpuFirstModel
from engine.shapes import dtype_of
from engine.synth import synth_checkpoint


def pinned_h2d_gbps(device: torch.device, mib: int = 256, reps: int = 10) -> float:
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return reps * src.numel() / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="opt-125m")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--sparsity", type=float, default=0.94)
    ap.add_argument("--model-dir", type=Path, default=None, help="default: synthesise into a temp dir")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", default="resident,dense-stream,packet")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    device = torch.device(args.device)
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = Path(tempfile.gettempdir()) / f"packbench-{args.shape}-{args.dtype}-{args.sparsity}"
        if not (model_dir / "config.json").exists():
            t = time.perf_counter()
            synth_checkpoint(model_dir, shape=args.shape, dtype=args.dtype, sparsity=args.sparsity, seed=0)
            print(f"synthesised {args.shape} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    model = CpuFirstModel(model_dir, dtype=dtype_of(args.dtype), device=device)
    print(f"cold start {time.perf_counter() - t:.1f} s: {model.start}")
    vocab = model.vocab
    rng = np.random.Generator(np.random.PCG64(0))
    prompts = [[BOS] + rng.integers(4, vocab, size=args.prefix - 1).tolist() for _ in range(args.prompts)]
    policies = args.policies.split(",")

    model.use("dense-stream")
    ref = [run_episode(model, p, continuation=args.continuation) for p in prompts]
    again = run_episode(model, prompts[0], continuation=args.continuation)
    reproducible = np.array_equal(ref[0].logits, again.logits)
    print(f"dense-stream reproduces itself: {reproducible}")

    rows: dict[str, dict[str, list]] = {p: {"decode_ms": [], "prefill_s": [], "h2d": [], "peak": [], "exact": []}
                                        for p in policies}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            k = (r * len(prompts) + i) % len(policies)
            for name in policies[k:] + policies[:k]:  # rotate the order every episode
                model.use(name)
                out = run_episode(model, prompt, continuation=args.continuation)
                row = rows[name]
                row["prefill_s"].append(out.calls[0].wall_s)
                row["decode_ms"] += [c.wall_s * 1e3 for c in out.calls[1:]]
                row["h2d"] += [sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in out.calls]
                row["peak"].append(out.peak_allocated_bytes)
                row["exact"].append(np.array_equal(out.logits, ref[i].logits) and out.tokens == ref[i].tokens)

    bw = pinned_h2d_gbps(device)
    print(f"\npinned H2D bandwidth: {bw:.1f} GB/s; device {device}"
          f"{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}; torch {torch.__version__}")
    print(f"{args.shape} {args.dtype} sparsity {args.sparsity}, {args.prompts} prompts x {args.prefix} + "
          f"{args.continuation} tokens, {args.rounds} rounds, alternated\n")
    head = f"{'policy':14} {'decode ms/tok':>13} {'p10-p90':>13} {'prefill s':>9} {'H2D/decode call':>16} {'H2D/prefill':>13} {'peak alloc MiB':>14} exact"
    print(head)
    for name in policies:
        row = rows[name]
        d = np.array(row["decode_ms"])
        n_calls = args.continuation
        prefill_h2d = row["h2d"][::n_calls]
        decode_h2d = [h for j, h in enumerate(row["h2d"]) if j % n_calls]
        print(f"{name:14} {np.median(d):13.2f} {np.percentile(d, 10):6.2f}-{np.percentile(d, 90):6.2f} "
              f"{statistics.median(row['prefill_s']):9.3f} {statistics.mean(decode_h2d):16,.0f} "
              f"{statistics.mean(prefill_h2d):13,.0f} {max(row['peak']) / 2**20:14.0f} {all(row['exact'])}")
    if "dense-stream" in rows and device.type == "cuda":
        d = statistics.median(rows["dense-stream"]["decode_ms"]) / 1e3
        per_call = statistics.mean(rows["dense-stream"]["h2d"])
        print(f"\ndense-stream decode achieves {per_call / d / 1e9:.1f} GB/s = {per_call / d / 1e9 / bw:.0%} of pinned copy bandwidth")


if __name__ == "__main__":
    main()
