"""The auditor holds an MoE episode's trace to its record: the trace's active experts are the
record's routing and the trace's forecasts the ones the policy counted, call by call and layer by
layer (core/audit.py trace_experts_problem). A real tiny screen with an expert cache and its
forecast, `trace: true`, audits AGREE; a trace whose routing or forecast is changed in one place,
or a record whose routing is, is named by call and layer."""

import io
import json
import zipfile

import pytest

from cpu_screen import archive_screen
from packbench.core.archive import ArchiveReader, episode_members
from packbench.core.audit import audit_archive, trace_experts_problem
from packbench.core.protocol import freeze
from packbench.core.trace import parse_trace


@pytest.fixture(scope="module")
def screen(tmp_path_factory):
    from packbench.engine.moe.synth import synth_moe

    root = tmp_path_factory.mktemp("moe-traced")
    model = synth_moe(root / "qwen3-moe-tiny", shape="qwen3-moe-tiny", seed=3, dtype="float32")
    body = {"name": "traced-moe", "model": {"path": str(model)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 12, "continuation_tokens": 5,
            "conditions": [{"policy": "dense-stream"},
                           {"name": "lru-2-forecast", "policy": "expert-cache",
                            "params": {"capacity": 2, "forecast": "on"}}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}},
            "trace": True}
    path = root / "screen.zip"
    _, episodes, _ = archive_screen(freeze(body), model, path)
    return path, episodes


def cache_episode(screen):
    path, episodes = screen
    e = next(e for e in episodes if e["condition"] == "lru-2-forecast" and e["role"] == "scored")
    with ArchiveReader(path) as reader:
        trace = parse_trace(zipfile.ZipFile(io.BytesIO(reader.read_bytes(episode_members(e["plan_index"]).active))))
        record = json.loads(reader.read_bytes(episode_members(e["plan_index"]).record))
    return trace, record


def test_a_real_screen_audits_and_its_traces_agree_with_its_records(screen):
    path, _ = screen
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]
    trace, record = cache_episode(screen)
    assert trace.forecasts is not None and record["experts"]["routes"]
    # the check has something to compare: at least one counted forecast
    assert any(isinstance(n, dict) and n.get("forecast") for call in record["experts"]["counted"] for n in call)
    assert trace_experts_problem(trace, record["experts"]) is None


def _first(sets, predicate):
    for c, row in enumerate(sets):
        for layer, s in enumerate(row):
            if predicate(c, layer, s):
                return c, layer
    raise AssertionError("nothing to change")


def test_one_changed_routed_expert_in_the_trace_is_named(screen):
    """Same size, one id swapped for one not routed there: the size check alone passes it."""
    import numpy as np

    trace, record = cache_episode(screen)
    experts = trace.model.units
    c, layer = _first(trace.sets, lambda c, l, s: 0 < s.size < experts)
    s = trace.sets[c][layer]
    other = next(e for e in range(experts) if e not in set(s.tolist()))
    trace.sets[c][layer] = np.sort(np.concatenate([s[1:], [other]])).astype(np.int64)
    assert trace_experts_problem(trace, record["experts"]) == (
        f"call {c} layer {layer}: the trace's active experts are not the record's routing")


def test_one_changed_forecast_is_named(screen):
    import numpy as np

    trace, record = cache_episode(screen)
    counted = record["experts"]["counted"]
    c, layer = _first(trace.forecasts, lambda c, l, s: s.size > 0 and isinstance(counted[c][l], dict)
                      and counted[c][l].get("forecast") is not None)
    s = trace.forecasts[c][layer]
    other = next(e for e in range(trace.model.units) if e not in set(s.tolist()))
    trace.forecasts[c][layer] = np.sort(np.concatenate([s[1:], [other]])).astype(np.int64)
    assert trace_experts_problem(trace, record["experts"]) == (
        f"call {c} layer {layer}: the trace's forecast is not the one the record counted")


def test_a_record_whose_routing_changed_is_named_and_no_section_is_no_problem(screen):
    trace, record = cache_episode(screen)
    experts = record["experts"]
    c, layer = next((c, l) for c, row in enumerate(experts["routes"]) for l, r in enumerate(row) if r)
    experts["routes"][c][layer] = experts["routes"][c][layer][1:]
    assert trace_experts_problem(trace, experts) == (
        f"call {c} layer {layer}: the trace's active experts are not the record's routing")
    experts["routes"] = experts["routes"][:-1]
    assert "routes" in trace_experts_problem(trace, experts) and "calls" in trace_experts_problem(trace, experts)
    assert trace_experts_problem(trace, None) is None  # a packet's record has no experts section


def test_the_audit_of_a_resealed_archive_with_a_changed_forecast_disagrees(screen, tmp_path):
    """The check is wired into the auditor: an archive resealed with one forecast changed (every
    member's digest valid, sizes unchanged) is a DISAGREE naming the episode's trace."""
    import numpy as np

    from packbench.core.archive import MANIFEST_NAME, ArchiveWriter
    from packbench.core.trace import trace_bytes

    path, episodes = screen
    e = next(e for e in episodes if e["condition"] == "lru-2-forecast" and e["role"] == "scored")
    name = episode_members(e["plan_index"]).active
    with ArchiveReader(path) as reader:
        names = [n for n in reader.names if n != MANIFEST_NAME]
        manifest = reader.manifest
        members = {n: reader.read_bytes(n) for n in names}
    trace, record = cache_episode(screen)
    counted = record["experts"]["counted"]
    c, layer = _first(trace.forecasts, lambda c, l, s: s.size > 0 and isinstance(counted[c][l], dict)
                      and counted[c][l].get("forecast") is not None)
    s = trace.forecasts[c][layer]
    other = next(x for x in range(trace.model.units) if x not in set(s.tolist()))
    trace.forecasts[c][layer] = np.sort(np.concatenate([s[1:], [other]])).astype(np.int64)
    members[name] = trace_bytes(trace)
    forged = tmp_path / "forged.zip"
    w = ArchiveWriter(forged)
    for n in names:
        if n.endswith(".json"):
            w.add_json(n, json.loads(members[n]))
        else:
            w.add_bytes(n, members[n])
    w.seal({k: v for k, v in manifest.items() if k != "members"})
    bad = audit_archive(forged)
    assert not bad.agrees
    assert f"{name}: call {c} layer {layer}: the trace's forecast is not the one the record counted" in \
        bad.record["problems"], bad.record["problems"]
