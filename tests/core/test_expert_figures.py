"""core/expert_cache.py's episode figures and the auditor's check of them, against hand counts:
`episode_figures` (what an episode record's `experts` section says it counted) and
`figure_problems` (the auditor's replay of that section against its routing and call ledger).

The other tests of these two compare a replay with a replay (test_audit_replay.py) or run a whole
MoE screen (tests/engine/test_moe_cache_worker.py); these pin the numbers and lines themselves."""

import pytest

from packbench.core.expert_cache import FIGURE_KEYS, LayerCache, belady_hits, cache_hits, episode_figures, \
    figure_problems, lru_hits

# One episode, capacity 2, LRU. Layer 0 has no experts (None in every call); call 3 lists only two
# layers (nothing routed in layer 2); the forecasts stop after call 2 (none for call 3).
ROUTES = [[None, [1, 2], [5]],  # prefill
          [None, [3], [5, 6]],
          [None, [1], [7]],
          [None, [2]]]
PHASES = ["prefill", "decode", "decode", "decode"]
FORECASTS = [[None, [2, 9], None],  # an empty cache: both prefetched, 2 used, 9 wasted
             [None, None, [6, 8]],  # 5 held: 6 and 8 prefetched, 6 used, 8 wasted
             [None, None, [5, 7]]]  # 5 and 6 held: 7 prefetched and used
# Layer 1, LRU: [1, 2] 2 misses; [3] a miss, 3 and 1 kept (1 over 2: same call, lower id); [1] a
# hit; [2] a miss. Belady keeps 1 and 2 past [3] (3 is never needed again): hits at [1] and [2].
LAYER_1 = {"layer": 1, "routed": 5, "hits": 1, "misses": 4, "prefetched": 2, "used": 1, "wasted": 1, "belady_hits": 2}
# Layer 2: [5] a miss; [5, 6] 5 a hit, 6 a miss; [7] a miss. Belady: the hit on 5 alone.
LAYER_2 = {"layer": 2, "routed": 4, "hits": 1, "misses": 3, "prefetched": 3, "used": 2, "wasted": 1, "belady_hits": 1}


def test_an_episodes_figures_by_hand():
    # Bugs: totals or the decode share summed wrongly (`=` or `-=` for `+=`, a count left out, a
    # prefill call counted as decode), Belady's hits per layer not added up or for another capacity,
    # a rate over the wrong total or hits - used as ready, a layer without experts stopping the
    # replay, a call shorter than the others or past the forecasts' end crashing it, the forecasts
    # ignored, the per-layer rows or any key misnamed.
    f = episode_figures(ROUTES, PHASES, capacity=2, rule="lru", forecasts=FORECASTS)
    assert f == {"routed": 9, "hits": 2, "misses": 7, "prefetched": 5, "used": 3, "wasted": 2, "belady_hits": 3,
                 "hit_rate": 2 / 9, "belady_rate": 3 / 9, "ready_rate": 5 / 9,
                 "decode": {"routed": 6, "hits": 2, "misses": 4, "prefetched": 3, "used": 2, "wasted": 1,
                            "belady_hits": 3, "hit_rate": 2 / 6, "belady_rate": 3 / 6, "ready_rate": 4 / 6},
                 "layers": [LAYER_1, LAYER_2]}
    assert list(f) == list(FIGURE_KEYS)
    # Without forecasts nothing is prefetched, and the cache counts the same.
    plain = episode_figures(ROUTES, PHASES, capacity=2, rule="lru")
    assert (plain["hits"], plain["prefetched"], plain["used"], plain["wasted"], plain["ready_rate"]) == (2, 0, 0, 0, 2 / 9)


def test_an_episode_replays_its_own_rule_and_an_empty_one_counts_nothing():
    # Bugs: the rule not handed to the layer's cache (LFU replayed as LRU), Belady's bound for
    # another capacity than the cache's; an episode without calls crashing the replay (`max` of no
    # layers without a default).
    routes = [[[1]], [[1]], [[2]], [[1]]]
    phases = ["prefill", "decode", "decode", "decode"]
    assert episode_figures(routes, phases, capacity=1, rule="lru")["hits"] == 1
    assert episode_figures(routes, phases, capacity=1, rule="lfu")["hits"] == 2  # 2 is not admitted over 1
    # Belady for the episode's capacity: one of 1 and 2 kept after the first call (1, needed sooner).
    one = episode_figures([[[1, 2]], [[1]], [[2]]], phases[:3], capacity=1, rule="lru")
    assert (one["hits"], one["belady_hits"], one["decode"]["belady_hits"]) == (1, 1, 1)
    zero = dict.fromkeys(("routed", "hits", "misses", "prefetched", "used", "wasted", "belady_hits"), 0)
    nothing = {**zero, "hit_rate": None, "belady_rate": None, "ready_rate": None}
    assert episode_figures([], [], capacity=2, rule="lru") == {**nothing, "decode": nothing, "layers": []}


def test_the_default_rule_is_lru_and_no_request_has_no_belady_hit():
    # Bugs: the documented default rule misspelt (`LayerCache(c)` or `cache_hits(r, c)` refusing,
    # or not LRU); Belady over no requests crashing (an index past the start of an empty list).
    trace = [[1], [1], [2], [1]]  # LRU 1 hit, LFU 2
    assert LayerCache(1).rule == "lru"
    assert cache_hits(trace, 1) == lru_hits(trace, 1) == (1, 4)
    assert belady_hits([], 2) == (0, 0)


@pytest.mark.parametrize("capacity", [True, 2.5, -1])
def test_a_capacity_that_is_not_a_whole_count_is_refused(capacity):
    # Bug: a bool or a float taken as a capacity (the `or` of the type checks as `and`).
    with pytest.raises(ValueError, match=f"capacity must be an integer >= 0, got {capacity!r}"):
        LayerCache(capacity)


def _section_and_calls():
    """A consistent `experts` section (what engine/moe/cache.py records) and call ledger for the
    episode above: per call and layer the counted hits, misses and forecast figures, and the
    ledger's routed experts (`active_rows`), experts moved (`rows_copied`) and waste."""
    counted = [[None, {"hits": 0, "misses": 2, "forecast": [2, 9], "prefetched": 2, "used": 1, "wasted": 1},
                {"hits": 0, "misses": 1}],
               [None, {"hits": 0, "misses": 1}, {"hits": 1, "misses": 1, "forecast": [6, 8], "prefetched": 2,
                                                  "used": 1, "wasted": 1}],
               [None, {"hits": 1, "misses": 0}, {"hits": 0, "misses": 1, "forecast": [5, 7], "prefetched": 1,
                                                  "used": 1, "wasted": 0}],
               [None, {"hits": 0, "misses": 1}]]
    calls = [{"phase": "prefill", "active_rows": [None, 2, 1], "rows_copied": [0, 3, 1], "rows_wasted": [0, 1, 0]},
             {"phase": "decode", "active_rows": [None, 1, 2], "rows_copied": [0, 1, 2], "rows_wasted": [0, 0, 1]},
             {"phase": "decode", "active_rows": [None, 1, 1], "rows_copied": [0, 0, 1], "rows_wasted": [0, 0, 0]},
             {"phase": "decode", "active_rows": [None, 1, None], "rows_copied": [0, 1, 0]}]  # no rows_wasted: 0
    figures = episode_figures(ROUTES, PHASES, capacity=2, rule="lru", forecasts=FORECASTS)
    return {"routes": ROUTES, "counted": counted, "capacity": 2, "rule": "lru", **figures}, calls


def test_a_section_that_agrees_with_its_routing_and_ledger_has_no_problem():
    # Bugs: a layer without experts, a call without a ledger row for it, a count without forecast
    # figures or a ledger without `rows_wasted` taken as a disagreement (or crashing the check).
    experts, calls = _section_and_calls()
    assert figure_problems(experts, calls) == []


def test_each_figure_that_is_not_the_replay_is_named_with_both_values():
    # Bugs: a figure compared under another key, left out of the comparison, or named with the
    # wrong value; the replay's forecasts not read from the counts.
    experts, calls = _section_and_calls()
    assert figure_problems({**experts, "hits": 3}, calls) == [
        "experts hits 3 is not the replay of its routing's 2"]
    assert figure_problems({**experts, "decode": {}}, calls) == [
        f"experts decode {{}} is not the replay of its routing's {experts['decode']!r}"]
    for key in FIGURE_KEYS:
        assert figure_problems({**experts, key: "forged"}, calls) == [
            f"experts {key} 'forged' is not the replay of its routing's {experts[key]!r}"], key
    # The forecasts come from the counts: without them the replay prefetches nothing.
    counted = [[None if n is None else {k: v for k, v in n.items() if k != "forecast"} for n in call]
               for call in experts["counted"]]
    assert figure_problems({**experts, "counted": counted}, calls)[:2] == [
        "experts prefetched 5 is not the replay of its routing's 0",
        "experts used 3 is not the replay of its routing's 0"]


def test_each_count_that_is_not_the_ledgers_is_named_by_call_and_layer():
    # Bugs: the counted hits + misses, the experts moved (prefetched + misses - used) or the waste
    # not compared with the ledger, compared at another call or layer, a missing `prefetched`,
    # `used`, `wasted` or `rows_wasted` read as another number than 0, or the lines misworded.
    experts, calls = _section_and_calls()
    experts["counted"][1][2] = {**experts["counted"][1][2], "wasted": 0}
    calls[0]["active_rows"][1] = 3
    calls[2]["active_rows"][1] = 2
    calls[3]["rows_copied"][1] = 0
    assert figure_problems(experts, calls) == [
        "experts call 0 layer 1: hits + misses 2 != routed 3",
        "experts call 1 layer 2: wasted 0 != rows_wasted",
        "experts call 2 layer 1: hits + misses 1 != routed 2",
        "experts call 3 layer 1: prefetched + misses - used 1 != rows_copied 0"]
    # A count without forecast figures (a cache without forecasts): nothing prefetched, used or wasted.
    experts, calls = _section_and_calls()
    calls[1]["rows_wasted"][1] = 1
    calls[2]["rows_copied"][1] = 1
    assert figure_problems(experts, calls) == [
        "experts call 1 layer 1: wasted 0 != rows_wasted",
        "experts call 2 layer 1: prefetched + misses - used 0 != rows_copied 1"]
    # A ledger row without `rows_wasted` wasted nothing: a counted waste there is named.
    experts, calls = _section_and_calls()
    experts["counted"][3][1] = {**experts["counted"][3][1], "wasted": 1}
    assert figure_problems(experts, calls) == ["experts call 3 layer 1: wasted 1 != rows_wasted"]


def test_a_ledger_not_recorded_is_skipped_and_at_most_five_lines_are_given():
    # Bugs: a layer whose ledger was not recorded (`active_rows` None) compared anyway, or the
    # problems cut at another count than five.
    experts, calls = _section_and_calls()
    for call in calls:
        call["active_rows"] = [None] * 3
        call["rows_copied"] = [7] * 3
    assert figure_problems(experts, calls) == []
    experts, calls = _section_and_calls()
    for call in calls:
        call["rows_copied"] = [7] * 3  # every counted layer moved another number: 7 lines
    lines = figure_problems(experts, calls)
    assert len(lines) == 5 and lines[0] == "experts call 0 layer 1: prefetched + misses - used 3 != rows_copied 7"
    assert lines[4] == "experts call 2 layer 1: prefetched + misses - used 0 != rows_copied 7"


def test_a_section_for_another_number_of_calls_is_named():
    # Bugs: routing or counts for fewer calls than the ledger not named (or crashing the check).
    experts, calls = _section_and_calls()
    extra = {"phase": "decode", "active_rows": [None, 1, 1], "rows_copied": [0, 1, 1], "rows_wasted": [0, 0, 0]}
    assert figure_problems(experts, calls + [extra]) == ["experts holds 4 calls' routing for 5 calls"]
    # Counts for fewer calls than the routing: the later calls replay without a forecast.
    short = {**experts, "counted": experts["counted"][:3]}
    assert figure_problems(short, calls) == ["experts holds 4 calls' routing for 4 calls"]


def test_an_unreadable_section_is_one_line_naming_the_error():
    # Bugs: a section without its routing, with a capacity the cache refuses, or of the wrong
    # types crashing the audit instead of naming the section; the error's type left out.
    experts, calls = _section_and_calls()
    assert figure_problems({k: v for k, v in experts.items() if k != "routes"}, calls) == [
        "experts section unreadable (KeyError: 'routes')"]
    assert figure_problems({k: v for k, v in experts.items() if k != "counted"}, calls) == [
        "experts section unreadable (KeyError: 'counted')"]
    assert figure_problems({k: v for k, v in experts.items() if k != "capacity"}, calls) == [
        "experts section unreadable (KeyError: 'capacity')"]
    assert figure_problems({k: v for k, v in experts.items() if k != "rule"}, calls) == [
        "experts section unreadable (KeyError: 'rule')"]
    assert figure_problems({**experts, "capacity": "2"}, calls) == [
        "experts section unreadable (ValueError: capacity must be an integer >= 0, got '2')"]
    assert figure_problems(experts, [{"active_rows": []}] * 4) == ["experts section unreadable (KeyError: 'phase')"]
    assert figure_problems({**experts, "counted": [[{"forecast": [1]}]] * 4}, calls) == [
        "experts section unreadable (IndexError: list index out of range)"]
    assert figure_problems({**experts, "routes": 3}, calls) == [
        "experts section unreadable (TypeError: 'int' object is not iterable)"]
