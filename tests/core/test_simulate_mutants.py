"""core/simulate.py's promises that its other tests left unpinned, found by mutation testing
(docs/mutation.md, `make mutate MODULES="core/simulate.py"`): each test names the bug it catches."""

import numpy as np
import pytest

from packbench.core import simulate as sim
from packbench.core.registry import param_default
from packbench.core.trace import Trace, TraceCall, TraceModel


def ids(*e):
    return np.array(e, dtype=np.int64)


def opt(sets_by_call, *, phases=None, episodes=None, units=16, layers=None, hidden=50, shape=None) -> Trace:
    layers = layers or len(sets_by_call[0])
    phases = phases or ["prefill"] + ["decode"] * (len(sets_by_call) - 1)
    episodes = episodes or [0] * len(sets_by_call)
    model = TraceModel(family="opt", unit="row", layers=layers, units=units, unit_bytes=100, hidden=hidden,
                       dtype="float16", shape=shape)
    calls = [TraceCall(episode=e, phase=p, tokens=4 if p == "prefill" else 1) for e, p in zip(episodes, phases)]
    return Trace(model=model, calls=calls, sets=[[ids(*s) for s in row] for row in sets_by_call])


SETS = [[[0, 1, 2, 3, 8], [4, 5]], [[1, 2], [5, 9]], [[2, 7], [9]]]  # a prefill and two decode calls


def per_call(t: Trace, spec: str, key: str) -> list:
    name, params = sim.parse_policy(spec, t.model.unit)
    return [c[key] for c in sim.ledger(t, name, params)]


# ----------------------------------------------------------------------------- OPT replays


@pytest.mark.parametrize("spec", ["early-forecast", "early-forecast:gather=device", "row-retention:rows_per_layer=2",
                                  "sparse-extents", "packet", "packet:gather=device"])
def test_every_gather_policy_observes_the_active_rows(spec):
    # Catches a policy's readback (or device count) charged with active=None: active_rows and the
    # hit rate's denominator lost for early-forecast, row-retention and sparse-extents.
    assert per_call(opt(SETS), spec, "active_rows") == [[5, 2], [2, 2], [2, 1]]


def test_early_forecast_on_the_device_sends_no_index():
    # Catches gather=device read under the wrong key (early-forecast always replayed as host).
    assert per_call(opt(SETS), "early-forecast:gather=device", "h2d_index_bytes") == [[0, 0]] * 3
    assert per_call(opt(SETS), "early-forecast", "h2d_index_bytes") != [[0, 0]] * 3


def test_an_episode_that_starts_with_a_decode_call_is_forecast_nothing_on_the_device():
    # The device's `prev` starts as zeros of no row: catches a first forecast of row 0 (rows 3, 1 wasted).
    t = opt([[[1, 2]], [[1, 2]]], phases=["decode", "decode"])
    assert per_call(t, "early-forecast:gather=device", "rows_copied") == [[2], [2]]
    assert per_call(t, "early-forecast:gather=device", "rows_wasted") == [[0], [0]]


def test_early_forecast_of_one_row_and_of_none():
    # Layer 0 forecasts its prefill's one row {3} (sent early, wasted) and then sends {4}; layer 1's
    # prefill had no row, so its decode sends its demand after fc1. Catches a forecast of one row
    # dropped (taken for an empty one) and an empty forecast kept as something other than None.
    t = opt([[[3], []], [[4], [4]]])
    assert per_call(t, "early-forecast", "rows_copied") == [[1, 0], [2, 1]]
    assert per_call(t, "early-forecast", "rows_wasted") == [[0, 0], [1, 0]]


def test_row_retention_evicts_the_least_recently_used_row():
    # 2 slots: {0} {1} {0} {2} {0}: {2} evicts 1 (used at call 2), not 0 (used at call 3), so the last
    # {0} hits. Catches a clock that stops (every call at 1: ties evict slot 0), runs backwards, or
    # (on a 1-layer trace) never moves past the first call.
    t = opt([[[0]], [[1]], [[0]], [[2]], [[0]]])
    assert per_call(t, "row-retention:rows_per_layer=2", "hits") == [[0], [0], [1], [0], [1]]


def test_row_retention_fills_an_empty_slot_before_evicting_a_row():
    # 4 slots: {0,1} fills two, {2} takes an empty one, so {0,1} both hit. Catches empty slots
    # marked as recently used as the first call (then slot 0, holding row 0, is evicted for 2).
    t = opt([[[0, 1]], [[2]], [[0, 1]]])
    assert per_call(t, "row-retention:rows_per_layer=4", "hits") == [[0], [0], [2]]


def test_row_retention_bound_is_on_layers_times_rows(monkeypatch):
    # Catches the bound on layers / rows (a huge trace allocating its slots) and a trace exactly at
    # the bound refused.
    monkeypatch.setattr(sim, "MAX_RETENTION_ROWS", 31)
    with pytest.raises(sim.SimulateError, match="2 layers x 16 rows is over 31; replay it on a trace of fewer"):
        per_call(opt(SETS), "row-retention:rows_per_layer=2", "hits")
    monkeypatch.setattr(sim, "MAX_RETENTION_ROWS", 32)
    assert per_call(opt(SETS), "row-retention:rows_per_layer=2", "hits")[0] == [0, 0]


def test_sparse_extents_without_block_rows_uses_the_engines_default():
    # Catches the default block size lost (sparse-extents without block_rows refused or mis-sized).
    default = param_default("sparse-extents", "block_rows")
    assert per_call(opt(SETS), "sparse-extents", "rows_copied") == \
        per_call(opt(SETS), f"sparse-extents:block_rows={default}", "rows_copied")


def test_int8_rows_need_the_traces_hidden_size():
    # Catches int8 replayed on a trace without an OPT hidden size (a TypeError, not the named refusal).
    with pytest.raises(sim.SimulateError, match="no OPT hidden size"):
        per_call(opt(SETS, hidden=0), "packet:weights=int8", "h2d_weight_bytes")


def test_a_ledger_row_names_its_call_and_episode():
    # Catches the rows' index or episode keys misspelt (the auditor matches calls by them).
    t = opt([[[1]], [[2]], [[3]]], phases=["prefill", "decode", "prefill"], episodes=[0, 0, 1])
    rows = sim.ledger(t, "packet", {})
    assert [(r["index"], r["episode"], r["phase"], r["tokens"]) for r in rows] == \
        [(0, 0, "prefill", 4), (1, 0, "decode", 1), (2, 1, "prefill", 4)]


def test_totals_per_phase_by_hand():
    # Catches the prefill phase's key misspelt, d2h_bytes or rows_wasted totals misnamed, and a policy
    # without a cache given 0 hits (and a hit rate) instead of None.
    t = sim.totals(sim.ledger(opt(SETS), "early-forecast", {}))
    assert t["prefill"]["calls"] == 1 and t["prefill"]["d2h_bytes"] == 32 and t["prefill"]["rows_wasted"] == 0
    assert t["decode"]["d2h_bytes"] == 64 and t["decode"]["rows_wasted"] == 6  # 3 + 1 (layer 0: {0,3,8}, {1}), 1 + 1 (layer 1: {4}, {5})
    assert t["decode"]["hits"] is None and t["decode"]["hit_rate"] is None and t["decode"]["belady_hits"] is None


# ----------------------------------------------------------------------------- MoE replays


def moe(sets, *, episodes, layers_without_units=(1,)) -> Trace:
    model = TraceModel(family="mixtral", unit="expert", layers=3, units=4, unit_bytes=1000, k=2,
                       layers_without_units=layers_without_units, shape="box-moe")
    calls = [TraceCall(e, p, 1) for e, p in episodes]
    full = [[ids(*s), ids(), ids(*s)] for s in sets]
    return Trace(model=model, calls=calls, sets=full, forecasts=[[ids(), ids(), ids()] for _ in sets])


def test_belady_hits_are_per_episode_and_past_a_layer_without_experts():
    # Episode 0: {0,1} {0,1}; episode 1: {2,3} {2}. Capacity 2: 0 then 2 hits; 0 then 1.
    # Catches episode 1's Belady hits written over episode 0's rows, and the layers after a layer
    # without experts left without them.
    t = moe([[0, 1], [0, 1], [2, 3], [2]], episodes=[(0, "prefill"), (0, "decode"), (1, "prefill"), (1, "decode")])
    b = per_call(t, "expert-cache:capacity=2,rule=lru", "belady_hits")
    assert b == [[0, None, 0], [2, None, 2], [0, None, 0], [1, None, 1]]


def test_expert_forecasts_belady_is_that_of_no_cache():
    # expert-forecast holds no cache: Belady's hits at capacity 0. Catches another capacity assumed.
    t = moe([[0, 1], [0, 1]], episodes=[(0, "prefill"), (0, "decode")])
    assert per_call(t, "expert-forecast", "belady_hits") == [[0, None, 0], [0, None, 0]]


def test_phase_switched_decode_calls_pay_as_packets():
    # Catches phase-switched given the expert-cache overhead family instead of a packet's.
    assert sim.overhead_families("expert", "phase-switched", {}) == ("packet-host",)
    assert sim.overhead_families("expert", "phase-switched", {"gather": "device"}) == ("packet",)
    # The mapped gather has no measured family: not charged the host gather's overhead (packet-host).
    assert sim.overhead_families("expert", "packet", {"gather": "mapped"}) is None
    assert sim.overhead_families("expert", "phase-switched", {"gather": "mapped"}) is None


def _machine(**extra):
    m = {"name": "box", "pinned_h2d_gbps": {"value": 1.0, "source": "s"},
         "decode_compute_ms": {"box-moe:3": {"value": 10.0, "source": "s"}}, **extra}
    assert sim.machine_problem(m) is None
    return m


def _predict(t: Trace, spec: str, machine: dict) -> dict:
    name, params = sim.parse_policy(spec, t.model.unit)
    return sim.predict(t, name, params, sim.ledger(t, name, params), machine)


def test_layer_overhead_counts_only_layers_with_experts():
    # 2 decode calls of 1 token, 2 of 3 layers with experts: 4 layers x 1000 us / 2 tokens = 2 ms.
    # Catches the layers without experts added to the count instead of taken from it.
    t = moe([[0], [0], [1]], episodes=[(0, "prefill"), (0, "decode"), (0, "decode")])
    m = _machine(overhead_us={"packet-host": {"layer_us": {"value": 1000, "source": "s"}}})
    assert _predict(t, "packet", m)["overhead_ms_per_token"] == pytest.approx(2.0)


def test_forecast_overhead_counts_forecast_layers_and_no_routed_experts():
    # 3 MoE layers: layers 1 and 2 receive a forecast. 2 decode calls: 4 forecast layers x 1000 us / 2 tokens
    # = 2 ms; the forecast family pays no routed_us. Catches calls / layers, and a routed expert charged.
    t = moe([[0], [0], [1]], episodes=[(0, "prefill"), (0, "decode"), (0, "decode")], layers_without_units=())
    zero = {"value": 0, "source": "s"}
    m = _machine(overhead_us={"expert-cache": {"layer_us": zero},
                              "forecast": {"layer_us": {"value": 1000, "source": "s"},
                                           "routed_us": {"value": 1000, "source": "s"}}})
    assert _predict(t, "expert-forecast", m)["overhead_ms_per_token"] == pytest.approx(2.0)


def test_a_missing_overhead_entry_names_each_family():
    # Catches the families' names joined wrongly in the line that says what is missing.
    t = moe([[0], [0]], episodes=[(0, "prefill"), (0, "decode")])
    m = _machine(overhead_us={"dense-stream": {"layer_us": {"value": 1, "source": "s"}}})
    p = _predict(t, "expert-cache:capacity=1,forecast=on", m)
    assert "overhead_us has no expert-cache, forecast entry;" in p["overhead"]


# ----------------------------------------------------------------------------- prediction


def opt_machine(**compute):
    return {"name": "m", "pinned_h2d_gbps": {"value": 1e-3, "source": "r"},  # 1 MB/s: 1000 B = 1 ms
            "decode_compute_ms": {k.replace("_", "-") + ":2": {"value": v, "source": "c"} for k, v in compute.items()}}


def test_dense_stream_overlaps_copy_and_compute():
    # 3200 B a decode token = 3.2 ms of copy beside 2 ms of compute: the larger, 3.2 ms. Catches
    # dense-stream priced serially (5.2 ms) or the overlap misnamed.
    t = opt(SETS, shape="opt-x")
    p = _predict(t, "dense-stream", opt_machine(opt_x=2.0))
    assert p["overlap"] == "overlapped" and p["decode_ms_per_token"] == pytest.approx(3.2)
    assert p["compute_source"] == "measured at opt-x:2 (c)"  # catches the exact entry missed (then "scaled")
    assert p["machine"] == "m" and p["pinned_h2d_gbps"] == 1e-3


def test_copy_time_counts_index_bytes_too():
    # packet: decode calls move 400 + 32 and 300 + 24 B: 378 B a token, 0.378 ms. Catches the index
    # bytes subtracted from the weight bytes.
    p = _predict(opt(SETS, shape="opt-x"), "packet", opt_machine(opt_x=2.0))
    assert p["copy_ms_per_token"] == pytest.approx(0.378) and p["decode_ms_per_token"] == pytest.approx(2.378)


def test_a_trace_without_decode_calls_predicts_nothing_and_says_why():
    # Catches the result's keys misspelt or the reason lost.
    p = _predict(opt(SETS[:1], shape="opt-x"), "packet", opt_machine(opt_x=2.0))
    assert p == {"machine": "m", "pinned_h2d_gbps": 1e-3, "overlap": "serial", "decode_ms_per_token": None,
                 "why": "the trace has no decode call"}


def test_no_compute_rate_names_the_key_to_add():
    # Catches an unnamed shape shown as None, and a machine file without decode_compute_ms (which
    # machine_problem allows) crashing the prediction.
    p = _predict(opt(SETS), "packet", opt_machine(opt_x=2.0))
    assert "no measured compute rate for this unnamed shape;" in p["why"]
    assert "add decode_compute_ms['SHAPE:2'] to the machine file" in p["why"]
    m = opt_machine()
    del m["decode_compute_ms"]
    assert sim.machine_problem(m) is None
    assert "no measured compute rate for opt-x" in _predict(opt(SETS, shape="opt-x"), "packet", m)["why"]


def test_a_shape_with_a_colon_is_split_at_its_last_colon():
    # A trace's shape is any string: "a:b:2" is shape "a:b" at 2 layers. Catches the key split at its
    # first colon (refused by machine_problem, or never matched by compute_ms).
    m = {**opt_machine(), "decode_compute_ms": {"a:b:1": {"value": 1.0, "source": "c"}}}
    assert sim.machine_problem(m) is None
    assert _predict(opt(SETS, shape="a:b"), "packet", m)["compute_ms_per_token"] == pytest.approx(2.0)


# ----------------------------------------------------------------------------- machine files


@pytest.mark.parametrize("key, ok", [("x:1", True), ("x:123456", True), ("x:1234567", False), ("x:0", False),
                                     (":4", False), ("x:abc", False), ("x:²", False)])
def test_compute_keys_are_shape_and_a_layer_count(key, ok):
    # Catches 1 layer or 6 digits refused, 7 digits or 0 layers or an empty shape accepted, and a
    # non-digit count reaching int() (an exception, not a line naming the key).
    problem = sim.machine_problem({**opt_machine(), "decode_compute_ms": {key: {"value": 1.0, "source": "c"}}})
    assert (problem is None) == ok, problem
    if not ok:
        assert problem.startswith(f"decode_compute_ms key '{key}' must be shape:layers")


@pytest.mark.parametrize("v", [5, {"value": 1.0, "source": 7}, {"value": 0, "source": "c"}])
def test_a_bad_compute_entry_is_named(v):
    # Catches a value without a source accepted, and a non-object entry crashing the check.
    problem = sim.machine_problem({**opt_machine(), "decode_compute_ms": {"x:2": v}})
    assert problem is not None and problem.startswith("decode_compute_ms['x:2'] must be {value: ms > 0")


def test_figures_at_the_bounds_are_accepted():
    # Catches MIN_VALUE or MAX_VALUE themselves refused, and an overhead of exactly 0 refused.
    for rate in (sim.MIN_VALUE, sim.MAX_VALUE):
        assert sim.machine_problem({**opt_machine(), "pinned_h2d_gbps": {"value": rate, "source": "r"}}) is None
    for us in (0, sim.MIN_VALUE, sim.MAX_VALUE):
        overhead = {"packet": {"layer_us": {"value": us, "source": "s"}}}
        assert sim.machine_problem({**opt_machine(), "overhead_us": overhead}) is None, us


@pytest.mark.parametrize("overhead, line", [
    ([], "overhead_us must map a policy family (dense-stream, packet, packet-host, expert-cache, forecast) to"),
    ({"nope": {}}, "must be one of dense-stream, packet, packet-host, expert-cache, forecast"),
    ({"packet": {}}, "overhead_us['packet'] must map layer_us, moved_us, routed_us to {value, source}"),
    ({"packet": {"x_us": {}}}, "overhead_us['packet'] key 'x_us' must be one of layer_us, moved_us, routed_us"),
])
def test_bad_overhead_lines_list_what_is_allowed(overhead, line):
    # Catches the families or terms joined wrongly in the line that names the fix.
    assert line in sim.machine_problem({**opt_machine(), "overhead_us": overhead})


# ----------------------------------------------------------------------------- policy specs


def test_an_unknown_policy_lists_the_units_policies():
    # Catches the other unit's policies listed, or the names joined wrongly.
    with pytest.raises(sim.SimulateError) as e:
        sim.parse_policy("nope", "row")
    assert str(e.value).endswith("use one of dense-stream, early-forecast, packet, phase-switched, resident, "
                                 "row-retention, sparse-extents")


def test_an_unknown_parameter_lists_the_allowed_ones_or_says_there_are_none():
    # Catches the allowed parameters joined wrongly, and a policy without parameters told "is not
    # one of none (write resident:key=value)", which asked for a key it has none of.
    with pytest.raises(sim.SimulateError, match=r"is not one of gather, weights \(write packet:key=value\)"):
        sim.parse_policy("packet:x=1", "row")
    with pytest.raises(sim.SimulateError, match=r"^policy resident takes no parameters; give it as 'resident' "
                                                 r"alone, not 'resident:x=1'$"):
        sim.parse_policy("resident:x=1", "row")


@pytest.mark.parametrize("spec", ["packet", "packet:gather=device", "phase-switched"])
def test_expert_packets_observe_the_routed_experts(spec):
    # Catches an expert packet's routing readback charged with active=None (active_rows, the
    # routed_us overhead count and the hit rate's denominator lost).
    t = moe([[0, 1], [2]], episodes=[(0, "prefill"), (0, "decode")])
    assert per_call(t, spec, "active_rows")[1] == [1, None, 1]


def test_refusals_and_notes_word_for_word():
    # Catches each line's words lost or mangled (simulate prints them as the row's reason or exits with them).
    def refusal(spec, t=None):
        with pytest.raises(sim.SimulateError) as e:
            per_call(t or opt(SETS), spec, "rows_copied")
        return str(e.value)

    assert refusal("row-retention") == "row-retention needs rows_per_layer (e.g. row-retention:rows_per_layer=512)"
    assert refusal("packet:weights=int8", opt(SETS, hidden=0)) == \
        "weights int8 moves OPT rows of hidden + 4 bytes; the trace has no OPT hidden size"
    assert refusal("expert-cache", moe([[0]], episodes=[(0, "prefill")])) == \
        "expert-cache needs capacity (e.g. expert-cache:capacity=4,rule=lru,forecast=off)"
    assert sim.machine_problem([]) == "a machine file is a JSON object with name, pinned_h2d_gbps and decode_compute_ms"
    assert sim.machine_problem({**opt_machine(), "decode_compute_ms": []}) == \
        "decode_compute_ms must map shape:layers to {value, source}"
    assert sim.overhead_ms(opt(SETS), "packet", {}, {}, {}) == \
        (None, "not modelled for OPT rows (overhead_us holds MoE policies' families)")
    t = moe([[0]], episodes=[(0, "prefill")])
    assert sim.overhead_ms(t, "resident", {}, {}, {}) == (0.0, "none: resident's time is the measured compute")


def test_the_steady_call_is_each_episodes_median_call_but_its_first_then_the_median_over_episodes():
    """simulate's `steady_call_ms` is the statistic a screen reports (core/serving.py steady_call_s):
    an LRU 2 cache whose misses clump in a few calls has a median call far below its mean. Each
    expert moved costs 1 ms (1000 B at 1 MB/s), 2 layers with experts, compute 2 ms a call.
    Episode 0 decodes {0,1} {0,1} {2,3} {2,3} after a {0,1} prefill: calls of 2, 2, 6, 2 ms; its
    steady calls (not the first) 2, 6, 2: median 2. Episode 1 decodes {2,3} {2,3} {0,1}: 6, 2, 6;
    steady 2, 6: median 4. Over episodes: 3. Catches the mean per token (3.71), the first decode
    call kept (episode 1's median 6), and every steady call pooled (median 2)."""
    t = moe([[0, 1], [0, 1], [0, 1], [2, 3], [2, 3], [0, 1], [2, 3], [2, 3], [0, 1]],
            episodes=[(0, "prefill")] + [(0, "decode")] * 4 + [(1, "prefill")] + [(1, "decode")] * 3)
    m = {"name": "box", "pinned_h2d_gbps": {"value": 1e-3, "source": "s"},
         "decode_compute_ms": {"box-moe:3": {"value": 2.0, "source": "s"}}}
    p = _predict(t, "expert-cache:capacity=2,rule=lru", m)
    assert p["decode_ms_per_token"] == pytest.approx(2.0 + 12.0 / 7)
    assert p["steady_call_ms"] == pytest.approx(3.0)
    packet = _predict(t, "packet:gather=device", m)  # every call moves its 4 experts: median = mean
    assert packet["steady_call_ms"] == pytest.approx(packet["decode_ms_per_token"]) == pytest.approx(6.0)


def test_no_steady_call_without_a_second_decode_call():
    # One decode call an episode: nothing steady to predict (the screen's figure is None there too).
    t = moe([[0, 1], [2, 3]], episodes=[(0, "prefill"), (0, "decode")])
    m = {"name": "box", "pinned_h2d_gbps": {"value": 1e-3, "source": "s"},
         "decode_compute_ms": {"box-moe:3": {"value": 2.0, "source": "s"}}}
    p = _predict(t, "expert-cache:capacity=2,rule=lru", m)
    assert p["decode_ms_per_token"] == pytest.approx(6.0) and p["steady_call_ms"] is None
