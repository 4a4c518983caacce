"""Which expert-cache rule could close the gap to Belady's bound: a replay study on the CPU.

The engine's caches (core/expert_cache.py: LRU and LFU) stay 16-25 points under Belady's optimum
on the MoE shapes (docs/benchmarks.md, "MoE expert caches and forecasts"). This replays other
rules on the same requests and says how much of the LRU-to-Belady gap each closes. Every rule
keeps, after each call, the `capacity` experts ranking highest among those it held and those the
call routed (the admission of core/expert_cache.py's LayerCache), using only what a runtime knows
then, except the two bounds:

- `lru`, `lfu`: the engine's own rules (`LayerCache`).
- `lru-2`: LRU-K with K = 2 (O'Neil, O'Neil and Weikum, SIGMOD 1993): rank by the second-last call
  that routed the expert (never twice: first), then by the last.
- `lrfu-L`: decayed frequency (Lee et al., IEEE ToC 2001): the sum of L^age over the calls that
  routed the expert; L near 0 is LRU, L = 1 is LFU.
- `score-A`: the router's softmax probabilities, every expert's, averaged over calls with weight A
  on the call just served (A = 1: that call's alone). Routers score every expert, not only the
  routed ones: an expert ranked just below the top k is kept over one routed long ago.
- `next-call` (not a rule: it sees the future): knows the next call's routed set and keeps those
  experts first, the rest by recency; what perfect foresight of one call adds to LRU. Whatever
  stays between it and Belady needs a longer future, or a better order for the slots the next
  call does not fill (which `score-A` can beat it on).
- `belady`: the optimum for the capacity (core/expert_cache.py `belady_per_request`).

Routing comes from one of two sources:
  python -m bench.cache_policies --shape mixtral-8x7b --layers 4 --shrink 32 --count 3 --prefix 512 --capacities 2,4,6
      a proxy of a real MoE shape (bench/moe_routing_proxy.py: the real routers, experts narrowed by
      --shrink), stock transformers' forward over generated prompts (BOS + uniform ids, seeded);
      each token one request, as a decode call at batch 1 routes it; every rule.
  python -m bench.cache_policies --trace moe.trace --capacities 2,4
      a packbench trace (docs/traces.md): each episode's decode calls per layer, routed sets only,
      so every rule but `score-A`.
Hit rates are summed over every layer and prompt (or episode); each layer's cache starts empty.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from packbench.core.expert_cache import belady_hits, cache_hits

LRFU_DECAYS = (0.5, 0.9)
SCORE_WEIGHTS = (1.0, 0.3)


def _replay(requests: Sequence[Sequence[int]], capacity: int, observe: Callable[[int, set[int]], None],
            key: Callable[[int, int], tuple]) -> int:
    """Hits of a cache that, after call t, first lets the rule `observe(t, routed)`, then keeps
    the `capacity` experts of held + routed with the largest `key(t, expert)`."""
    held: set[int] = set()
    hits = 0
    for t, request in enumerate(requests):
        need = set(int(e) for e in request)
        hits += len(need & held)
        observe(t, need)
        held = set(sorted(held | need, key=lambda e: key(t, e), reverse=True)[:capacity])
    return hits


def lru2_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """LRU-2: rank by (second-last call that routed it, last call, -id); routed once: -1."""
    seen: dict[int, tuple[int, int]] = {}

    def observe(t: int, need: set[int]) -> None:
        for e in need:
            seen[e] = (seen.get(e, (-1, -1))[1], t)

    return _replay(requests, capacity, observe, lambda t, e: (*seen[e], -e))


def lrfu_hits(requests: Sequence[Sequence[int]], capacity: int, decay: float) -> int:
    """LRFU: rank by sum over the calls that routed it of decay ** (t - call), then last, -id."""
    value: dict[int, tuple[float, int]] = {}  # expert -> (decayed count at its last call, last call)

    def observe(t: int, need: set[int]) -> None:
        for e in need:
            v, last = value.get(e, (0.0, t))
            value[e] = (v * decay ** (t - last) + 1.0, t)

    def key(t: int, e: int) -> tuple:
        v, last = value[e]
        return (v * decay ** (t - last), last, -e)

    return _replay(requests, capacity, observe, key)


def score_hits(requests: Sequence[Sequence[int]], probs: np.ndarray, capacity: int, weight: float) -> int:
    """Rank by the running average of the router's probabilities, `weight` on the call just
    served (`probs[t]`: call t's probability per expert), then -id."""
    avg = np.zeros(probs.shape[1])

    def observe(t: int, need: set[int]) -> None:
        nonlocal avg
        avg = (1.0 - weight) * avg + weight * probs[t]

    return _replay(requests, capacity, observe, lambda t, e: (float(avg[e]), -e))


def next_call_hits(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """The one-call-ahead bound: keep the next call's experts first, then by recency, then -id."""
    last: dict[int, int] = {}
    upcoming = [set(int(e) for e in r) for r in requests[1:]] + [set()]

    def observe(t: int, need: set[int]) -> None:
        for e in need:
            last[e] = t

    return _replay(requests, capacity, observe, lambda t, e: (e in upcoming[t], last[e], -e))


def rule_hits(requests: Sequence[Sequence[int]], capacity: int, probs: np.ndarray | None = None) -> dict[str, int]:
    """Every rule's hits on one layer's requests (`probs`: the router's probabilities per call,
    or None: the score rules are left out)."""
    out = {"lru": cache_hits(requests, capacity, "lru")[0], "lfu": cache_hits(requests, capacity, "lfu")[0],
           "lru-2": lru2_hits(requests, capacity)}
    for d in LRFU_DECAYS:
        out[f"lrfu-{d:g}"] = lrfu_hits(requests, capacity, d)
    if probs is not None:
        for w in SCORE_WEIGHTS:
            out[f"score-{w:g}"] = score_hits(requests, probs, capacity, w)
    out["next-call"] = next_call_hits(requests, capacity)
    out["belady"] = belady_hits(requests, capacity)[0]
    return out


def gap_closed(hits: int, lru: int, belady: int) -> float | None:
    """The share of LRU's gap to Belady a rule closes (negative: worse than LRU); None: no gap."""
    return (hits - lru) / (belady - lru) if belady > lru else None


def study(streams: Sequence[tuple[list[list[int]], np.ndarray | None]], capacities: Sequence[int]) -> dict:
    """Per capacity, every rule's hits summed over `streams` (one layer of one prompt or episode
    each: its requests and router probabilities or None), the routed total, hit rates and the gap
    closed. The score rules only where every stream has probabilities."""
    with_scores = all(probs is not None for _, probs in streams)
    out = {}
    for c in capacities:
        hits: dict[str, int] = {}
        routed = 0
        for requests, probs in streams:
            routed += sum(len(set(r)) for r in requests)
            for rule, h in rule_hits(requests, c, probs if with_scores else None).items():
                hits[rule] = hits.get(rule, 0) + h
        out[c] = {"routed": routed,
                  "rules": {rule: {"hits": h, "hit_rate": h / routed if routed else None,
                                   "gap_closed": gap_closed(h, hits["lru"], hits["belady"])}
                            for rule, h in hits.items()}}
    return out


def proxy_streams(shape: str, layers: int, shrink: int, count: int, prefix: int, seed: int):
    """(requests, probabilities) per layer and prompt: stock transformers' forward of a proxy of
    `shape` over `count` generated prompts of `prefix` tokens, each token one request."""
    import torch

    from bench.moe_routing_proxy import proxy_checkpoint
    from packbench.core.files import read_json_object
    from packbench.engine.moe.model import force_eager, load_stock, moe_family

    with tempfile.TemporaryDirectory() as tmp:
        d = proxy_checkpoint(Path(tmp) / "m", shape=shape, layers=layers, shrink=shrink, seed=seed, profile=None)
        model = load_stock(d, family=moe_family(d), dtype=torch.float32)
        vocab = read_json_object(d / "config.json", limit=1 << 20)["vocab_size"]
    force_eager(model.config)
    model.eval()
    seen: dict[int, tuple] = {}
    gates = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers)
             if getattr(getattr(layer, "mlp", None), "experts", None) is not None]
    hooks = [g.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out)) for i, g in gates]
    rng = np.random.Generator(np.random.PCG64(seed))
    streams = []
    try:
        with torch.inference_mode():
            for _ in range(count):
                ids = [1] + rng.integers(2, vocab, prefix - 1).tolist()
                seen.clear()
                model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
                for i, _ in gates:  # the router's output: (logits, top-k scores, top-k ids)
                    logits, _scores, top = seen[i]
                    probs = torch.softmax(logits.reshape(prefix, -1).float(), dim=-1).numpy()
                    streams.append((top.reshape(prefix, -1).tolist(), probs))
    finally:
        for h in hooks:
            h.remove()
    return streams


def trace_streams(path: Path):
    """(requests, None) per layer and episode of a packbench trace: its decode calls' routed sets."""
    from packbench.core.trace import read_trace

    trace = read_trace(path)
    streams = []
    for calls in trace.episodes():
        decode = [c for c in calls if trace.calls[c].phase == "decode"]
        for layer in range(trace.model.layers):
            if layer in trace.model.layers_without_units:
                continue
            streams.append(([trace.sets[c][layer].tolist() for c in decode], None))
    return streams


def table(result: dict) -> list[str]:
    lines = ["| capacity | rule | hit % | gap to Belady closed |", "| ---: | --- | ---: | ---: |"]
    for c, row in result.items():
        for rule, r in row["rules"].items():
            gap = "-" if r["gap_closed"] is None or rule in ("lru", "belady") else f"{round(100 * r['gap_closed'])} %"
            rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}"  # nothing routed in a decode call
            lines.append(f"| {c} | {rule} | {rate} | {gap} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="a real MoE shape (core/moe.py MOE_SHAPES) to proxy")
    src.add_argument("--trace", type=Path, help="a packbench trace file")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shrink", type=int, default=32)
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacities", required=True, help="comma-separated experts per layer, e.g. 2,4,6")
    ap.add_argument("--json", type=Path, default=None, help="Also write every figure here.")
    a = ap.parse_args(argv)
    try:
        capacities = [int(c) for c in a.capacities.split(",")]
    except ValueError:
        ap.error(f"--capacities must be comma-separated integers, got {a.capacities!r}")
    if any(c < 1 for c in capacities):
        ap.error("every capacity must be at least 1")
    if a.shape:
        streams = proxy_streams(a.shape, a.layers, a.shrink, a.count, a.prefix, a.seed)
        what = (f"{a.shape} proxy (intermediate / {a.shrink}), {a.layers} layers, seed {a.seed}, "
                f"{a.count} x {a.prefix} generated tokens, each token a request")
    else:
        from packbench.core.trace import TraceError

        try:
            streams = trace_streams(a.trace)
        except TraceError as e:  # a missing, damaged or hostile file: its one line, not a traceback
            ap.error(f"--trace: {e}")
        what = f"{a.trace}: decode calls of every episode and layer"
    result = study(streams, capacities)
    print(what)
    print("\n".join(table(result)))
    if a.json:
        a.json.write_text(json.dumps({"source": what, "capacities": result}, indent=1))


if __name__ == "__main__":
    main()
