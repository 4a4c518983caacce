"""Every expert policy on one MoE checkpoint: exactness against dense-stream, decode ms per
token, bytes per token and the floor (resident's decode time plus the packet's bytes at the
pinned copy rate measured here). `mapped` is `packet {gather: mapped}` (the sync-free gather)
eager, `mapped-graph` the same policy with each layer's experts captured as a CUDA graph
(engine/moe/model.py, mode graph).

Usage (GPU machine):  python -m bench.moe --model DIR --dtype float16 [--prefix 128 --continuation 16]
One process, one CPU-first MoE model (engine/moe/), no allowance imposed (the submit path of
bench/moe_device.sh imposes one); per prompt the conditions alternate, rotated, after one
warm-up episode each; decode ms is the median decode call. CPU timings are CPU timings.
"""

import argparse
import gc
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from packbench.engine.episode import run_episode
from packbench.engine.moe.model import CpuFirstMoE

# name -> (policy, params, engine mode)
CONDITIONS = {"dense-stream": ("dense-stream", {}, "eager"), "resident": ("resident", {}, "eager"),
              "packet": ("packet", {"gather": "device"}, "eager"), "packet-host": ("packet", {"gather": "host"}, "eager"),
              "phase-switched": ("phase-switched", {"gather": "device"}, "eager"),
              "mapped": ("packet", {"gather": "mapped"}, "eager"),
              "mapped-graph": ("packet", {"gather": "mapped"}, "graph"),
              "phase-mapped-graph": ("phase-switched", {"gather": "mapped"}, "graph")}
DEFAULT_CONDITIONS = "dense-stream,resident,packet,packet-host,phase-switched"


def pinned_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Host-to-device bytes per second from pinned memory (median of 5 copies of `nbytes`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--conditions", default=DEFAULT_CONDITIONS, help=f"Comma-separated, from {', '.join(CONDITIONS)}; "
                                                                        f"dense-stream (the reference) first.")
    ap.add_argument("--stock", action="store_true",
                    help="Also run stock transformers (experts resident, eager) on the first prompt and compare its "
                         "logits with dense-stream's, bit for bit.")
    a = ap.parse_args()
    torch.set_num_threads(min(8, torch.get_num_threads()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = CpuFirstMoE(a.model, dtype=getattr(torch, a.dtype), device=device)
    print(f"{a.model}: {model.family}, {model.host.experts} experts x {model.host.expert_bytes / 2**20:.1f} MiB, "
          f"{sum(model.host.has_experts(i) for i in range(model.host.layers))} MoE layers; experts on the host "
          f"{model.host.host_bytes / 2**30:.2f} GiB, device part {model.start.device_param_bytes / 2**30:.2f} GiB; "
          f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.Generator(np.random.PCG64(0))
    vocab = model.vocab
    prompts = [[1] + rng.integers(4, vocab, size=a.prefix - 1).tolist() for _ in range(a.prompts)]
    names = a.conditions.split(",")
    unknown = [n for n in names if n not in CONDITIONS]
    if unknown or names[0] != "dense-stream":
        raise SystemExit(f"--conditions: {', '.join(unknown) or names[0]}: give dense-stream first, then any of "
                         f"{', '.join(CONDITIONS)}")
    runs: dict[str, list] = {n: [] for n in names}

    def episode(n: str, prompt: list[int], continuation: int):
        policy, params, mode = CONDITIONS[n]
        model.use(policy, **params)
        out = run_episode(model, prompt, continuation=continuation, mode=mode)
        out.device_bytes = model.slot.policy.device_bytes()
        return out

    for n in names:  # warm-up: kernels, allocator, pinned pages
        episode(n, prompts[0], 2)
    # The reference must reproduce itself before anything is judged against it.
    again = [episode("dense-stream", prompts[0], a.continuation) for _ in range(2)]
    print(f"dense-stream reproduces itself (prompt 0, twice): "
          f"{np.array_equal(again[0].logits, again[1].logits) and again[0].tokens == again[1].tokens}")
    for i, prompt in enumerate(prompts):  # alternated: each prompt rotates the order
        for n in names[i % len(names):] + names[:i % len(names)]:
            runs[n].append(episode(n, prompt, a.continuation))
    for n in names:
        described = {r.decode_graph for r in runs[n] if r.decode_graph}
        if described:
            print(f"{n}: mode {runs[n][0].mode}; decode {'; '.join(sorted(described))}")
    ref = runs["dense-stream"]
    rate = pinned_rate(device) if device.type == "cuda" else float("nan")
    print(f"pinned host-to-device rate {rate / 1e9:.2f} GB/s; {a.prompts} prompts x {a.prefix} + {a.continuation} "
          f"tokens, {a.dtype}")
    decode_ms = {}
    print(f"{'condition':<15} {'exact':>5} {'decode ms/tok':>13} {'MB/decode tok':>13} {'prefill MB':>10} "
          f"{'experts/layer/tok':>17} {'policy GiB':>10}")
    for n in names:
        exact = all(np.array_equal(r.logits, q.logits) and r.tokens == q.tokens for r, q in zip(runs[n], ref))
        calls = [c for r in runs[n] for c in r.calls if c.phase == "decode"]
        ms = 1e3 * statistics.median(c.wall_s for c in calls)
        mb = statistics.mean(sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in calls) / 1e6
        pre = statistics.mean(sum(r.calls[0].h2d_weight_bytes) + sum(r.calls[0].h2d_index_bytes) for r in runs[n]) / 1e6
        moved = statistics.mean(statistics.mean(c.rows_copied) for c in calls)
        decode_ms[n] = (ms, mb)
        print(f"{n:<15} {str(exact):>5} {ms:13.2f} {mb:13.1f} {pre:10.1f} {moved:17.2f} "
              f"{runs[n][0].device_bytes / 2**30:10.2f}")
    if "resident" in decode_ms and rate == rate:
        for n in names:
            if n in ("dense-stream", "resident", "packet-host") or not decode_ms[n][1]:
                continue
            floor = decode_ms["resident"][0] + decode_ms[n][1] * 1e6 / rate * 1e3
            print(f"floor of {n} (resident {decode_ms['resident'][0]:.2f} ms + {decode_ms[n][1]:.1f} MB at "
                  f"{rate / 1e9:.2f} GB/s) = {floor:.2f} ms/token; {n} {decode_ms[n][0]:.2f} ms = "
                  f"{decode_ms[n][0] / floor:.2f}x the floor")


    if a.stock:
        first = ref[0]
        del model, runs
        gc.collect()  # the experts' hooks close over the model: a cycle, freed by the collector
        if device.type == "cuda":
            torch.cuda.empty_cache()
        stock = stock_logits(a.model, prompts[0], dtype=getattr(torch, a.dtype), device=device,
                             continuation=a.continuation)
        same = np.array_equal(stock, first.logits)
        print(f"stock transformers (experts resident, eager) == dense-stream, prompt 0: {same}"
              + ("" if same else f" (max |diff| {np.abs(stock - first.logits).max():.3g})"))


def stock_logits(path: Path, prompt: list[int], *, dtype: torch.dtype, device: torch.device,
                 continuation: int) -> np.ndarray:
    """Greedy (calls, vocab) float32 logits of stock transformers with every weight on `device`."""
    from transformers import DynamicCache

    from packbench.engine.moe.model import force_eager, model_class, moe_family

    model = model_class(moe_family(path)).from_pretrained(path, dtype=dtype, attn_implementation="eager")
    force_eager(model.config)
    model = model.eval().to(device)
    cache, ids, rows = DynamicCache(), torch.tensor([prompt], device=device), []
    with torch.inference_mode():
        for _ in range(continuation):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            row = logits.float().cpu().numpy()
            rows.append(row)
            ids = torch.tensor([[int(row.argmax())]], device=device)
    return np.stack(rows)


if __name__ == "__main__":
    main()
