"""`predict`'s overhead term (core/simulate.py): the engine's fixed costs per MoE layer, per expert
moved, per routed expert of a cache and per forecast, from the machine file's `overhead_us`,
checked against predictions computed by hand on a hand-made trace; a machine file without the
term still predicts compute + copy and says the term is missing."""

import json
from pathlib import Path

import numpy as np
import pytest

from packbench.core import simulate as sim
from packbench.core.trace import Trace, TraceCall, TraceModel

ROOT = Path(__file__).resolve().parents[2]


def _ids(*e):
    return np.array(e, dtype=np.int64)


# `trace`: the 2-layer box of tests/core/conftest.py


OVERHEAD = {
    "dense-stream": {"layer_us": {"value": 30, "source": "made up"}},
    "packet": {"layer_us": {"value": 100, "source": "made up"}, "moved_us": {"value": 10, "source": "made up"}},
    "expert-cache": {"layer_us": {"value": 200, "source": "made up"}, "moved_us": {"value": 20, "source": "made up"},
                     "routed_us": {"value": 5, "source": "made up"}},
    "forecast": {"layer_us": {"value": 50, "source": "made up"}, "moved_us": {"value": 7, "source": "made up"}},
}


def machine(overhead=OVERHEAD):
    # 1 GB/s: 1000 B cost 0.001 ms; 10 ms of compute a token.
    m = {"name": "box", "pinned_h2d_gbps": {"value": 1.0, "source": "made up"},
         "decode_compute_ms": {"box-moe:2": {"value": 10.0, "source": "made up"}}}
    if overhead is not None:
        m["overhead_us"] = overhead
    assert sim.machine_problem(m) is None
    return m


def predicted(trace, spec, rates):
    name, params = sim.parse_policy(spec, "expert")
    return sim.predict(trace, name, params, sim.ledger(trace, name, params), rates)


@pytest.mark.parametrize("spec, expected, overhead", [
    # 2 layers x 100 us + 4 experts moved x 10 us a token; 4000 B copied a token.
    ("packet:gather=device", 10 + 0.004 + 0.24, 0.24),
    # 2 layers x 30 us; every expert of both layers, 8000 B a token.
    ("dense-stream", 10 + 0.008 + 0.06, 0.06),
    ("resident", 10.0, 0.0),
    # LRU 2 (hand-stepped): decode hits 2 + 1 in call 1, 1 + 1 in call 2; 3 misses moved of 8 routed:
    # (4 layers x 200 + 3 x 20 + 8 x 5) us over 2 tokens = 0.45 ms; 3000 B over 2 tokens.
    ("expert-cache:capacity=2,rule=lru", 10 + 0.0015 + 0.45, 0.45),
    # No cache, layer 1 forecast in both decode calls: 4 prefetched ({2,3} then {0,3}), 5 fetched on
    # demand (2 + 0, then 2 + 1: expert 3 was brought); cache family (4 x 200 + 5 x 20 + 8 x 5) = 940,
    # forecast (2 forecasts x 50 + 4 prefetched x 7) = 128 us; 9000 B; over 2 tokens; the prefetches'
    # 4000 B (0.004 ms over 2 tokens) hidden by the layer's compute share: less 0.002.
    ("expert-forecast", 10 + 0.0045 - 0.002 + 0.534, 0.534),
])
def test_overhead_adds_the_machine_terms_to_compute_and_copy(trace, spec, expected, overhead):
    p = predicted(trace, spec, machine())
    assert p["decode_ms_per_token"] == pytest.approx(expected)
    assert p["overhead_ms_per_token"] == pytest.approx(overhead)
    assert p["compute_ms_per_token"] + p["copy_ms_per_token"] + overhead \
        - p.get("prefetch_hidden_ms_per_token", 0.0) == pytest.approx(expected)


def test_the_overhead_says_how_it_adds_up_per_token(trace):
    p = predicted(trace, "expert-forecast", machine())
    assert p["overhead"] == ("expert-cache 0.47 ms (2 layers x 200 us + 2.5 moved x 20 us + 4 routed x 5 us); "
                             "forecast 0.06 ms (1 layers x 50 us + 2 moved x 7 us) per token")


def test_a_machine_file_without_overhead_predicts_compute_plus_copy_and_says_so(trace):
    p = predicted(trace, "packet:gather=device", machine(overhead=None))
    assert p["decode_ms_per_token"] == pytest.approx(10.004)
    assert p["overhead_ms_per_token"] is None and "missing" in p["overhead"] and "overhead_us" in p["overhead"]
    # A file that measured the packet's family but not the cache's: the cache's term is missing.
    only_packet = machine(overhead={"packet": OVERHEAD["packet"]})
    p = predicted(trace, "expert-cache:capacity=2,rule=lru", only_packet)
    assert p["decode_ms_per_token"] == pytest.approx(10.0015)
    assert p["overhead_ms_per_token"] is None and "no expert-cache entry" in p["overhead"]
    assert predicted(trace, "expert-forecast", {**only_packet, "overhead_us": {**only_packet["overhead_us"],
                     "expert-cache": OVERHEAD["expert-cache"]}})["overhead"].endswith(
        "no forecast entry; the prediction is compute + copy alone")
    # The host gather is its own family (a host memcpy per packet): not priced by the device gather's.
    assert "no packet-host entry" in predicted(trace, "packet:gather=host", machine())["overhead"]


def test_the_checked_in_machine_file_still_loads_and_predicts():
    h200 = json.loads((ROOT / "bench" / "machines" / "h200.json").read_text())
    assert sim.machine_problem(h200) is None


@pytest.mark.parametrize("overhead, fragment", [
    ([], "overhead_us must map"),
    ({"packet-cpu": {"layer_us": {"value": 1, "source": "x"}}}, "overhead_us key 'packet-cpu'"),
    ({"packet": {}}, "overhead_us['packet'] must map"),
    ({"packet": {"per_layer": {"value": 1, "source": "x"}}}, "key 'per_layer' must be one of"),
    ({"packet": {"layer_us": {"value": -1, "source": "x"}}}, "microseconds >= 0"),
    ({"packet": {"layer_us": {"value": 5}}}, "source"),
    ({"packet": {"layer_us": {"value": True, "source": "x"}}}, "microseconds >= 0"),
])
def test_bad_overhead_entries_name_the_fix(overhead, fragment):
    m = {"name": "box", "pinned_h2d_gbps": {"value": 1.0, "source": "x"}, "overhead_us": overhead}
    problem = sim.machine_problem(m)
    assert problem is not None and fragment in problem, problem


def test_opt_rows_have_no_overhead_term():
    model = TraceModel(family="opt", unit="row", layers=1, units=8, unit_bytes=10, hidden=4, shape="box-opt")
    t = Trace(model=model, calls=[TraceCall(0, "prefill", 2), TraceCall(0, "decode", 1)],
              sets=[[_ids(0, 1)], [_ids(2)]])
    m = {**machine(), "decode_compute_ms": {"box-opt:1": {"value": 1.0, "source": "x"}}}
    p = sim.predict(t, "packet", {}, sim.ledger(t, "packet", {}), m)
    assert p["overhead_ms_per_token"] is None and "OPT rows" in p["overhead"]
    assert p["decode_ms_per_token"] == pytest.approx(p["compute_ms_per_token"] + p["copy_ms_per_token"])


def test_a_prefetch_is_hidden_up_to_one_layers_share_of_the_compute():
    """`prefetch_hidden_ms`, hand-computed: 4 layers, 10 ms of compute a token (2.5 ms a layer),
    1 MB experts at 1 GB/s (1 ms each). Per decode call and layer the smaller of the prefetch's
    copy and the layer's share times the call's tokens is hidden; prefill calls hide nothing.
    Bugs caught: a prefetch charged in full (the forecasts measured 11-25 % faster than that
    predicted them), hiding more than the compute that runs beside it, or counting prefill."""
    from packbench.core.trace import TraceModel

    model = TraceModel(family="mixtral", unit="expert", layers=4, units=8, unit_bytes=10**6, k=2, shape="x")

    def call(phase, tokens, prefetched):
        return {"phase": phase, "tokens": tokens, "prefetched": prefetched}

    calls = [call("prefill", 16, [None, 8, 8, 8]),      # not decode: nothing
             call("decode", 1, [None, 2, 3, 0]),        # min(2, 2.5) + min(3, 2.5) + 0 = 4.5 ms
             call("decode", 1, [None, None, 1, 5]),     # min(1, 2.5) + min(5, 2.5) = 3.5 ms
             call("decode", 2, [None, 4, 6, None])]     # 2 tokens: min(4, 5) + min(6, 5) = 9 ms
    assert sim.prefetch_hidden_ms(model, calls, 10.0, 1.0) == pytest.approx((4.5 + 3.5 + 9.0) / 4)
    assert sim.prefetch_hidden_ms(model, calls[:1], 10.0, 1.0) == 0.0  # no decode call: nothing hidden
    assert sim.prefetch_hidden_ms(model, calls, 0.0, 1.0) == 0.0  # no compute to hide behind


def test_only_a_forecasting_policy_has_its_prefetch_hidden(trace):
    """A cache without a forecast, a packet and dense-stream prefetch nothing: no hidden term; a
    cache with its forecast on gets one, and its total is compute + copy + overhead less it."""
    for spec in ("expert-cache:capacity=2,rule=lru", "packet:gather=device", "dense-stream"):
        assert "prefetch_hidden_ms_per_token" not in predicted(trace, spec, machine()), spec
    p = predicted(trace, "expert-cache:capacity=1,rule=lru,forecast=on", machine())
    assert p["prefetch_hidden_ms_per_token"] > 0 and p["overlap"] == "serial, a prefetch hidden by its layer's compute"
    assert p["decode_ms_per_token"] == pytest.approx(p["compute_ms_per_token"] + p["copy_ms_per_token"]
                                                     + p["overhead_ms_per_token"] - p["prefetch_hidden_ms_per_token"])
