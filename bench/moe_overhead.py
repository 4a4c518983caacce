"""The engine's fixed costs per MoE decode call beyond compute and bytes, measured on a machine:
the `overhead_us` of a machine file (docs/traces.md, "Time: machines and the model";
core/simulate.py overhead_ms).

What a decode call pays per MoE layer, read from the engine (engine/moe/model.py, policies.py,
cache.py), besides the resident expert loop (the compute) and the bytes:

- `packet` (device gather): the routing read back (bincount, nonzero, a device-to-host copy: the
  layer synchronises), the ledger, then per expert moved its two copies (gate_up, down slices) issued
  one by one;
- `dense-stream`: two copies of the whole layer;
- `expert-cache`: the readback, `LayerCache.step`, the slots' bookkeeping, per expert fetched its
  copies into a slot or the workspace, and per routed expert a read through `_ExpertView` (the
  expert loop's index made a Python int: one more synchronisation per expert and weight);
- `forecast`: the next layer's router applied to this layer's input, its top-k read back (a
  synchronisation), the prefetch issued on a side stream, per prefetched expert its copies.

This script drives those very code paths (a `CpuFirstMoE` and its policies) on a synthetic
Qwen3-MoE layer set whose experts are tiny (12 KiB: bytes negligible, and subtracted at the copy
rate measured here), calling each layer's experts module as the model's forward does, one token a
call, with routings it chooses: k = 1, 2, 4, 8 experts a layer (so a per-layer and a per-expert
cost separate), and for the cache (LRU, CAPACITY slots) the same experts every call (all hits) or
a rotation through all of them (all misses). Per call, the median time less resident's on the same
routing, less the bytes at the copy rate, is fitted by least squares against the engine's own
counts of that call (layers, experts moved, routed, prefetched, forecasts):

  packet, dense-stream: layers x layer_us + moved x moved_us
  expert-cache:         layers x layer_us + fetched x moved_us + routed x routed_us
  forecast:             (cache with forecast) - (cache without), less the fetches it saved:
                        forecasts x layer_us + prefetched x moved_us

It never runs a checkpoint, a protocol or the conditions a prediction is for. Prints the
machine-file fragment {"overhead_us": ...} (JSON, every value with its source) on stdout, the fits
on stderr. A negative fit is written as 0 and said so in its source.

Usage:  python -m bench.moe_overhead [--device cuda] [--calls 40] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

KS = (1, 2, 4, 8)


def copy_rate(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Host-to-device bytes per second (median of `repeats` copies of `nbytes`): from pinned
    memory on CUDA (bench/moe.py pinned_rate's method), a host memcpy on the CPU."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):  # the first warms the pages and the copy engine
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=device.type == "cuda")
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace(" ", "-")
    import platform

    return f"cpu-{platform.machine()}"


def tiny_layers(out: Path, *, experts: int, k: int, layers: int) -> Path:
    """A synthetic Qwen3-MoE checkpoint of `layers` layers of `experts` tiny experts, top `k`
    (engine/moe/synth.py's tiny config, random weights: only the code paths matter here)."""
    from packbench.engine.moe.model import model_class
    from packbench.engine.moe.synth import _config

    config, family = _config("qwen3-moe-tiny", layers, "float32")
    config.num_experts, config.num_experts_per_tok = experts, k
    torch.manual_seed(0)
    model_class(family)(config).save_pretrained(out)
    return out


class Bench:
    """One tiny CpuFirstMoE per k, its layers driven call by call under a policy."""

    def __init__(self, model_dir: Path, *, device: torch.device, dtype: torch.dtype, k: int, calls: int) -> None:
        from packbench.engine.moe.model import CpuFirstMoE

        self.model = CpuFirstMoE(model_dir, dtype=dtype, device=device)
        self.device, self.k, self.calls = device, k, calls
        h = self.model.config.hidden_size
        g = torch.Generator().manual_seed(k)
        self.hidden = torch.randn(1, h, generator=g).to(device=device, dtype=dtype)
        self.weights = torch.full((1, k), 1.0 / k, dtype=dtype, device=device)
        self.layers = [i for i, e in enumerate(self.model.experts_modules) if e is not None]
        experts = self.model.host.experts
        warm = 4
        n = calls + warm
        # (1, k) routed ids per call and layer, on the device as a router's top-k would be.
        hit = [[torch.arange(k, device=device).view(1, k) for _ in self.layers] for _ in range(n)]
        miss = [[((torch.arange(k) + (c * k + 3 * i)) % experts).to(device).view(1, k) for i in self.layers]
                for c in range(n)]
        self.routes = {"hit": hit, "miss": miss}
        self.warm = warm

    @torch.inference_mode()
    def run(self, policy, routing: str) -> tuple[float, dict]:
        """(median seconds per call, the engine's mean counts per call) of `policy` on `routing`."""
        m = self.model
        if isinstance(policy, str):
            name, _, gather = policy.partition(":")
            m.use(name, **({"gather": gather} if gather else {}))
        else:
            m.use_policy(policy)
        rec = m.recorder
        times = []
        first = len(rec.calls)
        for c, route in enumerate(self.routes[routing]):
            rec.begin(phase="decode", tokens=1)
            sync(self.device)
            t0 = time.perf_counter()
            for layer, idx in zip(self.layers, route):
                m.experts_modules[layer](self.hidden, idx, self.weights)
            sync(self.device)
            dt = time.perf_counter() - t0
            rec.end(wall_s=dt, logits_d2h_bytes=0)
            if c >= self.warm:
                times.append(dt)
        ledger = rec.calls[first + self.warm:]
        counts = {"layers": len(self.layers),
                  "moved": statistics.mean(sum(c.rows_copied) for c in ledger),
                  "routed": statistics.mean(sum(a or 0 for a in c.active_rows) for c in ledger),
                  "bytes": statistics.mean(sum(c.h2d_weight_bytes) + sum(c.h2d_index_bytes) for c in ledger)}
        counted = getattr(m.slot.policy, "figures", lambda: None)()
        prefetched = forecasts = 0.0
        if counted is not None:
            rows = counted["counted"][first + self.warm:]
            prefetched = statistics.mean(sum(x.get("prefetched", 0) for x in r if x) for r in rows)
            forecasts = statistics.mean(sum("prefetched" in x for x in r if x) for r in rows)
        counts.update(prefetched=prefetched, forecasts=forecasts, fetched=counts["moved"] - prefetched)
        return statistics.median(times), counts


def fit(rows: list[tuple[list[float], float]]) -> tuple[np.ndarray, float]:
    """Least squares of y (us a call) on the features; (coefficients, largest |residual|)."""
    x = np.array([r[0] for r in rows], dtype=float)
    y = np.array([r[1] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef, float(np.abs(x @ coef - y).max())


def measure(*, device: torch.device, dtype: torch.dtype, calls: int, rounds: int, capacity: int, experts: int,
            layers: int, log=print) -> tuple[dict, float]:
    """Every family's per-call overhead over resident at each k, less its bytes at the copy rate:
    ({(family, k, routing): (us, the engine's counts)}, the copy rate in B/s)."""
    from packbench.engine.moe.cache import ExpertCache

    rate = copy_rate(device)
    log(f"copy rate {rate / 1e9:.2f} GB/s ({'pinned host to device' if device.type == 'cuda' else 'host memcpy'})")
    policies = {"packet": lambda: "packet:device", "dense-stream": lambda: "dense-stream",
                "expert-cache": lambda: ExpertCache(capacity=capacity, rule="lru"),
                "cache+forecast": lambda: ExpertCache(capacity=capacity, rule="lru", forecast="on")}
    plan = [("packet", "miss"), ("dense-stream", "miss"), ("expert-cache", "hit"), ("expert-cache", "miss"),
            ("cache+forecast", "miss")]
    samples: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in KS:
            bench = Bench(tiny_layers(Path(tmp) / f"k{k}", experts=experts, k=k, layers=layers), device=device,
                          dtype=dtype, k=k, calls=calls)
            for r in range(rounds):  # each round alternates resident with every policy, rotated
                order = plan[r % len(plan):] + plan[:r % len(plan)]
                for family, routing in order:
                    base, _ = bench.run("resident", routing)
                    t, counts = bench.run(policies[family](), routing)
                    samples.setdefault((family, k, routing), []).append(
                        ((t - base) * 1e6 - counts["bytes"] / rate * 1e6, counts))
            del bench
    out = {key: (statistics.median(v[0] for v in vals), vals[0][1]) for key, vals in samples.items()}
    for (family, k, routing), (us, c) in sorted(out.items()):
        log(f"  {family:15} k={k} {routing:4}: {us:9.1f} us a call over resident ({c['layers']} layers, "
            f"{c['moved']:.1f} moved, {c['routed']:.1f} routed, {c['prefetched']:.1f} prefetched)")
    return out, rate


def overhead(out: dict, *, source: str, log=print) -> dict:
    """The machine-file fragment's `overhead_us` from `measure`'s table."""
    fragment: dict = {}

    def put(family: str, names: tuple[str, ...], coef: np.ndarray, worst: float, how: str) -> None:
        fragment[family] = {}
        for name, v in zip(names, coef):
            note = "" if v >= 0 else f" (fitted {v:.2f}, written as 0)"
            fragment[family][name] = {"value": round(max(float(v), 0.0), 3),
                                      "source": f"{source}: {how}, largest residual {worst:.1f} us a call{note}"}
        log(f"{family}: " + ", ".join(f"{n} {fragment[family][n]['value']}" for n in names)
            + f" (largest residual {worst:.1f} us a call)")

    def rows(family: str, features) -> list:
        return [(features(c), us) for (f, _, _), (us, c) in out.items() if f == family]

    for family in ("packet", "dense-stream"):
        coef, worst = fit(rows(family, lambda c: [c["layers"], c["moved"]]))
        if family == "dense-stream":  # every expert every call: moved is constant, only layers separate
            coef, worst = fit(rows(family, lambda c: [c["layers"]]))
            put(family, ("layer_us",), coef, worst, "per-call time over resident at k 1-8 / layers")
        else:
            put(family, ("layer_us", "moved_us"), coef, worst, "fit over k 1-8 (layers, experts moved)")
    coef, worst = fit(rows("expert-cache", lambda c: [c["layers"], c["fetched"], c["routed"]]))
    put("expert-cache", ("layer_us", "moved_us", "routed_us"), coef, worst,
        "fit over k 1-8, all-hit and all-miss routings (layers, experts fetched, routed)")
    cache = {name: v["value"] for name, v in fragment["expert-cache"].items()}
    diff = []
    for (f, k, routing), (us, c) in out.items():
        if f != "cache+forecast":
            continue
        base_us, b = out[("expert-cache", k, routing)]
        saved = (c["fetched"] - b["fetched"]) * cache["moved_us"]  # the demand fetches a used prefetch spares
        diff.append(([c["forecasts"], c["prefetched"]], us - base_us - saved))
    coef, worst = fit(diff)
    put("forecast", ("layer_us", "moved_us"), coef, worst,
        "fit over k 1-8 of the cache with the forecast less without (forecasts, experts prefetched)")
    return fragment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default float16 on CUDA, float32 on the CPU")
    ap.add_argument("--calls", type=int, default=40, help="timed calls a measurement (after 4 warm-up calls)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of every policy with resident")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=16, help="the cache's slots a layer (LRU)")
    ap.add_argument("--out", type=Path, default=None, help="also write the fragment to this file")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("float16" if device.type == "cuda" else "float32"))
    # One thread on the CPU: the layers' tensors are tiny, and threads only add contention to the
    # fixed costs being measured (a 2-core box's medians moved by hundreds of ms with 8).
    torch.set_num_threads(1 if device.type == "cpu" else min(8, torch.get_num_threads()))

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    table, rate = measure(device=device, dtype=dtype, calls=a.calls, rounds=a.rounds, capacity=a.capacity,
                          experts=a.experts, layers=a.layers, log=log)
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    source = (f"`python -m bench.moe_overhead --device {a.device} --calls {a.calls} --rounds {a.rounds}` "
              f"({a.layers} synthetic qwen3_moe layers x {a.experts} experts of 12 KiB, {dtype}, LRU {a.capacity}; "
              f"median call less resident's on the same routing, less its bytes at {rate / 1e9:.2f} GB/s), "
              f"{machine_name(device)}, {date}")
    fragment = {"overhead_us": overhead(table, source=source, log=log)}
    log(f"measured in {time.perf_counter() - t0:.0f} s")
    text = json.dumps(fragment, indent=1)
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
