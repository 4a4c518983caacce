"""The auditor replays an MoE screen's archived traces (format v2, with forecasts) through the
simulator's ledger: a real tiny screen with expert caches and a forecast audits AGREE, and a
same-size edit of one forecast set, one active set or one stored hit count is a DISAGREE that
names the episode, call, layer and field."""

import io
import json
import zipfile

import numpy as np
import pytest
import torch

from cpu_screen import archive_screen, resealed
from packbench.core.archive import episode_members
from packbench.core.audit import audit_archive
from packbench.core.protocol import freeze
from packbench.core.trace import parse_trace, trace_bytes
from packbench.engine.moe.synth import synth_moe

CONDITIONS = [{"policy": "dense-stream"}, {"policy": "packet"},
              {"name": "lru4", "policy": "expert-cache", "params": {"capacity": 4}},
              {"name": "lru4-forecast", "policy": "expert-cache", "params": {"capacity": 4, "forecast": "on"}}]


@pytest.fixture(scope="module")
def screen(tmp_path_factory):
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("replay")
    moe = synth_moe(base / "mixtral", shape="mixtral-tiny", seed=2, dtype="float32")
    raw = {"name": "moe-trace", "model": {"path": str(moe)}, "dtype": "float32",
           "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 16, "continuation_tokens": 5,
           "conditions": CONDITIONS, "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
           "gates": {"faithfulness": {}}, "trace": True}
    path = base / "screen.zip"
    _, episodes, _ = archive_screen(freeze(raw), moe, path)
    return path, episodes


def forged(path, tmp_path, edit):
    """The archive with `edit(members)` applied to its member bytes, resealed, then audited."""
    return audit_archive(resealed(path, tmp_path / "forged.zip", edit))


def scored(episodes, condition) -> dict:
    return next(e for e in episodes if e["condition"] == condition and e["role"] == "scored")


def edit_trace(members, index, which):
    """Replace the first non-empty decode set of `which` ("sets" or "forecasts") by a set of the
    same size with one expert swapped for one it lacks; (call, layer) edited."""
    name = episode_members(index).active
    t = parse_trace(zipfile.ZipFile(io.BytesIO(members[name])))
    rows, units = getattr(t, which), t.model.units
    for c, row in enumerate(rows):
        if t.calls[c].phase != "decode":
            continue
        for layer, s in enumerate(row):
            if s.size:
                missing = next(e for e in range(units) if e not in s.tolist())
                row[layer] = np.sort(np.concatenate([s[1:], [missing]])).astype(s.dtype)
                members[name] = trace_bytes(t)
                return c, layer
    raise AssertionError(f"no non-empty decode {which}")


def test_a_traced_moe_screen_with_caches_and_a_forecast_audits_agree(screen):
    path, episodes = screen
    assert {e["status"] for e in episodes} == {"ok"}
    assert scored(episodes, "lru4-forecast")["experts"]["prefetched"] > 0  # the forecast ran
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]


@pytest.mark.parametrize("condition, which, field", [("lru4-forecast", "forecasts", "forecast"),
                                                     ("lru4", "sets", "routing")])
def test_a_same_size_edit_of_one_forecast_or_active_set_is_named(screen, tmp_path, condition, which, field):
    """Catches an auditor that checks only the trace's set sizes (the edit keeps every size), and a
    replay that reads the record's own routing rather than the archived trace."""
    path, episodes = screen
    e = scored(episodes, condition)
    where = {}
    report = forged(path, tmp_path, lambda m: where.update(cl=edit_trace(m, e["plan_index"], which)))
    c, layer = where["cl"]
    assert not report.agrees
    name = episode_members(e["plan_index"]).active
    assert any(p.startswith(f"{name}: call {c} layer {layer} {field}") for p in report.record["problems"]), \
        report.record["problems"]


def test_an_edit_of_one_stored_hit_count_is_named(screen, tmp_path):
    path, episodes = screen
    e = scored(episodes, "lru4")
    counted = e["experts"]["counted"]
    c, layer = next(c for c, row in enumerate(counted) if row[0]["misses"]), 0

    def edit(members):
        name = episode_members(e["plan_index"]).record
        rec = json.loads(members[name])
        n = rec["experts"]["counted"][c][layer]
        n["hits"], n["misses"] = n["hits"] + 1, n["misses"] - 1  # hits + misses unchanged: the ledger agrees
        members[name] = json.dumps(rec).encode()

    report = forged(path, tmp_path, edit)
    assert not report.agrees
    name = episode_members(e["plan_index"]).active
    # Catches a check of the counts against their sum alone (the edit keeps hits + misses).
    assert any(p.startswith(f"{name}: call {c} layer {layer} hits") for p in report.record["problems"]), \
        report.record["problems"]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_traced_screen_of_mapped_expert_gathers_audits_agree(tmp_path, batch):
    """Bug caught: the auditor replayed an archived trace of `packet {gather: mapped}` or
    `phase-switched {gather: mapped}` as the host gather (the simulator read every gather but
    `device` as `host`), so an honest traced screen audited DISAGREE: `active/00001.trace: call 1
    layer 0 h2d_index_bytes: recorded 0, the trace's replay 32` and `d2h_bytes: recorded 0, the
    trace's replay 16`. The mapped gather uploads no index and reads no routing back; a call of
    more than one token (a prefill, a batch's decode) reads its 4-byte expert count per layer."""
    moe = synth_moe(tmp_path / "olmoe", shape="olmoe-tiny", seed=2, dtype="float32", layers=2)
    raw = {"name": "moe-mapped", "model": {"path": str(moe)}, "dtype": "float32",
           "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 8, "continuation_tokens": 3,
           "conditions": [{"policy": "dense-stream"}, {"policy": "packet", "params": {"gather": "mapped"}},
                          {"policy": "phase-switched", "params": {"gather": "mapped"}}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}},
           "trace": True, **({"batch": batch} if batch > 1 else {})}
    path = tmp_path / "screen.zip"
    _, episodes, _ = archive_screen(freeze(raw), moe, path)
    assert {e["status"] for e in episodes} == {"ok"}
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]


def traced_beside(tmp_path, competitor: str):
    """A `trace: true` screen of dense-stream, packet and `competitor` on a one-layer OLMoE,
    archived on the CPU: (its path, its episodes), every episode ok and the audit AGREE."""
    moe = synth_moe(tmp_path / "olmoe", shape="olmoe-tiny", seed=2, dtype="float32", layers=1)
    raw = {"name": "moe-traced", "model": {"path": str(moe)}, "dtype": "float32",
           "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8, "continuation_tokens": 3,
           "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}, {"policy": competitor}],
           "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}},
           "trace": True}
    path = tmp_path / "screen.zip"
    _, episodes, _ = archive_screen(freeze(raw), moe, path)
    assert {e["status"] for e in episodes} == {"ok"}
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]
    return path, episodes


def test_a_traced_screen_with_an_exact_competitor_audits_agree(tmp_path):
    """Bug caught: `trace: true` beside an exact competitor (`accelerate`, stock transformers'
    modules under its own hooks) audited DISAGREE on an honest screen: the worker traces only
    packbench's own loaders (a competitor's model is not the CPU-first one), and the auditor asked
    every exact episode for one: `active/00002.trace: the protocol says trace: true, the episode's
    trace is missing or unreadable`. A competitor's episode has no trace to check; a loader's still must."""
    path, episodes = traced_beside(tmp_path, "accelerate")
    packet = scored(episodes, "packet")["plan_index"]
    name = episode_members(packet).active
    damaged = audit_archive(resealed(path, tmp_path / "damaged.zip", lambda m: m.update({name: b"not a trace"})))
    assert any(p.startswith(name) for p in damaged.record["problems"]), damaged.record["problems"]


def test_a_traced_screen_with_host_experts_audits_agree(tmp_path):
    """Bug caught: `trace: true` beside `host-experts` (an approximate competitor that computes
    the experts on the host with the CPU-first model itself) audited DISAGREE on an honest screen:
    the worker traced every episode run on its CPU-first model, approximate ones too, and the
    auditor allows a trace for exact episodes only (docs/archive.md): `member 'active/00002.trace'
    is not part of the archive of this plan`. Only exact episodes are traced now."""
    traced_beside(tmp_path, "host-experts")
