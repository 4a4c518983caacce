"""core/expert_cache.py against hand counts: LRU, LFU and Belady on traces small enough to count,
their tie-breaks, and Belady against exhaustive search (the optimum it claims to be)."""

from itertools import combinations

import numpy as np
import pytest

from packbench.core.expert_cache import (CacheStep, ForecastStep, LayerCache, belady_by_phase, belady_hits,
                                         belady_per_request, cache_hits, episode_figures, forecast_step, lfu_hits,
                                         lru_hits, rate)


def test_cycle_one_longer_than_the_cache():
    cycle = [[1], [2], [3], [1], [2], [3]]
    assert lru_hits(cycle, 2) == (0, 6)  # LRU's worst case: every request evicts the next one needed
    assert lfu_hits(cycle, 2) == (0, 6)  # equal counts fall back to recency: LFU degrades to LRU here
    # Belady keeps 1 and 2 past request 3 (3 is needed last): hits on the second 1 and 2.
    assert belady_hits(cycle, 2) == (2, 6)


def test_a_call_routed_set_is_served_together():
    # A call's experts are on the device together: at [3, 1], 1 is a hit (it was cached) and the
    # cache then keeps 1 and 3 (both routed in the last call) over 2. A per-expert replay would
    # let 3 evict 1 before 1 is looked up (that would give 2 hits).
    repeat = [[1, 2], [1, 2], [3, 1]]
    assert lru_hits(repeat, 2) == (3, 6)
    cache = LayerCache(2, "lru")
    steps = [cache.step(r) for r in repeat]
    assert steps == [CacheStep(hits=(), misses=(1, 2), evicted=()), CacheStep(hits=(1, 2), misses=(), evicted=()),
                     CacheStep(hits=(1,), misses=(3,), evicted=(2,))]
    assert cache.cached == {1, 3}
    assert belady_hits(repeat, 2) == (3, 6)


def test_lfu_keeps_the_popular_expert_and_does_not_admit_a_rarer_one():
    trace = [[1], [1], [2], [1]]
    # LRU: 2 replaces 1 at the third call, so the last 1 misses.
    assert lru_hits(trace, 1) == (1, 4)
    # LFU: 1 was routed twice, 2 once: 2 is fetched for its call but not admitted (no eviction).
    cache = LayerCache(1, "lfu")
    steps = [cache.step(r) for r in trace]
    assert steps[2] == CacheStep(hits=(), misses=(2,), evicted=())
    assert steps[3] == CacheStep(hits=(1,), misses=(), evicted=())
    assert lfu_hits(trace, 1) == (2, 4)
    assert belady_hits(trace, 1) == (2, 4)


def test_tie_breaks():
    # LRU, experts routed in the same call: the lower id is kept (3 over 5).
    assert lru_hits([[3, 5], [3]], 1) == (1, 3)
    assert lru_hits([[3, 5], [5]], 1) == (0, 3)
    # LFU, equal counts: the more recent is kept (2 over 1), evicting 1.
    cache = LayerCache(1, "lfu")
    cache.step([1])
    assert cache.step([2]) == CacheStep(hits=(), misses=(2,), evicted=(1,))
    # LFU, equal counts and recency: the lower id.
    assert lfu_hits([[7, 4], [4]], 1) == (1, 3)
    # Belady, equal next use (both routed again in the next call): the lower id is kept, and hit.
    assert belady_hits([[3, 5], [3, 5]], 1) == (1, 4)


def test_capacity_bounds():
    trace = [[0, 1], [1, 2], [0, 2], [3]]
    for fn in (lru_hits, lfu_hits, belady_hits):
        assert fn(trace, 0) == (0, 7)  # capacity 0: every routed expert is a miss
        # Capacity >= every expert: each expert misses once (its first call), then always hits.
        assert fn(trace, 4) == (7 - 4, 7)
    # Duplicates within a request count once (a call's routed set).
    assert lru_hits([[2, 2, 2], [2]], 1) == (1, 2)


def test_layer_cache_refuses_bad_parameters():
    with pytest.raises(ValueError, match="capacity must be an integer >= 0"):
        LayerCache(-1)
    with pytest.raises(ValueError, match="rule must be one of lru, lfu"):
        LayerCache(2, "fifo")


def _exhaustive(requests: list[list[int]], capacity: int, counted: list[bool] | None = None) -> int:
    """The most hits of any cache: after each request, any subset of held + routed of size <= c;
    with `counted`, the most hits over the counted requests alone."""
    states = {frozenset(): 0}
    for t, need in enumerate(requests):
        need = set(need)
        nxt: dict[frozenset, int] = {}
        for held, hits in states.items():
            hits += len(need & held) if counted is None or counted[t] else 0
            pool = sorted(held | need)
            for size in range(min(capacity, len(pool)) + 1):
                for keep in combinations(pool, size):
                    key = frozenset(keep)
                    nxt[key] = max(nxt.get(key, -1), hits)
        states = nxt
    return max(states.values())


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_the_optimum_and_bounds_lru_and_lfu(seed):
    # A greedy that is not optimal (e.g. one that keeps the later next use on a tie of sizes, or
    # that must admit every miss) loses to the exhaustive search on some of these traces.
    rng = np.random.default_rng(seed)
    experts, capacity = 5, 1 + seed % 3
    trace = [sorted(rng.choice(experts, int(rng.integers(1, 4)), replace=False).tolist()) for _ in range(7)]
    best = belady_hits(trace, capacity)[0]
    assert best == _exhaustive(trace, capacity)
    assert best >= lru_hits(trace, capacity)[0] and best >= lfu_hits(trace, capacity)[0]


@pytest.mark.parametrize("seed", range(12))
def test_belady_of_the_counted_requests_is_their_optimum(seed):
    """Catches a Belady that maximises hits over some requests only (one phase's) by ranking an
    expert by its next counted request: an uncounted request in between routes it onto the
    device anyway, so holding it until then wins nothing (that ranking lost to exhaustive search)."""
    rng = np.random.default_rng(100 + seed)
    experts = 5
    trace = [sorted(rng.choice(experts, int(rng.integers(0, 5)), replace=False).tolist()) for _ in range(8)]
    counted = [bool(b) for b in rng.random(8) < 0.6]
    for capacity in range(experts + 1):
        hits = belady_per_request(trace, capacity, counted)
        assert sum(h for h, c in zip(hits, counted) if c) == _exhaustive(trace, capacity, counted), capacity
        assert belady_per_request(trace, capacity, [True] * 8) == belady_per_request(trace, capacity)


def test_decode_belady_bounds_every_cache_after_a_second_prefill():
    """An episode whose second turn is a prefill after decode calls: the plain optimum's run
    (2 prefill + 5 decode = 7 hits) keeps 1 for the second prefill, so its decode share was 5 where
    LFU hits 6 times in decode calls; the table showed LFU's decode hit% above Belady's."""
    routes = [[[0, 2]], [[0, 2]], [[0, 1, 2]], [[0, 1]], [[0, 2]]]
    phases = ["prefill", "decode", "decode", "prefill", "decode"]
    requests = [r[0] for r in routes]
    assert belady_per_request(requests, 2) == [0, 2, 2, 2, 1]
    assert belady_by_phase(requests, phases, 2) == [0, 2, 2, 2, 2]  # decode 6, prefill 2: each phase's optimum
    lfu = episode_figures(routes, phases, capacity=2, rule="lfu")
    lru = episode_figures(routes, phases, capacity=2, rule="lru")
    assert (lfu["decode"]["hits"], lru["decode"]["hits"], lfu["decode"]["belady_hits"]) == (6, 5, 6)
    assert (lfu["belady_hits"], lfu["decode"]["routed"]) == (7, 7)  # the total stays the plain optimum
    assert lfu["decode"]["belady_rate"] == pytest.approx(6 / 7) == lfu["decode"]["hit_rate"]


@pytest.mark.parametrize("seed", range(6))
def test_each_phase_belady_bounds_lru_and_lfu_and_is_the_plain_run_after_one_prefill(seed):
    rng = np.random.default_rng(200 + seed)
    for _ in range(40):
        n = int(rng.integers(1, 8))
        requests = [sorted(rng.choice(5, int(rng.integers(1, 5)), replace=False).tolist()) for _ in range(n)]
        phases = [str(p) for p in rng.choice(["prefill", "decode"], n)]
        for capacity in range(1, 5):
            bound = belady_by_phase(requests, phases, capacity)
            for rule in ("lru", "lfu"):
                cache = LayerCache(capacity, rule)
                hits = [len(cache.step(r).hits) for r in requests]
                for phase in ("prefill", "decode"):
                    mine = [p == phase for p in phases]
                    assert sum(h for h, m in zip(hits, mine) if m) <= sum(b for b, m in zip(bound, mine) if m)
                    assert sum(b for b, m in zip(bound, mine) if m) == _exhaustive(requests, capacity, mine)
            # A screen's episode (one prefill, first): call by call the plain optimum's run.
            single = ["prefill"] + ["decode"] * (n - 1)
            assert belady_by_phase(requests, single, capacity) == belady_per_request(requests, capacity)


def test_forecast_accounting_by_hand():
    # Forecast 1, 2, 5; the cache holds 2 (not prefetched); the call routes 1 and 3: 1 was
    # prefetched and used, 5 prefetched and wasted, 3 must still be fetched.
    assert forecast_step([5, 1, 2], {2}, [3, 1]) == ForecastStep(prefetched=(1, 5), used=(1,), wasted=(5,))
    assert forecast_step([], set(), [0]) == ForecastStep((), (), ())


def test_cache_hits_and_rate():
    assert cache_hits([[0], [0]], 1, "lfu") == (1, 2)
    assert rate(1, 4) == 0.25 and rate(0, 0) is None
