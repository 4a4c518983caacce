"""The LRU row cache's decisions on hand-built activity sequences."""

import numpy as np

from packbench.engine.policies.host_gather import lru_plan


def run(sequence, *, ffn=10, slots=3):
    slot_of = np.full(ffn, -1, dtype=np.int64)
    last_used = np.full(slots, -1, dtype=np.int64)
    out = []
    for now, active in enumerate(sequence):
        hit_rows, hit_slots, miss_rows, fill_rows, fill_slots = lru_plan(slot_of, last_used, np.array(active), now)
        out.append((hit_rows.tolist(), miss_rows.tolist(), fill_rows.tolist()))
        cached = sorted(np.nonzero(slot_of >= 0)[0].tolist())
        assert len(cached) <= slots and len(set(slot_of[cached].tolist())) == len(cached)
    return out, slot_of


def test_cold_cache_misses_then_hits():
    out, _ = run([[1, 2], [1, 2]])
    assert out == [([], [1, 2], [1, 2]), ([1, 2], [], [])]


def test_least_recently_used_is_evicted():
    out, slot_of = run([[1, 2, 3], [1, 2], [4], [3]])
    assert out[2] == ([], [4], [4])  # 3 was used longest ago: 4 takes its slot
    assert out[3] == ([], [3], [3])  # so 3 misses now, and evicts 1 (older than 2)
    assert sorted(np.nonzero(slot_of >= 0)[0].tolist()) == [2, 3, 4]


def test_more_misses_than_slots_keep_the_last_ones():
    out, slot_of = run([[0, 1, 2, 3, 4, 5]])
    assert out[0] == ([], [0, 1, 2, 3, 4, 5], [3, 4, 5])
    assert sorted(np.nonzero(slot_of >= 0)[0].tolist()) == [3, 4, 5]


def test_hits_of_this_call_are_evicted_last():
    out, slot_of = run([[1], [2], [3], [3, 7]])
    # slots: 1 (t0), 2 (t1), 3 (t2); call 3 hits 3 and misses 7: 1, the oldest, goes.
    assert out[3] == ([3], [7], [7])
    assert sorted(np.nonzero(slot_of >= 0)[0].tolist()) == [2, 3, 7]
