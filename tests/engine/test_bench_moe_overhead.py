"""bench.moe_overhead on the CPU (the twin of its run in bench/simulate_check_device.sh): its tiny
layers go through the engine's own policies with the counts the fit needs, and the fit recovers
the fixed costs a table was built from, as a machine file `predict` accepts."""

import pytest
import torch

from bench import moe_overhead
from packbench.core.simulate import machine_problem
from packbench.engine.moe.cache import ExpertCache


def test_the_tiny_layers_run_the_engine_policies_with_their_counts(tmp_path):
    torch.set_num_threads(1)
    path = moe_overhead.tiny_layers(tmp_path / "m", experts=16, k=2, layers=2)
    bench = moe_overhead.Bench(path, device=torch.device("cpu"), dtype=torch.float32, k=2, calls=3)
    _, packet = bench.run("packet:device", "miss")
    assert packet["layers"] == 2 and packet["moved"] == packet["routed"] == 4 and packet["prefetched"] == 0
    assert packet["bytes"] == 4 * bench.model.host.expert_bytes
    # The same 2 experts every call: after the warm-up every one is a hit, nothing moves.
    _, hit = bench.run(ExpertCache(capacity=4, rule="lru"), "hit")
    assert hit["moved"] == 0 and hit["routed"] == 4
    # A rotation through all 16 experts: 4 slots never hold the next call's.
    _, miss = bench.run(ExpertCache(capacity=4, rule="lru"), "miss")
    assert miss["moved"] == miss["fetched"] == 4
    # The forecast reaches layer 1 only (from layer 0's input): one forecast a call, k experts prefetched
    # at most, every one of them moved.
    _, fc = bench.run(ExpertCache(capacity=4, rule="lru", forecast="on"), "miss")
    assert fc["forecasts"] == 1 and 0 < fc["prefetched"] <= 2 and fc["moved"] == fc["fetched"] + fc["prefetched"]


def _table(us):
    """measure()'s table for fixed costs `us`, exactly linear in the engine's counts (no noise)."""
    out = {}
    for k in moe_overhead.KS:
        layers = 8
        c = dict(layers=layers, moved=layers * k, routed=layers * k, prefetched=0.0, forecasts=0.0,
                 fetched=layers * k, bytes=0)
        out[("packet", k, "miss")] = (layers * us["p_layer"] + layers * k * us["p_moved"], c)
        out[("dense-stream", k, "miss")] = (layers * us["d_layer"], {**c, "moved": 64 * layers, "routed": 0})
        cache = lambda fetched: layers * us["c_layer"] + fetched * us["c_moved"] + layers * k * us["c_routed"]  # noqa: E731
        out[("expert-cache", k, "hit")] = (cache(0), {**c, "moved": 0, "fetched": 0})
        out[("expert-cache", k, "miss")] = (cache(layers * k), c)
        # The forecast prefetches k in 7 layers, half of them used: those are not fetched on demand.
        pre, used = 7 * k, 7 * k / 2
        fetched = layers * k - used
        out[("cache+forecast", k, "miss")] = (cache(fetched) + 7 * us["f_layer"] + pre * us["f_moved"],
                                              {**c, "prefetched": pre, "forecasts": 7, "fetched": fetched,
                                               "moved": fetched + pre})
    return out


def test_the_fit_recovers_the_fixed_costs_of_a_table():
    us = dict(p_layer=90.0, p_moved=12.0, d_layer=30.0, c_layer=150.0, c_moved=25.0, c_routed=40.0,
              f_layer=200.0, f_moved=9.0)
    fragment = moe_overhead.overhead(_table(us), source="made up, 2026-12-04", log=lambda line: None)
    values = {f: {t: v["value"] for t, v in terms.items()} for f, terms in fragment.items()}
    assert values["packet"] == pytest.approx({"layer_us": 90.0, "moved_us": 12.0})
    assert values["dense-stream"] == pytest.approx({"layer_us": 30.0})
    assert values["expert-cache"] == pytest.approx({"layer_us": 150.0, "moved_us": 25.0, "routed_us": 40.0})
    assert values["forecast"] == pytest.approx({"layer_us": 200.0, "moved_us": 9.0})
    assert all(v["source"].startswith("made up, 2026-12-04: ") for terms in fragment.values() for v in terms.values())
    machine = {"name": "box", "pinned_h2d_gbps": {"value": 1.0, "source": "x"}, "overhead_us": fragment}
    assert machine_problem(machine) is None


def test_a_negative_fit_is_written_as_zero_and_said_so():
    us = dict(p_layer=-5.0, p_moved=12.0, d_layer=30.0, c_layer=150.0, c_moved=25.0, c_routed=40.0,
              f_layer=200.0, f_moved=9.0)
    fragment = moe_overhead.overhead(_table(us), source="s", log=lambda line: None)
    assert fragment["packet"]["layer_us"]["value"] == 0.0
    assert "(fitted -5.00, written as 0)" in fragment["packet"]["layer_us"]["source"]


def test_the_comparison_judges_measured_over_predicted_within_15_percent():
    from bench.simulate_check import judged

    rows = [{"condition": c, "ms": 10.0} for c in ("at-edge", "over", "under", "not-run")]
    rows.append({"condition": "unpriced", "ms": None})
    got = {"at-edge": {"ms": 11.5}, "over": {"ms": 11.6}, "under": {"ms": 8.5}, "unpriced": {"ms": 3.0}}
    out = {r["condition"]: r for r in judged(rows, got)}
    assert out["at-edge"]["within"] is True and out["at-edge"]["ratio"] == pytest.approx(1.15)
    assert out["over"]["within"] is False and out["under"]["within"] is True
    assert out["not-run"]["within"] is None and out["not-run"]["measured"] is None
    assert out["unpriced"]["within"] is None  # a prediction the machine file could not make is not judged


def test_the_comparison_measures_the_steady_decode_call_as_packbench_report_does():
    """bench.simulate_check compare's measured time is the screen's steady decode call as the product
    gives it (docs/metrics.md: per scored episode the median decode call but its first, then the median
    over episodes). It pooled every episode's calls into one median, a different figure from
    `packbench report`'s for the same archive (here 1 ms where the report says 2)."""
    from types import SimpleNamespace

    from bench.simulate_check import measured_of
    from packbench.core.report import serving_rows

    def episode(i, role, steady_ms, status="ok"):
        def call(phase, ms):
            return {"phase": phase, "wall_s": ms / 1e3, "tokens": 1, "h2d_weight_bytes": [2_000_000],
                    "h2d_index_bytes": [0]}
        calls = [call("prefill", 50.0), call("decode", 40.0)] + [call("decode", ms) for ms in steady_ms]
        record = {"condition": "packet", "role": role, "status": status, "plan_index": i, "calls": calls,
                  "wall_s": sum(c["wall_s"] for c in calls)}
        return SimpleNamespace(condition="packet", scored=role == "scored", ok=status == "ok", calls=calls,
                               record=record)

    screen = SimpleNamespace(
        protocol=SimpleNamespace(conditions=[SimpleNamespace(name="packet", tier="exact")]),
        episodes=[episode(0, "warmup", [90.0, 90.0]), episode(1, "scored", [1.0, 1.0, 1.0]),
                  episode(2, "scored", [2.0]), episode(3, "scored", [3.0]),
                  episode(4, "scored", [0.5, 0.5], status="failed")])
    got = measured_of(screen)["packet"]
    assert got["episodes"] == 3
    assert got["ms"] == pytest.approx(2.0)  # the pooled median of 1, 1, 1, 2, 3 would be 1
    assert got["ms"] == pytest.approx(serving_rows(screen)[0]["steady_call_s"] * 1e3)
    assert got["mb"] == pytest.approx(2.0) and got["hit_rate"] is None
    assert (got["lo"], got["hi"]) == (pytest.approx(1.0), pytest.approx(3.0))  # the episodes' figures, not calls'
