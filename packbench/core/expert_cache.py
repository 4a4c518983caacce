"""Expert caches and forecasts as decisions, torch-free: what the engine's `expert-cache` and
`expert-forecast` policies keep, fetch and waste, and Belady's optimal bound for the same
capacity. The engine (engine/moe/policies.py) takes every decision through this module, so a
weightless replay of the same routing (a trace, `packbench simulate`) counts exactly what the
engine counted, and the auditor recomputes an archive's figures from its recorded routing.

A **request** is one call's routed set in one layer: the distinct experts any token of the call
was routed to (a decode call at batch 1: its k experts; a prefill: the prompt's union). Every
expert of a request must be on the device during the call; a cache of `capacity` experts per
layer decides which of them stay for later calls.

- `LayerCache(capacity, rule)`, `step(routed) -> CacheStep(hits, misses, evicted)`: hits are the
  routed experts the cache held before the call; misses are fetched (in the call's packet).
  After the call the cache holds the `capacity` experts that rank highest among those it held
  and those just routed (every one of them is on the device: keeping one costs no transfer),
  ranked by the rule's key, larger first:
  - `lru`: (last call that routed it, -id): the most recently routed; among experts routed in
    the same call, the lower id is kept;
  - `lfu`: (calls that routed it since the cache was made, last call that routed it, -id): the
    most often routed, counting every call since the start (an evicted expert keeps its count,
    so a popular expert returns); ties go to the more recent, then to the lower id.
  An expert that ranks below the cache's own is not admitted (a miss that stays a miss), so
  `evicted` lists only experts that were cached before the call.
- `belady_hits(requests, capacity)`: the most hits any cache of `capacity` experts could have had
  on the same requests, knowing the future: after each request keep the experts (among those held
  and those just routed) whose next request comes soonest (ties: the lower id; experts never
  requested again last). With the admission choice above this greedy choice is optimal: swapping a
  kept expert for one requested sooner never loses a hit (tests/core/test_expert_cache.py checks
  it against exhaustive search on small traces). `belady_by_phase`: per phase, the run that makes
  the most hits in that phase's calls (the decode figures' bound).
- `lru_hits` / `lfu_hits`: the `LayerCache` over a list of requests, summed.
- `forecast_step(forecast, cached, routed) -> ForecastStep(prefetched, used, wasted)`: a forecast
  prefetches what it predicts and the cache does not hold; `used` are the prefetched experts the
  call routed to, `wasted` the ones it did not (moved for nothing). The cache steps on the routed
  set alone: a wasted prefetch is never admitted.

- `episode_figures(routes, phases, capacity=, rule=, forecasts=)`: an episode's totals (every
  call and decode calls: routed, hits, misses, prefetched, used, wasted, Belady's hits, and the
  hit, Belady and ready rates) replayed from its recorded routing; the engine writes them into
  the episode record's `experts` section and `figure_problems(experts, calls)` is the auditor's
  check of that section against its own replay and the call ledger.

A request's bytes: misses plus prefetched experts move host-to-device, each `expert_bytes`;
hits move nothing (engine/moe/policies.py copies them on the device). hits + misses = routed.

Layer rule: core. Pure Python, no imports outside the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CACHE_RULES = ("lru", "lfu")


@dataclass(frozen=True)
class CacheStep:
    """One request's outcome: each a sorted tuple of expert ids."""

    hits: tuple[int, ...]
    misses: tuple[int, ...]
    evicted: tuple[int, ...]


@dataclass(frozen=True)
class ForecastStep:
    """One forecast's outcome: prefetched = used + wasted, sorted tuples of expert ids."""

    prefetched: tuple[int, ...]
    used: tuple[int, ...]
    wasted: tuple[int, ...]


def _routed_set(routed: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({int(e) for e in routed}))


class LayerCache:
    """One layer's cache of `capacity` experts under `rule` (module docstring: the ranking and its
    tie-break). `cached` is what it holds now, `step(routed)` one call."""

    def __init__(self, capacity: int, rule: str = "lru") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")
        if rule not in CACHE_RULES:
            raise ValueError(f"rule must be one of {', '.join(CACHE_RULES)}, got {rule!r}")
        self.capacity, self.rule = capacity, rule
        self.clock = 0  # calls stepped
        self.last: dict[int, int] = {}  # expert -> the last call that routed it
        self.count: dict[int, int] = {}  # expert -> calls that routed it
        self._held: set[int] = set()

    @property
    def cached(self) -> frozenset[int]:
        return frozenset(self._held)

    def _key(self, e: int) -> tuple:
        if self.rule == "lru":
            return (self.last[e], -e)
        return (self.count[e], self.last[e], -e)

    def step(self, routed: Iterable[int]) -> CacheStep:
        """Serve one call's routed set, then keep the best `capacity` of held + routed."""
        need = _routed_set(routed)
        self.clock += 1
        hits = tuple(e for e in need if e in self._held)
        misses = tuple(e for e in need if e not in self._held)
        for e in need:
            self.last[e] = self.clock
            self.count[e] = self.count.get(e, 0) + 1
        candidates = self._held | set(need)
        keep = set(sorted(candidates, key=self._key, reverse=True)[:self.capacity])
        evicted = tuple(sorted(self._held - keep))
        self._held = keep
        return CacheStep(hits=hits, misses=misses, evicted=evicted)


def cache_hits(requests: Sequence[Iterable[int]], capacity: int, rule: str = "lru") -> tuple[int, int]:
    """(hits, routed) of a fresh `LayerCache(capacity, rule)` over `requests`."""
    cache = LayerCache(capacity, rule)
    hits = total = 0
    for r in requests:
        s = cache.step(r)
        hits += len(s.hits)
        total += len(s.hits) + len(s.misses)
    return hits, total


def lru_hits(requests: Sequence[Iterable[int]], capacity: int) -> tuple[int, int]:
    """(hits, routed) of an LRU cache of `capacity` experts over `requests`."""
    return cache_hits(requests, capacity, "lru")


def lfu_hits(requests: Sequence[Iterable[int]], capacity: int) -> tuple[int, int]:
    """(hits, routed) of an LFU cache of `capacity` experts over `requests`."""
    return cache_hits(requests, capacity, "lfu")


def belady_hits(requests: Sequence[Iterable[int]], capacity: int) -> tuple[int, int]:
    """(hits, routed) of Belady's optimal cache of `capacity` experts over `requests` (module
    docstring): after each request keep the experts whose next request is soonest."""
    sets = [_routed_set(r) for r in requests]
    return sum(belady_per_request(sets, capacity)), sum(len(r) for r in sets)


def belady_per_request(requests: Sequence[Iterable[int]], capacity: int,
                       counted: Sequence[bool] | None = None) -> list[int]:
    """Belady's hits at each request. `counted[t]`: whether request t's hits are the ones to
    maximise (default: every request's); the run is then the most hits over the counted requests
    alone. An expert whose next request is not counted gains nothing by being held until then
    (that request routes it onto the device anyway, free to keep), so it ranks as never requested
    again; with every request counted this is the plain optimum (tests/core/test_expert_cache.py
    checks both against exhaustive search)."""
    sets = [_routed_set(r) for r in requests]
    never = len(sets)
    counts = [True] * len(sets) if counted is None else list(counted)
    # next_use[t][e]: the first request after t that routes e (never: none, or one not counted).
    next_use: list[dict[int, int]] = [{} for _ in sets]
    upcoming: dict[int, int] = {}
    for t in range(len(sets) - 1, -1, -1):
        next_use[t] = {e: upcoming.get(e, never) for e in sets[t]}
        for e in sets[t]:
            upcoming[e] = t if counts[t] else never
    # Only the experts of request t change their next use at t: the others keep theirs.
    held: dict[int, int] = {}  # expert -> its next use
    hits = []
    for t, need in enumerate(sets):
        hits.append(sum(1 for e in need if e in held))
        for e in need:
            held[e] = next_use[t].get(e, never)
        held = dict(sorted(held.items(), key=lambda kv: (kv[1], kv[0]))[:capacity])
    return hits


def belady_by_phase(requests: Sequence[Iterable[int]], phases: Sequence[str], capacity: int) -> list[int]:
    """Per request, the hits of Belady's cache that makes the most hits in calls of that request's
    phase: a phase's sum is the most hits any cache of `capacity` could have had in that phase's
    calls, so it bounds every cache's hits there. Where the only prefill is the first request (every
    episode the engine runs) it is the plain optimum's run (`belady_per_request`) call by call: the
    first request hits nothing in any cache. An episode with a later prefill (a second turn) can
    otherwise have a plain optimum that trades decode hits for prefill hits, below an LFU's decode hits."""
    out = [0] * len(phases)
    for phase in sorted(set(phases)):
        mine = [p == phase for p in phases]
        for t, h in enumerate(belady_per_request(requests, capacity, mine)):
            if mine[t]:
                out[t] = h
    return out


def forecast_step(forecast: Iterable[int], cached: Iterable[int], routed: Iterable[int]) -> ForecastStep:
    """What a forecast moved and whether the call used it: the forecast experts the cache did not
    hold are prefetched; those routed are used, the rest wasted."""
    held, need = set(cached), set(_routed_set(routed))
    prefetched = tuple(e for e in _routed_set(forecast) if e not in held)
    return ForecastStep(prefetched=prefetched, used=tuple(e for e in prefetched if e in need),
                        wasted=tuple(e for e in prefetched if e not in need))


def rate(hits: int, total: int) -> float | None:
    """hits / total, None when nothing was routed."""
    return hits / total if total else None


def episode_figures(routes: Sequence[Sequence[Sequence[int] | None]], phases: Sequence[str], *, capacity: int,
                    rule: str, forecasts: Sequence[Sequence[Sequence[int] | None]] | None = None) -> dict:
    """An episode's cache and forecast figures, replayed from its routing alone.

    `routes[c][l]`: call c's routed experts in layer l (None: a layer without experts);
    `phases[c]`: "prefill" or "decode"; `forecasts[c][l]`: the experts forecast for layer l in
    call c (None: no forecast). Per layer a fresh `LayerCache(capacity, rule)` steps over the
    calls in order, each forecast accounted against the cache before its call; Belady's hits are
    for the same capacity on the same requests, the decode share the most hits in decode calls
    (`belady_by_phase`: the same run where the only prefill is the first call). Totals over every call and over decode calls:
    `routed`, `hits`, `misses`, `prefetched`, `used`, `wasted`, `belady_hits`, and the rates
    `hit_rate`, `belady_rate` and `ready_rate` ((hits + used) / routed: the routed experts already
    on the device when the routing was known, by the cache or the forecast) (None when nothing
    was routed)."""
    layers = max((len(call) for call in routes), default=0)
    keys = ("routed", "hits", "misses", "prefetched", "used", "wasted", "belady_hits")
    total = dict.fromkeys(keys, 0)
    decode = dict.fromkeys(keys, 0)
    per_layer = []
    for layer in range(layers):
        requests = [(c, call[layer]) for c, call in enumerate(routes) if layer < len(call) and call[layer] is not None]
        if not requests:
            continue
        cache = LayerCache(capacity, rule)
        row = dict.fromkeys(keys, 0)
        for c, routed in requests:
            forecast = None if forecasts is None or c >= len(forecasts) else forecasts[c][layer]
            f = forecast_step(forecast, cache.cached, routed) if forecast is not None else ForecastStep((), (), ())
            s = cache.step(routed)
            counts = dict(routed=len(s.hits) + len(s.misses), hits=len(s.hits), misses=len(s.misses),
                          prefetched=len(f.prefetched), used=len(f.used), wasted=len(f.wasted))
            for k, v in counts.items():
                row[k] += v
                total[k] += v
                if phases[c] == "decode":
                    decode[k] += v
        # Belady over the whole episode; the decode share is the most decode hits (`belady_by_phase`).
        row["belady_hits"] = sum(belady_per_request([r for _, r in requests], capacity))
        total["belady_hits"] += row["belady_hits"]
        by_phase = belady_by_phase([r for _, r in requests], [phases[c] for c, _ in requests], capacity)
        decode["belady_hits"] += sum(h for (c, _), h in zip(requests, by_phase) if phases[c] == "decode")
        per_layer.append({"layer": layer, **row})
    out = {**total, "hit_rate": rate(total["hits"], total["routed"]),
           "belady_rate": rate(total["belady_hits"], total["routed"]),
           "ready_rate": rate(total["hits"] + total["used"], total["routed"]),
           "decode": {**decode, "hit_rate": rate(decode["hits"], decode["routed"]),
                      "belady_rate": rate(decode["belady_hits"], decode["routed"]),
                      "ready_rate": rate(decode["hits"] + decode["used"], decode["routed"])},
           "layers": per_layer}
    return out


FIGURE_KEYS = ("routed", "hits", "misses", "prefetched", "used", "wasted", "belady_hits", "hit_rate", "belady_rate",
               "ready_rate", "decode", "layers")


def figure_problems(experts: dict, calls: list[dict]) -> list[str]:
    """What is wrong with an episode record's `experts` section (engine/moe/cache.py), recomputed
    from its routing and the call ledger alone (the auditor's check; empty when it holds):
    the totals are a replay of the recorded routing and forecasts; per call and layer the counted
    hits + misses are the ledger's routed experts, the counted waste is its `rows_wasted`, and it
    moved exactly the prefetched experts plus the misses no forecast brought (`rows_copied`)."""
    try:
        routes, counted = experts["routes"], experts["counted"]
        phases = [c["phase"] for c in calls]
        forecasts = [[None if n is None else n.get("forecast") for n in call] for call in counted]
        replay = episode_figures(routes, phases, capacity=experts["capacity"], rule=experts["rule"],
                                 forecasts=forecasts)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        return [f"experts section unreadable ({type(e).__name__}: {e})"]
    out = [f"experts {k} {experts.get(k)!r} is not the replay of its routing's {replay[k]!r}"
           for k in FIGURE_KEYS if experts.get(k) != replay[k]]
    if len(counted) != len(calls) or len(routes) != len(calls):
        return out + [f"experts holds {len(routes)} calls' routing for {len(calls)} calls"]
    for c, (call, per_layer) in enumerate(zip(calls, counted)):
        for layer, n in enumerate(per_layer):
            if n is None or call["active_rows"][layer] is None:
                continue  # a layer without experts, or a ledger not recorded (`recording: false`)
            where = f"call {c} layer {layer}"
            if n["hits"] + n["misses"] != call["active_rows"][layer]:
                out.append(f"experts {where}: hits + misses {n['hits'] + n['misses']} != routed "
                           f"{call['active_rows'][layer]}")
            moved = n.get("prefetched", 0) + n["misses"] - n.get("used", 0)
            if moved != call["rows_copied"][layer]:
                out.append(f"experts {where}: prefetched + misses - used {moved} != rows_copied "
                           f"{call['rows_copied'][layer]}")
            if n.get("wasted", 0) != call.get("rows_wasted", [0] * len(per_layer))[layer]:
                out.append(f"experts {where}: wasted {n.get('wasted', 0)} != rows_wasted")
    return out[:5]
