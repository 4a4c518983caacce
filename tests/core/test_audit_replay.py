"""The auditor's trace replay (`core/audit.py` `replay_problems`) on hand-made traces, in
milliseconds: a record that agrees with its trace has no problem, and each field changed in the
record is named by call, layer and field with both values (docs/archive.md, `active/NNNNN.trace`).
The faithful record is built from the simulator's replay (core/simulate.py, tested by hand in
tests/core/test_trace.py); what is tested here is the auditor's comparison, field by field.
"""

import copy
import dataclasses

import numpy as np
import pytest

from packbench.core import simulate as sim
from packbench.core.audit import replay_problems
from packbench.core.expert_cache import FIGURE_KEYS, episode_figures
from packbench.core.trace import Trace, TraceCall, TraceModel, forecast_possible

a = lambda *ids: np.array(ids, dtype=np.int64)  # noqa: E731


def row_trace(*, episodes=(0, 0, 0)) -> Trace:
    model = TraceModel(family="opt", unit="row", layers=2, units=16, unit_bytes=100, hidden=50, dtype="float16")
    calls = [TraceCall(e, "prefill" if i == 0 else "decode", 4 if i == 0 else 1) for i, e in enumerate(episodes)]
    sets = [[a(0, 1, 2, 3, 4), a(5, 6)], [a(1, 2), a(5, 9)], [a(3, 4), a(7)]]
    return Trace(model=model, calls=calls, sets=sets)


def expert_trace(*, skip=(), version=3) -> Trace:
    """Three layers of 4 experts; a prefill and 3 decode calls; forecasts for every layer that
    can have one."""
    model = TraceModel(family="mixtral", unit="expert", layers=3, units=4, unit_bytes=1000, k=2,
                       layers_without_units=tuple(skip))
    routed = [[a(0, 1), a(0, 1), a(1, 2)], [a(0, 1), a(2, 3), a(0, 2)], [a(2, 3), a(2, 3), a(1, 3)],
              [a(0, 1), a(0, 3), a(0, 1)]]
    sets = [[a() if layer in skip else s for layer, s in enumerate(row)] for row in routed]
    made = [[a(), a(0, 2), a(1, 3)], [a(), a(2, 3), a(0, 1)], [a(), a(1, 2), a(1, 3)], [a(), a(0, 3), a(2, 3)]]
    calls = [TraceCall(0, "prefill", 3)] + [TraceCall(0, "decode", 1)] * 3
    # none where none can be made (layer 0, a layer without experts and the one after it): as
    # parse_trace requires of a trace file
    forecasts = [[f if forecast_possible(model, layer, version) else a() for layer, f in enumerate(row)]
                 for row in made]
    return Trace(model=model, calls=calls, sets=sets, forecasts=forecasts, version=version)


def faithful(t: Trace, policy: str, params: dict) -> dict:
    """The record an engine that agrees with the simulator writes for this trace."""
    replay = sim.ledger(t, policy, params)
    rec = {"calls": [{k: copy.deepcopy(r[k]) for k in sim.LEDGER_KEYS} for r in replay]}
    if policy not in sim.EXPERT_CACHES:
        return rec
    m = t.model
    skip = set(m.layers_without_units)
    forecasting = sim.needs_forecast(policy, params)
    counted, routes, forecasts = [], [], []
    for c, r in enumerate(replay):
        counted.append([None if layer in skip else {
            "hits": r["hits"][layer], "misses": r["misses"][layer], "prefetched": r["prefetched"][layer],
            "used": r["used"][layer], "wasted": r["rows_wasted"][layer] if r["prefetched"][layer] is not None else None,
            "forecast": t.forecasts[c][layer].tolist() if forecasting and forecast_possible(m, layer, t.version)
            else None,
        } for layer in range(m.layers)])
        routes.append([None if layer in skip else t.sets[c][layer].tolist() for layer in range(m.layers)])
        forecasts.append([t.forecasts[c][layer].tolist() if forecast_possible(m, layer, t.version) else None
                          for layer in range(m.layers)])
    figures = episode_figures(routes, [c.phase for c in t.calls], capacity=params.get("capacity", 0),
                              rule=params.get("rule", "lru"), forecasts=forecasts if forecasting else None)
    rec["experts"] = {"counted": counted, "routes": routes, **figures}
    return rec


CACHE = ("expert-cache", {"capacity": 2, "rule": "lfu", "forecast": "on"})
FORECAST = ("expert-forecast", {})


@pytest.mark.parametrize("policy, params", [("packet", {}), ("row-retention", {"rows_per_layer": 3}),
                                            ("dense-stream", {}), CACHE, FORECAST,
                                            ("expert-cache", {"capacity": 1, "rule": "lru"})])
def test_a_record_that_agrees_with_its_trace_has_no_problem(policy, params):
    """Catches a replay compared with the wrong call, layer or policy's parameters (a problem
    where the record agrees), and a forecast expected where the policy makes none."""
    t = row_trace() if policy in ("packet", "row-retention", "dense-stream") else expert_trace(skip=(2,))
    assert replay_problems(t, faithful(t, policy, params), policy, params) == []


def test_each_ledger_field_changed_is_named_by_call_layer_and_both_values():
    """Catches a ledger key left out of the comparison, the first differing layer misnamed, and
    a record value of another shape (not a list, or another length) compared as if it were one."""
    t = row_trace()
    good = faithful(t, "packet", {})
    for c, key in [(0, "active_rows"), (1, "rows_copied"), (2, "h2d_weight_bytes"), (1, "h2d_index_bytes"),
                   (2, "d2h_bytes"), (0, "rows_wasted")]:
        rec = copy.deepcopy(good)
        want = good["calls"][c][key]
        layer = 1
        rec["calls"][c][key][layer] = (want[layer] or 0) + 7
        assert replay_problems(t, rec, "packet", {}) == [
            f"call {c} layer 1 {key}: recorded {(want[layer] or 0) + 7!r}, the trace's replay {want[layer]!r}"], key
    rec = copy.deepcopy(good)
    rec["calls"][2]["d2h_bytes"] = "x" * 100
    rec["calls"][1]["h2d_index_bytes"] = good["calls"][1]["h2d_index_bytes"][:1]
    assert replay_problems(t, rec, "packet", {}) == [
        f"call 1 h2d_index_bytes: recorded {good['calls'][1]['h2d_index_bytes'][:1]!r}, the trace's replay "
        f"{good['calls'][1]['h2d_index_bytes']!r}",
        f"call 2 d2h_bytes: recorded {repr('x' * 100)[:80]}, the trace's replay {good['calls'][2]['d2h_bytes']!r}"]


def test_what_cannot_be_replayed_is_said_or_skipped():
    """A policy the simulator has no entry for on this unit: nothing to replay; a trace of two
    episodes and a capacity the cache refuses are named. Catches a skipped check or a
    replay error escaping the audit."""
    t = row_trace()
    assert replay_problems(t, {"calls": []}, "expert-cache", {"capacity": 2}) == []  # no ("row", "expert-cache")
    assert replay_problems(row_trace(episodes=(0, 0, 1)), faithful(t, "packet", {}), "packet", {}) == [
        "the trace holds more than one episode"]
    e = expert_trace()
    rule = "x" * 300  # a rule the cache refuses, named at length: the line keeps 200 characters of it
    (problem,) = replay_problems(e, {"calls": []}, "expert-cache", {"capacity": 2, "rule": rule})
    assert problem == f"cannot replay expert-cache on its trace: {('rule must be one of lru, lfu, got ' + repr(rule))[:200]}"


def test_each_expert_count_routing_forecast_and_figure_changed_is_named():
    """Catches a counted key (hits, misses, prefetched, used, wasted), the routing, the forecast
    set or a figure left out of the comparison, and a problem naming another call or layer."""
    t = expert_trace(skip=(2,))
    policy, params = CACHE
    good = faithful(t, policy, params)
    for c, layer, key in [(1, 1, "hits"), (2, 0, "misses"), (3, 1, "prefetched"), (2, 1, "used"), (1, 1, "wasted")]:
        rec = copy.deepcopy(good)
        want = good["experts"]["counted"][c][layer][key]
        rec["experts"]["counted"][c][layer][key] = 99
        assert replay_problems(t, rec, policy, params) == [
            f"call {c} layer {layer} {key}: recorded 99, the trace's replay {want!r}"], key
    rec = copy.deepcopy(good)
    rec["experts"]["routes"][3][1] = [1, 2]
    assert replay_problems(t, rec, policy, params) == [
        "call 3 layer 1 routing: recorded [1, 2], the trace's active set [0, 3]"]
    rec = copy.deepcopy(good)
    rec["experts"]["counted"][2][1]["forecast"] = [0, 1]
    assert replay_problems(t, rec, policy, params) == [
        "call 2 layer 1 forecast: recorded [0, 1], the trace's forecast set [1, 2]"]
    rec = copy.deepcopy(good)
    rec["experts"]["counted"][2][0]["forecast"] = [0, 1]  # layer 0 has nothing before it to forecast from
    assert replay_problems(t, rec, policy, params) == [
        "call 2 layer 0 forecast: recorded [0, 1], the trace's forecast set None"]
    for key in FIGURE_KEYS:
        rec = copy.deepcopy(good)
        rec["experts"][key] = "forged"
        assert replay_problems(t, rec, policy, params) == [
            f"experts {key}: recorded 'forged', recomputed from the trace {repr(good['experts'][key])[:120]}"], key


def test_a_forecast_recorded_by_a_cache_without_forecasts_is_named():
    """expert-cache with `forecast: off` makes none: a recorded forecast set is a disagreement.
    Catches forecasts expected whenever the trace holds them."""
    t = expert_trace()
    params = {"capacity": 2, "rule": "lru"}
    rec = faithful(t, "expert-cache", params)
    assert replay_problems(t, rec, "expert-cache", params) == []
    rec["experts"]["counted"][1][1]["forecast"] = [2, 3]
    assert replay_problems(t, rec, "expert-cache", params) == [
        "call 1 layer 1 forecast: recorded [2, 3], the trace's forecast set None"]


def test_an_experts_section_of_the_wrong_shape_is_named():
    """No section, counts or routing for another number of calls, another number of layers,
    counts in a layer without experts, and a key missing: each one line. Catches a shape check
    dropped (a crash or a silent pass instead)."""
    t = expert_trace(skip=(2,))
    policy, params = FORECAST
    good = faithful(t, policy, params)
    assert replay_problems(t, {**good, "experts": None}, policy, params) == [
        "an expert cache's record has no experts section"]
    rec = copy.deepcopy(good)
    rec["experts"]["routes"] = rec["experts"]["routes"][:3]
    assert replay_problems(t, rec, policy, params) == [
        "experts holds 4 calls' counts and 3 calls' routing, the trace 4 calls"]
    rec = copy.deepcopy(good)
    rec["experts"]["counted"] = rec["experts"]["counted"][:2]
    assert replay_problems(t, rec, policy, params) == [
        "experts holds 2 calls' counts and 4 calls' routing, the trace 4 calls"]
    rec = copy.deepcopy(good)
    rec["experts"]["counted"][1] = rec["experts"]["counted"][1][:2]
    assert replay_problems(t, rec, policy, params) == ["call 1 experts: 2 layers counted, the trace has 3"]
    rec = copy.deepcopy(good)
    rec["experts"]["routes"][2] = rec["experts"]["routes"][2][:2]
    assert replay_problems(t, rec, policy, params) == ["call 2 experts: 3 layers counted, the trace has 3"]
    rec = copy.deepcopy(good)
    rec["experts"]["counted"][0][2] = {"hits": 0}
    assert replay_problems(t, rec, policy, params) == ["call 0 layer 2: experts counted in a layer without experts"]
    rec = copy.deepcopy(good)
    rec["experts"]["routes"][3][2] = [0]
    assert replay_problems(t, rec, policy, params) == ["call 3 layer 2: experts counted in a layer without experts"]
    rec = copy.deepcopy(good)
    del rec["experts"]["routes"]
    assert replay_problems(t, rec, policy, params) == ["experts section unreadable against its trace (KeyError: 'routes')"]


def test_a_forecast_past_a_dense_layer_is_replayed_by_the_traces_version():
    """The forecast for the layer after a dense one comes from the MoE layer before it (trace
    version 3); an archive written before (trace version 2: no forecast there, nothing prefetched)
    still replays clean by its own rule. Catches a replay that expected no forecast past a dense
    layer (the engine's expert-forecast forecast nothing there), and one that read an old
    trace's empty sets there as forecasts made (a readback and zero prefetches the old engine
    never charged)."""
    t = expert_trace(skip=(1,))
    assert [forecast_possible(t.model, layer) for layer in range(3)] == [False, False, True]
    for policy, params in (CACHE, FORECAST):
        rec = faithful(t, policy, params)
        assert [n["forecast"] for n in rec["experts"]["counted"][1] if n is not None] == [None, [0, 1]]
        assert rec["calls"][1]["d2h_bytes"] == [4, 0, 8]  # routing, and the forecast's readback
        assert replay_problems(t, rec, policy, params) == []
    old = expert_trace(skip=(1,), version=2)
    rec = faithful(old, *FORECAST)
    assert rec["calls"][1]["d2h_bytes"] == [4, 0, 4] and rec["experts"]["counted"][1][2]["prefetched"] is None
    assert replay_problems(old, rec, *FORECAST) == []
    assert replay_problems(dataclasses.replace(old, version=3), rec, *FORECAST)[:2] == [
        "call 0 layer 2 d2h_bytes: recorded 4, the trace's replay 8",
        "call 1 layer 2 d2h_bytes: recorded 4, the trace's replay 8"]


def test_a_disagreement_does_not_hide_the_ones_after_it():
    """A ledger field of another shape, a call counted over the wrong number of layers and a
    layer without experts each leave the rest compared: the call's later fields, the later
    calls, the later layers. Catches the comparison of a call, of the calls after it or of the
    layers after a layer without experts stopped at the first line it writes."""
    t = row_trace()
    good = faithful(t, "packet", {})
    rec = copy.deepcopy(good)
    rec["calls"][1]["h2d_index_bytes"] = [16]  # another length: named whole
    rec["calls"][1]["d2h_bytes"] = [16, 99]  # a later field of the same call
    assert replay_problems(t, rec, "packet", {}) == [
        "call 1 h2d_index_bytes: recorded [16], the trace's replay [16, 16]",
        "call 1 layer 1 d2h_bytes: recorded 99, the trace's replay 16"]
    t = expert_trace(skip=(1,))  # a layer without experts between two with them
    policy, params = CACHE
    good = faithful(t, policy, params)
    rec = copy.deepcopy(good)
    rec["experts"]["counted"][1] = rec["experts"]["counted"][1][:2]
    rec["experts"]["counted"][3][2]["hits"] = 99
    want = good["experts"]["counted"][3][2]["hits"]
    assert replay_problems(t, rec, policy, params) == [
        "call 1 experts: 2 layers counted, the trace has 3",
        f"call 3 layer 2 hits: recorded 99, the trace's replay {want!r}"]


def test_a_forged_figure_is_shown_in_its_first_120_characters():
    """A figure's line is bounded, whatever a hostile record holds there: 120 characters of each
    side. Catches another cut (the line's width is what `packbench audit` prints)."""
    t = expert_trace(skip=(2,))
    policy, params = CACHE
    rec = faithful(t, policy, params)
    want = repr(rec["experts"]["decode"])[:120]
    rec["experts"]["decode"] = "d" * 300
    assert replay_problems(t, rec, policy, params) == [
        f"experts decode: recorded '{'d' * 119}, recomputed from the trace {want}"]


# ----------------------------------------------------------------------------- the episode's trace member


class _Condition:
    def __init__(self, policy: str, params: dict):
        self.policy, self.resolved_params = policy, params


class _Protocol:
    """The two things check_active_sets asks of a protocol: its condition names, and a condition."""
    def __init__(self, **conditions: _Condition):
        self.condition_names = tuple(conditions)
        self._conditions = conditions

    def condition(self, name: str) -> _Condition:
        return self._conditions[name]


NAME = "active/00000.trace"


def _check(tmp_path, rec: dict, data: bytes | None, *, complete=True, readable=True, proto=None) -> list[str]:
    from packbench.core.archive import ArchiveReader, ArchiveWriter
    from packbench.core.audit import _Audit
    path = tmp_path / "a.zip"
    w = ArchiveWriter(path)
    if data is not None:
        w.add_bytes(NAME, data)
    w.seal({})
    audit = _Audit(path, None)
    audit.complete = complete
    with ArchiveReader(path) as r:
        audit.names = set(r.names)
        audit.readable = set(r.names) if readable else set()
        audit.check_active_sets(r, NAME, rec, proto or _Protocol())
    return audit.problems


def test_an_episodes_trace_member_is_checked_against_its_record(tmp_path):
    """The trace member must be there (in a sealed archive, or named by the zip), be a trace, hold
    the record's calls with their phases and tokens, and active sets of the ledger's sizes; then
    its replay under the episode's condition must agree (the first 5 disagreements shown). Catches
    each check dropped, a missing trace tolerated in a sealed archive, and the replay run for a
    condition the protocol does not have or under another condition's policy."""
    from packbench.core.trace import trace_bytes
    t = row_trace()
    data = trace_bytes(t)
    good = {**faithful(t, "packet", {}), "condition": "p"}
    for call, traced in zip(good["calls"], t.calls):
        call.update(phase=traced.phase, tokens=traced.tokens)
    proto = _Protocol(p=_Condition("packet", {}), d=_Condition("dense-stream", {}))
    missing = f"{NAME}: the protocol says trace: true, the episode's trace is missing or unreadable"
    assert _check(tmp_path / "1", good, data, proto=proto) == []
    assert _check(tmp_path / "2", good, None) == [missing]
    assert _check(tmp_path / "3", good, None, complete=False) == []  # an interrupted screen: not written yet
    assert _check(tmp_path / "4", good, data, complete=False, readable=False) == [missing]  # held, but untrusted
    assert _check(tmp_path / "5", good, b"not a zip") == [f"{NAME} is not a readable trace: File is not a zip file"]
    assert _check(tmp_path / "6", {**good, "calls": good["calls"][:2]}, data) == [f"{NAME} holds 3 calls, the record 2"]
    assert _check(tmp_path / "7", {**good, "calls": None}, data) == [f"{NAME} holds 3 calls, the record none"]
    for c, change in [(1, {"phase": "prefill"}), (2, {"tokens": 2}), (0, None)]:
        rec = copy.deepcopy(good)
        rec["calls"][c] = "call" if change is None else {**rec["calls"][c], **change}
        assert _check(tmp_path / f"8{c}", rec, data) == [f"{NAME}: call {c}'s phase or tokens differ from the record's"]
    rec = copy.deepcopy(good)
    rec["calls"][2]["active_rows"] = [2, 1]  # the trace's call 2 has sets of 2 and 1 rows
    rec["calls"][1]["active_rows"] = [None, 2]  # not observed in layer 0: nothing to compare there
    assert _check(tmp_path / "9", rec, data) == []
    rec["calls"][2]["active_rows"] = [1, 2]
    assert _check(tmp_path / "10", rec, data) == [f"{NAME}: call 2's active sets differ in size from the ledger's "
                                                  f"active_rows"]
    rec = copy.deepcopy(good)
    for call in rec["calls"]:
        call["d2h_bytes"] = [1, 1]
        call["h2d_weight_bytes"] = [1, 1]
    shown = _check(tmp_path / "11", rec, data, proto=proto)
    assert len(shown) == 5 and shown[0] == f"{NAME}: call 0 layer 0 h2d_weight_bytes: recorded 1, the trace's replay 500"
    assert _check(tmp_path / "12", {**rec, "condition": "other"}, data, proto=proto) == []
    # replayed under the episode's own condition: packet's record is not dense-stream's
    assert _check(tmp_path / "13", {**good, "condition": "d"}, data, proto=proto)[0] == \
        f"{NAME}: call 0 layer 0 active_rows: recorded 5, the trace's replay None"


def test_an_episodes_trace_is_read_under_the_audits_bound_and_a_refusal_named_in_one_line(tmp_path, monkeypatch):
    """The auditor reads an archived trace's members under its own bound (ACTIVE_SETS_CAP, far
    below the trace format's 64 MiB header and 1 GiB of ids), and names a trace it refuses with
    the first 200 characters of the cause. Catches the bound left out (a forged trace member
    inflating to the format's bounds in the audit's memory) and a line cut elsewhere."""
    import io
    import json
    import zipfile

    from packbench.core import audit
    from packbench.core.trace import HEADER_NAME, trace_bytes
    t = row_trace()
    data = trace_bytes(t)
    rec = {"calls": [{"phase": c.phase, "tokens": c.tokens} for c in t.calls]}
    assert _check(tmp_path / "1", rec, data) == []
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    header = len(members[HEADER_NAME])
    monkeypatch.setattr(audit, "ACTIVE_SETS_CAP", header - 1)
    assert _check(tmp_path / "2", rec, data) == [
        f"{NAME} is not a readable trace: {HEADER_NAME} states {header} bytes, over the bound of {header - 1}; "
        f"split the trace into several files"]
    monkeypatch.undo()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for member, body in members.items():
            if member == HEADER_NAME:
                body = json.dumps({**json.loads(body), "version": "v" * 300}).encode()
            zf.writestr(member, body)
    assert _check(tmp_path / "3", rec, buf.getvalue()) == [
        f"{NAME} is not a readable trace: {('trace version ' + repr('v' * 300))[:200]}"]
