"""A policy family's own zero-copy compute in a machine file (`decode_compute_ms[KEY]['families']`,
core/simulate.py): old files stay valid, the new figures are bounded with one-line errors, and
`predict` prices a family with its own compute as that compute + its bytes + only the terms the
zero-copy time does not hold (per expert moved, the forecast's), and without it as before
(resident compute + every overhead term), saying which it used. Hand-computed on a hand-made trace."""

import json
from pathlib import Path

import pytest

from packbench.core import simulate as sim

ROOT = Path(__file__).resolve().parents[2]


# `trace`: the 2-layer box of tests/core/conftest.py


def _v(value):
    return {"value": value, "source": "made up"}


OVERHEAD = {
    "dense-stream": {"layer_us": _v(30)},
    "packet": {"layer_us": _v(100), "moved_us": _v(10)},
    "expert-cache": {"layer_us": _v(200), "moved_us": _v(20), "routed_us": _v(5)},
    "forecast": {"layer_us": _v(50), "moved_us": _v(7)},
}


def machine(families=None, key="box-moe:2", resident=10.0):
    """1 GB/s (1000 B cost 0.001 ms), `resident` ms of resident compute a token at `key`."""
    entry = {**_v(resident), **({"families": families} if families is not None else {})}
    m = {"name": "box", "pinned_h2d_gbps": _v(1.0), "decode_compute_ms": {key: entry}, "overhead_us": OVERHEAD}
    assert sim.machine_problem(m) is None
    return m


def predicted(trace, spec, rates):
    name, params = sim.parse_policy(spec, "expert")
    return sim.predict(trace, name, params, sim.ledger(trace, name, params), rates)


OWN = {"expert-cache": _v(12.0), "packet": _v(11.0), "dense-stream": _v(9.0)}


@pytest.mark.parametrize("spec, with_own, without_own", [
    # LRU 2 (hand-stepped, tests/core/test_simulate_overhead.py): 3 experts moved, 8 routed, 2 MoE layers
    # a call, 2 decode tokens, 3000 B. Own: 12 + 0.0015 + 3 x 20 us / 2. Resident: 10 + 0.0015 +
    # (4 x 200 + 3 x 20 + 8 x 5) us / 2.
    ("expert-cache:capacity=2,rule=lru", 12 + 0.0015 + 0.03, 10 + 0.0015 + 0.45),
    # No cache: 5 fetched on demand, 4 prefetched in 2 forecasts, 9000 B. Own: 12 + 0.0045 +
    # (5 x 20 + 2 x 50 + 4 x 7) us / 2: the forecast's terms stay whole (the zero-copy time made none).
    # The 4 prefetched experts' copy (0.004 ms over 2 tokens) is shorter than a layer's compute
    # share, so all of it is hidden: less 0.002 a token.
    ("expert-forecast", 12 + 0.0045 - 0.002 + 0.114, 10 + 0.0045 - 0.002 + 0.534),
    # 4 experts moved a token, 4000 B. Own: 11 + 0.004 + 4 x 10 us; resident: + 2 layers x 100 us too.
    ("packet:gather=device", 11 + 0.004 + 0.04, 10 + 0.004 + 0.24),
    # Every expert of both layers, 8000 B a token; dense-stream has only a layer term: none left.
    ("dense-stream", 9 + 0.008, 10 + 0.008 + 0.06),
    ("resident", 10.0, 10.0),
])
def test_a_family_with_its_own_compute_drops_the_terms_that_compute_holds(trace, spec, with_own, without_own):
    own = predicted(trace, spec, machine(OWN))
    old = predicted(trace, spec, machine())
    assert own["decode_ms_per_token"] == pytest.approx(with_own)
    assert old["decode_ms_per_token"] == pytest.approx(without_own)
    assert own["compute_ms_per_token"] + own["copy_ms_per_token"] + own["overhead_ms_per_token"] \
        - own.get("prefetch_hidden_ms_per_token", 0.0) == pytest.approx(with_own)
    assert old["compute_family"] is None
    if spec != "resident":
        family = sim.compute_family("expert", *sim.parse_policy(spec, "expert"))
        assert own["compute_family"] == family
        assert own["compute_source"] == f"{family}'s own zero-copy compute, measured at box-moe:2 (made up)"
        assert old["compute_source"].startswith(f"resident compute (the entry has no {family} figure")


def test_a_family_without_its_own_figure_falls_back_to_resident_and_says_so(trace):
    p = predicted(trace, "packet:gather=device", machine({"expert-cache": _v(12.0)}))
    assert p["decode_ms_per_token"] == pytest.approx(10 + 0.004 + 0.24) and p["compute_family"] is None
    assert "resident compute (the entry has no packet figure" in p["compute_source"]
    assert "expert-cache 0.03 ms (1.5 moved x 20 us) (its layers and routed experts: in its own compute)" in \
        predicted(trace, "expert-cache:capacity=2,rule=lru", machine({"expert-cache": _v(12.0)}))["overhead"]


def test_a_family_figure_of_another_depth_is_scaled_by_layers(trace):
    p = predicted(trace, "expert-cache:capacity=2,rule=lru", machine({"expert-cache": _v(24.0)}, key="box-moe:4",
                                                                     resident=20.0))
    assert p["compute_ms_per_token"] == pytest.approx(12.0) and p["compute_family"] == "expert-cache"
    assert p["compute_source"].startswith("expert-cache's own zero-copy compute, scaled by layers from box-moe:4's 24.0")


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_the_checked_in_machine_files_without_families_stay_valid(name):
    doc = json.loads((ROOT / "bench" / "machines" / f"{name}.json").read_text())
    assert not any("families" in v for v in doc["decode_compute_ms"].values())
    assert sim.machine_problem(doc) is None


@pytest.mark.parametrize("families, fragment", [
    ([], "['families'] must map a policy family"),
    ({"forecast": _v(1.0)}, "['families'] key 'forecast' must be one of dense-stream, packet, packet-host, expert-cache"),
    ({"resident": _v(1.0)}, "key 'resident' must be one of"),
    ({"expert-cache": _v(0)}, "['families']['expert-cache'] must be {value: ms > 0, 1e-09 to 1e+12"),
    ({"expert-cache": _v(-3.0)}, "must be {value: ms > 0"),
    ({"expert-cache": _v(1e13)}, "must be {value: ms > 0"),
    ({"expert-cache": _v(True)}, "must be {value: ms > 0"),
    ({"expert-cache": {"value": 5.0}}, "source: command and date"),
    ({"expert-cache": 5.0}, "must be {value: ms > 0"),
])
def test_bad_family_compute_entries_name_the_fix_in_one_line(families, fragment):
    m = {"name": "box", "pinned_h2d_gbps": _v(1.0), "decode_compute_ms": {"box-moe:2": {**_v(1.0), "families": families}}}
    problem = sim.machine_problem(m)
    assert problem is not None and fragment in problem and "\n" not in problem, problem
    assert problem.startswith("decode_compute_ms['box-moe:2']['families']")


@pytest.mark.parametrize("value", [1e-9, 1e12, 0.5])
def test_family_compute_at_the_bounds_is_accepted(value):
    assert sim.machine_problem(machine({"expert-cache": _v(value)})) is None
