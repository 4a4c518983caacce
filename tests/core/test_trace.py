"""Trace files (core/trace.py) and the policies replayed on them (core/simulate.py), on hand-made
traces whose every byte is computed here by hand from the engine's rules (docs/traces.md)."""

import io
import json
import os
import zipfile

import numpy as np
import pytest

from packbench.core import simulate as sim
from packbench.core import trace as tr
from packbench.core.trace import Trace, TraceCall, TraceError, TraceModel, read_trace, trace_bytes, write_trace


def opt_trace(sets_by_call, *, phases=None, episodes=None, units=16, unit_bytes=100, layers=2, hidden=50) -> Trace:
    phases = phases or ["prefill"] + ["decode"] * (len(sets_by_call) - 1)
    episodes = episodes or [0] * len(sets_by_call)
    model = TraceModel(family="opt", unit="row", layers=layers, units=units, unit_bytes=unit_bytes, hidden=hidden,
                       dtype="float16", shape=None)
    calls = [TraceCall(episode=e, phase=p, tokens=4 if p == "prefill" else 1) for e, p in zip(episodes, phases)]
    return Trace(model=model, calls=calls, sets=[[np.array(s, dtype=np.int64) for s in row] for row in sets_by_call],
                 source={"tool": "hand"})


def reread(t: Trace) -> Trace:
    return tr.parse_trace(zipfile.ZipFile(io.BytesIO(trace_bytes(t))))


# ----------------------------------------------------------------------------- the format


def test_a_trace_round_trips_every_field(tmp_path):
    t = opt_trace([[[0, 3, 15], []], [[3], [1, 2]], [[0, 1, 2, 3], [9]]], episodes=[0, 0, 1],
                  phases=["prefill", "decode", "prefill"])
    back = read_trace(write_trace(t, tmp_path / "t.trace"))
    # Catches a writer or reader that drops a header field, reorders calls, or shifts a set by one offset.
    assert back.model == t.model
    assert back.calls == t.calls
    assert back.source == t.source
    assert [[s.tolist() for s in row] for row in back.sets] == [[s.tolist() for s in row] for row in t.sets]
    assert back.episodes() == [[0, 1], [2]]


def _zip(members: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _members(t: Trace) -> dict:
    with zipfile.ZipFile(io.BytesIO(trace_bytes(t))) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _with_header(members: dict, **changes) -> dict:
    h = json.loads(members["header.json"])
    for key, value in changes.items():
        if key.startswith("model_"):
            h["model"][key[6:]] = value
        else:
            h[key] = value
    return {**members, "header.json": json.dumps(h)}


def _refused(tmp_path, data: bytes, *words: str) -> str:
    p = tmp_path / "bad.trace"
    p.write_bytes(data)
    with pytest.raises(TraceError) as e:
        read_trace(p)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_hostile_files_are_refused_with_one_line(tmp_path):
    good = _members(opt_trace([[[0, 3], [1]], [[3], []]]))
    data = trace_bytes(opt_trace([[[0, 3], [1]], [[3], []]]))
    # Each catches a reader that trusts what it was given: a truncated zip, another version,
    # an id past the model's units, an unsorted set, offsets that do not cover the ids, a missing member.
    _refused(tmp_path, data[: len(data) // 2], "truncated")
    _refused(tmp_path, _zip(_with_header(good, version=3)), "version 3", "upgrade")
    _refused(tmp_path, _zip(_with_header(good, format="other")), "not a packbench trace")
    _refused(tmp_path, _zip(_with_header(good, model_units=3)), "out of range", "3 rows")
    _refused(tmp_path, _zip({**good, "indices.npy": _npy(np.array([3, 0, 1, 3], dtype="<u4"))}), "strictly increasing")
    _refused(tmp_path, _zip({**good, "offsets.npy": _npy(np.array([0, 2, 3, 4], dtype="<i8"))}), "offsets")
    _refused(tmp_path, _zip({k: v for k, v in good.items() if k != "indices.npy"}), "indices.npy")
    _refused(tmp_path, _zip({**good, "indices.npy": _npy(np.array([0, 3, 1, 3], dtype="<i4"))}), "<u4")
    _refused(tmp_path, _zip(_with_header(good, calls=[{"episode": 0, "phase": "warm", "tokens": 1}] * 2)), "phase")
    _refused(tmp_path, b"not a zip at all", "not a readable trace zip")


def test_a_member_over_its_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    members = _members(opt_trace([[[0, 3], [1]]]))
    # A 2 MB run of zeros compresses to a few kB: the bound is on what the member holds, not the file.
    members["header.json"] = members["header.json"] + b" " * 2_000_000
    monkeypatch.setattr(tr, "MAX_HEADER_BYTES", 1_000_000)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    assert len(buf.getvalue()) < 100_000
    # Catches a reader that inflates a member whatever its size (a zip bomb).
    _refused(tmp_path, buf.getvalue(), "header.json", "over the bound")


def test_a_huge_file_is_refused_by_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(tr, "MAX_FILE_BYTES", 1000)
    # Catches a reader that reads a file of any size into memory.
    _refused(tmp_path, b"\0" * 1001, "over the bound of 1000")


def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # Each catches a reader that would block forever (a FIFO without a writer, /dev/zero) or crash (a directory).
    for path in (tmp_path, fifo, "/dev/zero"):
        with pytest.raises(TraceError, match="not a regular file"):
            read_trace(path)
    with pytest.raises(TraceError, match="cannot read it"):
        read_trace(tmp_path / "absent.trace")


# ----------------------------------------------------------------------------- bytes by hand

# A 2-layer OPT of 16 rows of 100 B (hidden 50): a prefill and two decode calls.
SETS = [[[0, 1, 2, 3, 8], [4, 5]], [[1, 2], [5, 9]], [[2, 7], [9]]]


def _per_call(name: str, params: dict, key: str, t: Trace | None = None) -> list[list]:
    return [c[key] for c in sim.ledger(reread(t or opt_trace(SETS)), name, params)]


def test_packet_host_and_device_by_hand():
    # host: every active row (100 B) and its int64 index; a 16-byte mask read back per layer.
    assert _per_call("packet", {}, "h2d_weight_bytes") == [[500, 200], [200, 200], [200, 100]]
    assert _per_call("packet", {}, "h2d_index_bytes") == [[40, 16], [16, 16], [16, 8]]
    assert _per_call("packet", {}, "d2h_bytes") == [[16, 16]] * 3
    assert _per_call("packet", {}, "active_rows") == [[5, 2], [2, 2], [2, 1]]
    # device: no index, one int32 count per layer read back after the call.
    assert _per_call("packet", {"gather": "device"}, "h2d_index_bytes") == [[0, 0]] * 3
    assert _per_call("packet", {"gather": "device"}, "d2h_bytes") == [[4, 4]] * 3
    # int8 rows: hidden int8 values + a float32 scale = 54 B a row.
    assert _per_call("packet", {"weights": "int8"}, "h2d_weight_bytes") == [[270, 108], [108, 108], [108, 54]]


def test_dense_resident_and_phase_switched_by_hand():
    assert _per_call("dense-stream", {}, "h2d_weight_bytes") == [[1600, 1600]] * 3
    assert _per_call("dense-stream", {}, "active_rows") == [[None, None]] * 3  # dense-stream observes nothing
    assert _per_call("resident", {}, "h2d_weight_bytes") == [[0, 0]] * 3
    # Catches a phase-switched that streams a decode call or packs a prefill.
    assert _per_call("phase-switched", {}, "h2d_weight_bytes") == [[1600, 1600], [200, 200], [200, 100]]
    assert _per_call("phase-switched", {}, "d2h_bytes") == [[0, 0], [16, 16], [16, 16]]


def test_sparse_extents_by_hand():
    # blocks of 4 rows: layer 0's prefill {0,1,2,3,8} -> blocks 0 and 2: 8 rows, 2 block ids.
    w = _per_call("sparse-extents", {"block_rows": 4}, "h2d_weight_bytes")
    i = _per_call("sparse-extents", {"block_rows": 4}, "h2d_index_bytes")
    assert w == [[800, 400], [400, 800], [800, 400]]
    assert i == [[16, 8], [8, 16], [16, 8]]
    # A last block cut short: 10 rows, blocks of 4, row 9 -> block 2 holds rows 8 and 9 only.
    t = opt_trace([[[9]]], units=10, layers=1)
    assert _per_call("sparse-extents", {"block_rows": 4}, "rows_copied", t) == [[2]]


def test_row_retention_by_hand():
    # 2 slots a layer. Layer 0: prefill {0,1,2,3,8}: 5 misses, fills the last 2 (3, 8).
    # decode {1,2}: 2 misses (the cache holds 3 and 8), fills both. decode {2,7}: 2 a hit, 7 a miss.
    rows = _per_call("row-retention", {"rows_per_layer": 2}, "rows_copied")
    hits = _per_call("row-retention", {"rows_per_layer": 2}, "hits")
    index = _per_call("row-retention", {"rows_per_layer": 2}, "h2d_index_bytes")
    assert [r[0] for r in rows] == [5, 2, 1]
    assert [h[0] for h in hits] == [0, 0, 1]
    # misses' indices + fills' slots + a hit's slot and row: 5*8 + 2*8; 2*8 + 2*8; 1*8 + 1*8 + 2*8.
    assert [x[0] for x in index] == [56, 32, 32]
    # Layer 1: {4,5} fills both; {5,9}: 5 hits, 9 misses; {9}: a hit.
    assert [r[1] for r in rows] == [2, 1, 0] and [h[1] for h in hits] == [0, 1, 1]


def test_early_forecast_host_and_device_by_hand():
    # Layer 0: decode 1 forecasts the prefill's {0,1,2,3,8}: 5 rows sent early, {1,2} active: 3 wasted, 0 left.
    # Decode 2 forecasts {1,2}: {2,7} active: 1 wasted, 7 sent after fc1.
    for gather in ("host", "device"):
        rows = _per_call("early-forecast", {"gather": gather}, "rows_copied")
        wasted = _per_call("early-forecast", {"gather": gather}, "rows_wasted")
        assert [r[0] for r in rows] == [5, 5, 3], gather
        assert [w[0] for w in wasted] == [0, 3, 1], gather
    assert [x[0] for x in _per_call("early-forecast", {}, "h2d_index_bytes")] == [40, 40, 24]
    assert _per_call("early-forecast", {"gather": "device"}, "d2h_bytes") == [[16, 16]] * 3


def test_every_episode_starts_with_a_fresh_policy():
    # Two episodes of the same prefill: the second's cache and forecast start empty, as a screen's
    # fresh policy per episode does. Catches state carried across episodes.
    t = opt_trace([[[1, 2], [3]], [[1, 2], [3]]], phases=["prefill", "prefill"], episodes=[0, 1])
    assert _per_call("row-retention", {"rows_per_layer": 4}, "hits", t) == [[0, 0], [0, 0]]


def test_experts_by_hand():
    model = TraceModel(family="mixtral", unit="expert", layers=3, units=8, unit_bytes=1000, k=2,
                       layers_without_units=(1,))
    t = Trace(model=model, calls=[TraceCall(0, "prefill", 3), TraceCall(0, "decode", 1)],
              sets=[[np.array([0, 2, 5]), np.zeros(0, dtype=np.int64), np.array([1, 7])],
                    [np.array([2, 5]), np.zeros(0, dtype=np.int64), np.array([0, 3])]])
    t = reread(t)
    assert _per_call("packet", {}, "h2d_weight_bytes", t) == [[3000, 0, 2000], [2000, 0, 2000]]
    assert _per_call("packet", {}, "h2d_index_bytes", t) == [[24, 0, 16], [16, 0, 16]]
    assert _per_call("packet", {"gather": "device"}, "h2d_index_bytes", t) == [[0, 0, 0], [0, 0, 0]]
    # The routing readback: one byte per expert, only where the policy reads the routing.
    assert _per_call("packet", {}, "d2h_bytes", t) == [[8, 0, 8], [8, 0, 8]]
    assert _per_call("dense-stream", {}, "h2d_weight_bytes", t) == [[8000, 0, 8000], [8000, 0, 8000]]
    assert _per_call("phase-switched", {}, "h2d_weight_bytes", t) == [[8000, 0, 8000], [2000, 0, 2000]]
    assert _per_call("phase-switched", {}, "d2h_bytes", t) == [[0, 0, 0], [8, 0, 8]]


# ----------------------------------------------------------------------------- policies and time


def test_policy_specs_are_checked():
    assert sim.parse_policy("row-retention:rows_per_layer=512", "row") == ("row-retention", {"rows_per_layer": 512})
    for bad, words in (("row-retention:rows=5", "not one of"), ("packet:gather=gpu", "host, device"),
                       ("sparse-extents", None), ("early-forecast", None)):
        if words is None:
            with pytest.raises(sim.SimulateError, match="cannot be simulated"):
                sim.parse_policy(bad, "expert")  # OPT-only policies on experts
        else:
            with pytest.raises(sim.SimulateError, match=words):
                sim.parse_policy(bad, "row")
    with pytest.raises(sim.SimulateError, match="rows_per_layer"):
        sim.ledger(opt_trace(SETS), "row-retention", {})


MACHINE = {"name": "m", "pinned_h2d_gbps": {"value": 50.0, "source": "s"},
           "decode_compute_ms": {"mixtral-8x7b:4": {"value": 8.0, "source": "s"}}}


def test_predicted_time_is_compute_plus_bytes_at_the_copy_rate():
    model = TraceModel(family="mixtral", unit="expert", layers=8, units=8, unit_bytes=10**6, k=2, shape="mixtral-8x7b")
    t = Trace(model=model, calls=[TraceCall(0, "prefill", 2)] + [TraceCall(0, "decode", 1)] * 2,
              sets=[[np.array([0, 1, 2])] * 8] + [[np.array([3, 4])] * 8] * 2)
    totals = sim.totals(sim.ledger(t, "packet", {"gather": "device"}))
    p = sim.predict(t, "packet", {"gather": "device"}, totals, MACHINE)
    # 2 experts x 8 layers x 1 MB a token at 50 GB/s = 0.32 ms; compute scaled 8/4 of 8 ms = 16 ms.
    assert p["copy_ms_per_token"] == pytest.approx(0.32)
    assert p["compute_ms_per_token"] == pytest.approx(16.0)
    assert p["decode_ms_per_token"] == pytest.approx(16.32)
    assert "scaled by layers" in p["compute_source"] and p["overlap"] == "serial"
    unnamed = Trace(model=TraceModel(family="x", unit="expert", layers=1, units=8, unit_bytes=1), calls=t.calls[:2],
                    sets=[[np.array([0])]] * 2)
    q = sim.predict(unnamed, "packet", {}, sim.totals(sim.ledger(unnamed, "packet", {})), MACHINE)
    assert q["decode_ms_per_token"] is None and "decode_compute_ms" in q["why"]


def test_machine_files_are_checked():
    assert sim.machine_problem(MACHINE) is None
    assert "pinned_h2d_gbps" in sim.machine_problem({**MACHINE, "pinned_h2d_gbps": {"value": 0, "source": "s"}})
    assert "shape:layers" in sim.machine_problem({**MACHINE, "decode_compute_ms": {"mixtral": {"value": 1, "source": "s"}}})
    assert sim.machine_problem([]) is not None


def test_the_docs_example_writes_a_trace_packbench_reads(tmp_path):
    """docs/traces.md's few lines for a published routing dump, run as written."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "traces.md").read_text()
    ns: dict = {}
    exec(re.search(r"```python\n(.*?)```", doc, re.S).group(1), ns)
    rng = np.random.default_rng(0)
    routes = [np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(20)]) for _ in range(4)])
              for _ in range(2)]  # 2 episodes: (layers 4, tokens 20, k 2)
    ns["write"](tmp_path / "pub.trace", routes, prefix=12, experts=8, k=2, expert_bytes=352_321_536)
    t = read_trace(tmp_path / "pub.trace")
    # Catches a doc example that drifted from the format: 2 episodes of 1 prefill + 8 decode calls,
    # each decode call k = 2 experts in each of the 4 layers.
    assert [(c.episode, c.phase, c.tokens) for c in t.calls[:2]] == [(0, "prefill", 12), (0, "decode", 1)]
    assert len(t.calls) == 18 and t.model.shape == "mixtral-8x7b"
    decode = sim.totals(sim.ledger(t, "packet", {"gather": "device"}))["decode"]
    assert decode["rows_copied"] == 16 * 4 * 2 and decode["h2d_weight_bytes"] == 128 * 352_321_536


def test_the_estimate_prices_an_index_as_the_ledger_does():
    from packbench.core import charges
    from packbench.core import moe
    from packbench.core.conditions import base

    # Catches an estimator (core/conditions, core/moe.py) whose index size drifted from the ledger's.
    assert base.INDEX_BYTES == moe.INDEX_BYTES == charges.INDEX_BYTES == 8


def test_too_many_sets_are_refused_before_the_sets_are_made(tmp_path, monkeypatch):
    data = trace_bytes(opt_trace([[[0], [1]]] * 3))
    monkeypatch.setattr(tr, "MAX_SETS", 5)
    # 3 calls x 2 layers = 6 sets: catches a reader that builds one array per set of any count.
    _refused(tmp_path, data, "more than 5 sets")
