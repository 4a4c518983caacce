"""bench.cache_policies: the cache rules it replays beside the engine's, on hand-made requests
whose hits are counted here by hand; its two sources of routing (a proxy's router output, a
trace's decode calls); the share of the LRU-to-Belady gap it reports."""

import random

import numpy as np
import pytest
import torch

from bench import cache_policies as cp
from packbench.core.expert_cache import belady_hits, cache_hits
from packbench.core.trace import Trace, TraceCall, TraceModel, write_trace


def _random_requests(seed: int, n: int = 200, experts: int = 8, k: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(range(experts), k) for _ in range(n)]


def test_the_replay_admits_as_the_engines_cache_does():
    # Catches a replay whose admission differs from LayerCache's (e.g. always admitting the routed
    # experts): its LRU would not be the engine's, and every "gap closed" would compare unlike caches.
    for seed in range(5):
        req = _random_requests(seed)
        for cap in (1, 2, 3, 5):
            last: dict[int, int] = {}

            def observe(t, need):
                for e in need:
                    last[e] = t

            assert cp._replay(req, cap, observe, lambda t, e: (last[e], -e)) == cache_hits(req, cap, "lru")[0]


def test_lru2_keeps_an_expert_routed_twice_over_one_routed_once():
    # cap 1: at call 3 expert 3 (routed once) does not displace expert 1 (routed at calls 0 and 2), so
    # call 4 hits; LRU keeps 3 and never hits. Belady hits at calls 2 and 4. Catches an LRU-2 ranking
    # by the last call (that is LRU) or by the first.
    req = [[1], [2], [1], [3], [1], [2]]
    assert cp.lru2_hits(req, 1) == 1
    assert cache_hits(req, 1, "lru")[0] == 0
    assert belady_hits(req, 1)[0] == 2
    assert cp.gap_closed(1, 0, 2) == 0.5


def test_lrfu_is_lru_near_decay_0_and_lfu_at_decay_1():
    # Catches a decay applied to the wrong age (e.g. since the first call) or not at all. Near 0
    # it is LRU where one expert is routed a call (with two, LRFU breaks a same-call tie by the
    # decayed past where LRU takes the lower id).
    for seed in range(4):
        for cap in (1, 2, 4):
            one = _random_requests(seed, experts=6, k=1)
            assert cp.lrfu_hits(one, cap, 1e-6) == cache_hits(one, cap, "lru")[0]
            req = _random_requests(seed, experts=6)
            assert cp.lrfu_hits(req, cap, 1.0) == cache_hits(req, cap, "lfu")[0]


def test_score_keeps_the_expert_its_router_rates_higher_now():
    # cap 1, weight 1: after call 1 the router rates expert 0 (0.5) over the routed expert 1 (0.4),
    # so the cache keeps 0 and call 2 hits; LRU keeps 1. Catches ranking only the routed experts, or
    # by the previous call's probabilities (which would keep 0 here too, so call 1's are checked
    # by a second case where they disagree).
    req = [[0], [1], [0]]
    probs = np.array([[0.6, 0.1, 0.3], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])
    assert cp.score_hits(req, probs, 1, 1.0) == 1
    assert cache_hits(req, 1, "lru")[0] == 0
    flipped = np.array([[0.6, 0.1, 0.3], [0.35, 0.55, 0.1], [0.9, 0.05, 0.05]])
    assert cp.score_hits(req, flipped, 1, 1.0) == 0
    # weight 0.5: after call 1 the average is 0: 0.325, 1: 0.3, so 0 stays although call 1 rates 1 higher
    assert cp.score_hits(req, flipped, 1, 0.5) == 1


def test_next_call_bound_sees_one_call_ahead_and_no_further():
    # cap 1: [[1], [2], [3], [1]]: the next call never routes what the cache holds, so the bound keeps
    # by recency and misses call 3; Belady keeps 1 throughout. Catches a "next-call" that looks
    # further ahead (it would equal Belady here) or one call too far (off by one).
    req = [[1], [2], [3], [1]]
    assert cp.next_call_hits(req, 1) == 0
    assert belady_hits(req, 1)[0] == 1
    # [[1], [2], [1], [2]]: keeping 1 at call 1 because call 2 routes it hits once
    assert cp.next_call_hits([[1], [2], [1], [2]], 1) == 1
    for seed in range(4):  # foresight of one call never beats the optimum
        req = _random_requests(seed)
        for cap in (2, 4):
            assert cp.next_call_hits(req, cap) <= belady_hits(req, cap)[0]


def test_study_sums_layers_and_reports_every_rule():
    # Catches a total over the last stream only, a gap computed against the wrong baseline, or a
    # score rule summed over the streams that have probabilities beside totals over all of them.
    streams = [([[1], [2], [1], [3], [1], [2]], None), ([[0], [1], [0]], np.array([[1, 0.0], [0.2, 0.8], [1, 0]]))]
    out = cp.study(streams, [1])[1]
    assert out["routed"] == 9
    rules = out["rules"]
    assert rules["lru"]["hits"] == 0 + 0 and rules["belady"]["hits"] == 2 + 1
    assert rules["lru-2"]["hits"] == 1 + 0
    assert "score-1" not in rules  # one stream has no probabilities
    scored = cp.study([streams[1], streams[1]], [1])[1]["rules"]
    assert scored["score-0.3"]["hits"] == 2 * cp.score_hits([[0], [1], [0]], streams[1][1], 1, 0.3) == 2
    assert rules["lru-2"]["gap_closed"] == pytest.approx((rules["lru-2"]["hits"] - 0) / 3)
    assert rules["belady"]["hit_rate"] == pytest.approx(3 / 9)
    assert cp.gap_closed(4, 4, 4) is None and cp.gap_closed(3, 4, 6) == -0.5


def test_a_traces_decode_calls_per_episode_and_layer(tmp_path):
    # Catches replaying prefill calls, joining two episodes into one cache, or replaying a dense layer.
    model = TraceModel(family="mixtral", unit="expert", layers=3, units=8, unit_bytes=10, dtype="float16", k=2,
                       layers_without_units=(1,))
    phases = ["prefill", "decode", "decode", "prefill", "decode"]
    episodes = [0, 0, 0, 1, 1]
    sets = [[[0, 1, 2], [], [3, 4, 5]], [[0, 1], [], [3, 4]], [[1, 2], [], [4, 5]],
            [[6, 7], [], [6, 7]], [[0, 7], [], [1, 6]]]
    # A prefill of 2 tokens (top-2: up to 4 experts a layer), a decode call of 1.
    t = Trace(model=model, calls=[TraceCall(episode=e, phase=p, tokens=2 if p == "prefill" else 1)
                                  for e, p in zip(episodes, phases)],
              sets=[[np.array(s, dtype=np.int64) for s in row] for row in sets])
    streams = cp.trace_streams(write_trace(t, tmp_path / "t.trace"))
    assert [r for r, _ in streams] == [[[0, 1], [1, 2]], [[3, 4], [4, 5]], [[0, 7]], [[1, 6]]]
    assert all(p is None for _, p in streams)


def test_the_proxy_keeps_each_tokens_routed_experts_and_its_router_probabilities():
    # Catches reading the wrong member of the router's output (its top-k scores are not the ids) or
    # probabilities of another token: each token's routed experts must be its k most probable.
    torch.set_num_threads(1)
    streams = cp.proxy_streams("mixtral-tiny", layers=2, shrink=1, count=2, prefix=24, seed=3)
    assert len(streams) == 2 * 2
    for requests, probs in streams:
        assert len(requests) == 24 and probs.shape == (24, 8)
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
        for routed, p in zip(requests, probs):
            assert len(set(routed)) == 2
            assert set(routed) == set(np.argsort(-p)[:2].tolist())


def test_bad_capacities_are_one_line_and_exit_2(capsys):
    for bad in ("2,x", "0,2"):
        with pytest.raises(SystemExit) as e:
            cp.main(["--trace", "t.trace", "--capacities", bad])
        assert e.value.code == 2
        assert "capacit" in capsys.readouterr().err


def test_a_damaged_or_missing_trace_is_one_line_and_exit_2(tmp_path, capsys):
    """`--trace` of a missing file or of a file that is no trace raised the reader's TraceError
    as a traceback."""
    (tmp_path / "cut.trace").write_bytes(b"PK\x03\x04 cut short")
    for path in (tmp_path / "cut.trace", tmp_path / "missing.trace", tmp_path):
        with pytest.raises(SystemExit) as e:
            cp.main(["--trace", str(path), "--capacities", "2"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"error: --trace: {path}" in err and "Traceback" not in err


def test_a_trace_without_a_routed_decode_call_prints_its_table(tmp_path, capsys):
    """A trace of prefill calls only routes nothing in a decode call: every hit rate is None, which
    the table multiplied by 100 (TypeError) instead of printing '-'."""
    model = TraceModel(family="mixtral", unit="expert", layers=1, units=8, unit_bytes=10, dtype="float16", k=2)
    t = Trace(model=model, calls=[TraceCall(episode=0, phase="prefill", tokens=4)],
              sets=[[np.array([0, 3], dtype=np.int64)]])
    cp.main(["--trace", str(write_trace(t, tmp_path / "t.trace")), "--capacities", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert rows and all(line.split("|")[3].strip() == "-" for line in rows)
