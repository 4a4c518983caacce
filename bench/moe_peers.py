"""The crossover batch of an MoE model: host-computed experts (`host-experts`, Fiddler-style,
packbench's implementation) against exact expert packets and dense-stream, at each batch size;
the first batch where moving the weights (a packet) decodes faster than moving the activations
to the experts on the host is where moving the weights starts to pay. `--hot N` adds host-experts
with N experts a layer held on the device (`host-hot`, its hit rate printed beside its fidelity).
`--conditions ...,llama-cpp,llama-cpp-po` adds llama.cpp (the `llama-cpp` condition kind's model,
engine/llama_cpp.py; the [llamacpp] extra) with every layer's experts in host memory (`--n-cpu-moe`,
default every layer, llama.cpp's `--cpu-moe`), op offload off (the CPU computes them) and on (from 32
tokens a call llama.cpp's scheduler copies them to the GPU instead): llama.cpp's own crossover, the
same question asked of its kernels; it is printed apart, as is packbench's.

  python -m bench.moe_peers --model DIR --dtype float16 --batches 1,2,4,8,16,32,64

Method: one process, one CPU-first MoE model (engine/moe/), no allowance imposed (the screen of
bench/moe_peers_device.sh imposes one). At each batch B, the same B prompts (drawn as a protocol's
generator draws them) run under each condition in turn, rotated per round, after one warm-up
episode per condition at that batch (its figures are printed apart as `cold`: first kernels,
allocator growth, pinned pages). Per condition and batch: decode ms per call (the median over the
scored rounds' decode calls; one call decodes B tokens), prefill ms (the first call, apart), bytes
per decode call host-to-device (weights + indices, or expert outputs for host-experts) and
device-to-host (routing readbacks, or hidden states and routing for host-experts), experts routed
per layer, and against dense-stream at the same batch: `exact` (bit-identical logits and tokens)
for the loaders, fidelity (teacher-forced on dense-stream's tokens: mean KL, top-1 agreement, max
|logit diff|) for host-experts. An episode that fails (an out-of-memory, say) prints its error and
the run goes on. Host threads: torch's default unless `--threads`.

On the CPU (tiny shapes) this checks the mechanics and the arithmetic only; its times are CPU
times and claim nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from packbench.core.errors import PackbenchError
from packbench.core.fidelity import fidelity
from packbench.core.plan import BOS
from packbench.engine.episode import run_episode
from packbench.engine.moe.model import CpuFirstMoE

CONDITIONS = {"dense-stream": ("dense-stream", {}), "packet": ("packet", {"gather": "device"}),
              "packet-mapped": ("packet", {"gather": "mapped"}), "host-experts": ("host-experts", {}),
              "llama-cpp": ("llama-cpp", {"op_offload": "off"}), "llama-cpp-po": ("llama-cpp", {"op_offload": "on"})}
LLAMA = "llama-cpp"  # conditions of this policy run in llama.cpp, a model of their own per batch
DEFAULT = [n for n, (policy, _) in CONDITIONS.items() if policy != LLAMA]  # llama.cpp's need the extra: asked for
REFERENCE = "dense-stream"
# The crossover compares host-experts with each packet that moves the weights: the device gather
# (routing read back to the host, then a copy of the routed experts) and the mapped gather (the
# device reads the routed experts from mapped host memory, no readback: docs/engine.md).
MOVERS, HOST = ("packet", "packet-mapped"), "host-experts"


def batch_prompts(batch: int, *, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """B prompts as a protocol's generator draws them (core/plan.py prompts)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return [[BOS] + rng.integers(4, vocab, size=length - 1).tolist() for _ in range(batch)]


def figures(out, device_bytes: int) -> dict:
    """One episode's timing and byte figures (decode: per call; each call decodes B tokens)."""
    decode = [c for c in out.calls if c.phase == "decode"]
    return {"prefill_ms": 1e3 * out.calls[0].wall_s,
            "decode_ms": [1e3 * c.wall_s for c in decode],
            "h2d": [sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in decode],
            "d2h": [sum(c.d2h_bytes) for c in decode],
            "routed": [statistics.mean(a for a in c.active_rows if a is not None) for c in decode
                       if any(a is not None for a in c.active_rows)],
            "prefill_h2d": sum(out.calls[0].h2d_weight_bytes) + sum(out.calls[0].h2d_index_bytes),
            "prefill_d2h": sum(out.calls[0].d2h_bytes),
            "device_bytes": device_bytes}


def judge(name: str, runs: list, refs: list, model, prompts, continuation: int, *, conditions: dict) -> str:
    """`exact` or `NOT EXACT` for a loader; fidelity figures for host-experts and llama.cpp
    (teacher-forced on the reference's tokens, rerun after the timed episodes)."""
    policy = conditions[name][0]
    if policy not in (HOST, LLAMA):
        same = all(np.array_equal(r.logits, q.logits) and r.tokens == q.tokens for r, q in zip(runs, refs))
        return "exact" if same else "NOT EXACT"
    ref = refs[0]
    if policy == HOST:
        model.use(policy, **conditions[name][1])
    forced = run_episode(model, prompts if len(prompts) > 1 else prompts[0], continuation=continuation,
                         forced=ref.tokens)
    f = fidelity(ref.logits, forced.logits, reference_tokens=ref.tokens, tokens=runs[0].tokens)
    div = "never" if f.divergence_step is None else f.divergence_step
    hits = model.slot.policy.hit_rate if policy == HOST and model.slot.policy.hot else None
    return (f"KL {f.mean_kl:.2e} top1 {f.top1:.3f} max|d| {f.max_abs_logit:.3g} diverges {div}"
            + ("" if hits is None else f" hit rate {hits:.3f}"))


def llama_models(model_dir: Path, names: list[str], *, conditions: dict, dtype: torch.dtype, device: torch.device,
                 batch: int, capacity: int, n_cpu_moe: int | None, cache: Path) -> dict:
    """The llama-cpp conditions' models at this batch (held together: their device parts are small with
    the experts on the host), no allowance imposed."""
    wanted = [n for n in names if conditions[n][0] == LLAMA]
    if not wanted:
        return {}
    from packbench.engine.llama_cpp import LlamaCppModel

    models = {}
    for n in wanted:
        params = {**conditions[n][1], **({} if n_cpu_moe is None else {"n_cpu_moe": n_cpu_moe})}
        models[n] = LlamaCppModel(model_dir, dtype=dtype, device=device, params=params, allowance_bytes=1 << 50,
                                  context_bytes=0, capacity=capacity, batch=batch, cache=cache)
    return models


def run_batch(model, batch: int, *, conditions: dict, prefix: int, continuation: int, rounds: int,
              llama: dict | None = None) -> dict:
    """`llama`: the llama-cpp conditions' models at this batch (llama_models), by condition name."""
    names, llama = list(conditions), llama or {}
    prompts = batch_prompts(batch, length=prefix, vocab=model.vocab, seed=batch)
    episode_input = prompts if batch > 1 else prompts[0]
    cold, warm, outs = {}, {n: [] for n in names}, {n: [] for n in names}

    def ready(n: str):  # the model that runs condition n, and its device bytes
        if n in llama:
            return llama[n], llama[n].stats.device_bytes
        model.use(conditions[n][0], **conditions[n][1])
        return model, model.slot.policy.device_bytes()

    for n in names:  # the warm-up episode at this batch: printed apart as cold
        try:
            m, held = ready(n)
            cold[n] = figures(run_episode(m, episode_input, continuation=continuation), held)
        except Exception as e:  # an OOM at a large batch: reported, the run goes on
            cold[n] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    live = [n for n in names if "error" not in cold[n]]
    for r in range(rounds):
        for n in live[r % len(live):] + live[:r % len(live)]:
            m, held = ready(n)
            out = run_episode(m, episode_input, continuation=continuation)
            outs[n].append(out)
            warm[n].append(figures(out, held))
    verdicts = {n: (judge(n, outs[n], outs[REFERENCE], llama.get(n, model), prompts, continuation,
                          conditions=conditions) if REFERENCE in live and n in live else "-") for n in names}
    return {"cold": cold, "warm": warm, "verdict": verdicts}


def summary(figs: list[dict]) -> dict:
    """Medians over every scored episode's decode calls; means of bytes; prefill median."""
    ms = [x for f in figs for x in f["decode_ms"]]
    return {"decode_ms": statistics.median(ms) if ms else float("nan"),
            "prefill_ms": statistics.median(f["prefill_ms"] for f in figs),
            "h2d": statistics.mean(x for f in figs for x in f["h2d"]) if ms else 0.0,
            "d2h": statistics.mean(x for f in figs for x in f["d2h"]) if ms else 0.0,
            "routed": statistics.mean(x for f in figs for x in f["routed"]) if any(f["routed"] for f in figs) else None}


def crossover(decode_ms: dict[int, dict[str, float]], mover: str = "packet", host: str = HOST) -> int | None:
    """The first batch from which `mover` (a packet) decodes at least as fast as `host` (host-experts)
    at every larger batch measured (None: never within the batches given). Pure."""
    batches = sorted(b for b, d in decode_ms.items() if mover in d and host in d)
    for i, b in enumerate(batches):
        if all(decode_ms[c][mover] <= decode_ms[c][host] for c in batches[i:]):
            return b
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--continuation", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="host threads (host-experts' arithmetic)")
    ap.add_argument("--conditions", default=",".join(DEFAULT))
    ap.add_argument("--n-cpu-moe", type=int, default=None,
                    help="llama-cpp conditions: the layers whose experts stay in host memory (default: every layer)")
    ap.add_argument("--cache", type=Path, default=Path("moe-peers-cache"),
                    help="llama-cpp conditions: where the GGUF conversion is kept")
    ap.add_argument("--hot", type=int, default=0,
                    help="also host-experts with this many experts a layer held on the device (condition host-hot)")
    a = ap.parse_args(argv)
    known = {**CONDITIONS, **({"host-hot": ("host-experts", {"hot": a.hot})} if a.hot else {})}
    if a.threads:
        torch.set_num_threads(a.threads)
    names = a.conditions.split(",") + (["host-hot"] if a.hot else [])
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    conditions = {n: known[n] for n in names}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = CpuFirstMoE(a.model, dtype=getattr(torch, a.dtype), device=device)
    print(f"{a.model}: {model.family}, {model.host.experts} experts x {model.host.expert_bytes / 2**20:.2f} MiB, "
          f"{sum(model.host.has_experts(i) for i in range(model.host.layers))} MoE layers, {a.dtype}, on {device}, "
          f"{torch.get_num_threads()} host threads; loaded in {time.perf_counter() - t0:.1f} s; "
          f"{a.prefix} + {a.continuation} tokens a sequence, {a.rounds} scored rounds", flush=True)
    head = (f"{'B':>3} {'condition':<13} {'state':<5} {'decode ms/call':>14} {'ms/token':>9} {'prefill ms':>10} "
            f"{'h2d MB/call':>11} {'d2h KB/call':>11} {'experts/layer':>13}  against {REFERENCE}")
    print(head, flush=True)
    decode_ms: dict[int, dict[str, float]] = {}
    for b in (int(x) for x in a.batches.split(",")):
        try:
            llama = llama_models(a.model, names, conditions=conditions, dtype=getattr(torch, a.dtype), device=device,
                                 batch=b, capacity=a.prefix + a.continuation,
                                 n_cpu_moe=model.host.layers if a.n_cpu_moe is None else a.n_cpu_moe, cache=a.cache)
        except PackbenchError as e:  # the extra missing, a placement refused: one line
            raise SystemExit(f"error: {e}") from None
        try:
            res = run_batch(model, b, conditions=conditions, prefix=a.prefix, continuation=a.continuation,
                            rounds=a.rounds, llama=llama)
        finally:
            for m in llama.values():
                m.release()
        decode_ms[b] = {}
        for n in names:
            c = res["cold"][n]
            if "error" in c:
                print(f"{b:3d} {n:<13} {'cold':<5} {c['error']}", flush=True)
                continue
            for state, s in (("cold", summary([c])), ("warm", summary(res["warm"][n]))):
                routed = "-" if s["routed"] is None else f"{s['routed']:.2f}"
                print(f"{b:3d} {n:<13} {state:<5} {s['decode_ms']:14.3f} {s['decode_ms'] / b:9.3f} "
                      f"{s['prefill_ms']:10.2f} {s['h2d'] / 1e6:11.3f} {s['d2h'] / 1e3:11.3f} {routed:>13}  "
                      f"{res['verdict'][n] if state == 'warm' else ''}", flush=True)
                if state == "warm":
                    decode_ms[b][n] = s["decode_ms"]
    pairs = [(m, HOST) for m in MOVERS if m in names and HOST in names]
    pairs += [("llama-cpp-po", "llama-cpp")] if {"llama-cpp-po", "llama-cpp"} <= set(names) else []
    for mover, host in pairs:
        at = crossover(decode_ms, mover, host)
        ratios = "  ".join(f"B={b}: {d[host] / d[mover]:.2f}x" for b, d in sorted(decode_ms.items())
                           if mover in d and host in d)
        print(f"{host} / {mover} decode time per call: {ratios}")
        print(f"crossover: {mover + ' faster from batch ' + str(at) if at is not None else mover + ' never faster'} "
              f"than {host} (decode, warm medians; {device})")


if __name__ == "__main__":
    main()
