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


def test_a_write_that_fails_part_way_leaves_no_file(tmp_path):
    """A trace cut short by a full disk was left at its path (model stats --trace then refused every
    retry: the path exists) and a half-written file is no trace. Here the file size limit
    (RLIMIT_FSIZE, SIGXFSZ ignored) makes the write fail part-way, as a full disk would."""
    import resource
    import signal

    t = opt_trace([[list(range(16)), list(range(0, 16, 3))]] * 200)
    out = tmp_path / "t.trace"
    limit = len(trace_bytes(t)) // 2
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        with pytest.raises(TraceError, match="cannot write the trace"):
            write_trace(t, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert os.listdir(tmp_path) == []
    assert read_trace(write_trace(t, out)).calls == t.calls  # a retry then writes it whole


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
    _refused(tmp_path, _zip(_with_header(good, version=4)), "version 4", "upgrade")
    _refused(tmp_path, _zip(_with_header(good, version=3.0)), "version 3.0", "upgrade")
    # A version that only compares equal to a readable one (`true == 1`, `2.0 == 2`) was read as it.
    _refused(tmp_path, _zip(_with_header(good, version=True)), "version True", "upgrade")
    _refused(tmp_path, _zip(_with_header(good, version=2.0)), "version 2.0", "upgrade")
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


def test_a_prefill_after_decode_calls_is_never_forecast():
    """early-forecast forecasts decode calls only, with either gather (engine/policies: a prefill
    has no forecast): an episode's later prefill (a second pass) sends its whole demand after fc1,
    nothing wasted. Catches the planted bug "simulate: device early-forecast forecasts prefill"."""
    t = opt_trace([[[0, 1]], [[1, 2]], [[2, 3]]], phases=["prefill", "decode", "prefill"], layers=1)
    for gather in ("host", "device"):
        # decode: {0, 1} forecast, {1, 2} active: 0 wasted, 2 sent after fc1 (3 rows in all)
        assert _per_call("early-forecast", {"gather": gather}, "rows_copied", t) == [[2], [3], [2]], gather
        assert _per_call("early-forecast", {"gather": gather}, "rows_wasted", t) == [[0], [1], [0]], gather


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


def cache_trace(*, forecasts: bool = True) -> Trace:
    """Two MoE layers of 4 experts (1000 B each), one episode of a prefill and 3 decode calls.
    Layer 0 routes 01, 01, 23, 01: frequency and recency disagree at the last call. Layer 1
    routes 01, 23, 23, 03, and layer 0's input forecast 02, 23, 12, 03 for it."""
    model = TraceModel(family="mixtral", unit="expert", layers=2, units=4, unit_bytes=1000, k=2)
    a = lambda *ids: np.array(ids, dtype=np.int64)  # noqa: E731
    sets = [[a(0, 1), a(0, 1)], [a(0, 1), a(2, 3)], [a(2, 3), a(2, 3)], [a(0, 1), a(0, 3)]]
    f = [[a(), a(0, 2)], [a(), a(2, 3)], [a(), a(1, 2)], [a(), a(0, 3)]]
    calls = [TraceCall(0, "prefill", 3)] + [TraceCall(0, "decode", 1)] * 3
    return Trace(model=model, calls=calls, sets=sets, forecasts=f if forecasts else None)


def test_expert_caches_by_hand():
    t = cache_trace()
    lru, lfu = {"capacity": 2, "rule": "lru"}, {"capacity": 2, "rule": "lfu"}
    # Layer 0, capacity 2. LRU: 23 evicts 01 at call 2, so call 3 misses both; LFU keeps 01
    # (routed twice) over 23 (once) and hits both. Belady (the future known) hits as LFU.
    # Catches a cache with the other rule's ranking, or a miss admitted over a more frequent expert.
    assert [h[0] for h in _per_call("expert-cache", lru, "hits", t)] == [0, 2, 0, 0]
    assert [h[0] for h in _per_call("expert-cache", lfu, "hits", t)] == [0, 2, 0, 2]
    assert [h[0] for h in _per_call("expert-cache", lru, "belady_hits", t)] == [0, 2, 0, 2]
    assert [h[0] for h in _per_call("expert-cache", lfu, "misses", t)] == [2, 0, 2, 0]
    # Misses move, hits do not; the routing readback is one byte per expert (4 B).
    assert _per_call("expert-cache", lfu, "h2d_weight_bytes", t) == [[2000, 2000], [0, 2000], [2000, 0], [0, 1000]]
    assert _per_call("expert-cache", lfu, "d2h_bytes", t) == [[4, 4]] * 4
    assert _per_call("expert-cache", lfu, "h2d_index_bytes", t) == [[0, 0]] * 4  # the device gather: no index
    d = sim.totals(sim.ledger(t, "expert-cache", lru))["decode"]
    assert (d["hits"], d["misses"], d["belady_hits"], d["active_rows"]) == (2 + 2 + 1, 4 + 2 + 0 + 1, 4 + 3, 12)
    assert d["hit_rate"] == pytest.approx(5 / 12) and d["belady_rate"] == pytest.approx(7 / 12)


def test_each_phases_belady_bounds_the_caches_of_a_trace_with_a_second_prefill():
    """A published multi-turn episode: prefill, 2 decode calls, a second turn's prefill, a decode.
    Catches `simulate` splitting one plain Belady run by phase: its decode share (5 of 7) was
    below LFU's decode hits (6), so the table printed hit% 85.7 beside belady% 71.4."""
    model = TraceModel(family="mixtral", unit="expert", layers=1, units=4, unit_bytes=1000, k=3)
    phases = ["prefill", "decode", "decode", "prefill", "decode"]
    routes = [[0, 2], [0, 2], [0, 1, 2], [0, 1], [0, 2]]
    t = Trace(model=model, calls=[TraceCall(0, p, 3 if p == "prefill" else 1) for p in phases],
              sets=[[np.array(r, dtype=np.int64)] for r in routes])
    lfu, lru = {"capacity": 2, "rule": "lfu"}, {"capacity": 2, "rule": "lru"}
    assert [h[0] for h in _per_call("expert-cache", lfu, "hits", t)] == [0, 2, 2, 1, 2]
    assert [h[0] for h in _per_call("expert-cache", lru, "hits", t)] == [0, 2, 2, 2, 1]  # prefill 2 = its optimum
    # Per call: in a decode call the hits of the run best for decode calls, in a prefill those of
    # the run best for prefills; each phase's sum is that phase's optimum.
    assert [h[0] for h in _per_call("expert-cache", lfu, "belady_hits", t)] == [0, 2, 2, 2, 2]
    for params in (lfu, lru):
        tot = sim.totals(sim.ledger(reread(t), "expert-cache", params))
        assert (tot["decode"]["belady_hits"], tot["decode"]["active_rows"]) == (6, 7)
        assert (tot["prefill"]["belady_hits"], tot["prefill"]["active_rows"]) == (2, 4)
        for phase in ("prefill", "decode"):
            assert tot[phase]["hits"] <= tot[phase]["belady_hits"], (params, phase)
            assert tot[phase]["hit_rate"] <= tot[phase]["belady_rate"], (params, phase)


def test_expert_forecasts_by_hand():
    t = cache_trace()
    # expert-forecast (no cache): layer 1's forecast 02 for routed 01 prefetches 02 (0 used, 2
    # wasted) and fetches 1; each forecast also reads the next router's choice back (4 B).
    # Layer 0 has no forecast (nothing before it). Catches a forecast charged to the wrong layer,
    # waste not counted, or a used prefetch fetched again.
    assert _per_call("expert-forecast", {}, "rows_copied", t) == [[2, 3], [2, 2], [2, 3], [2, 2]]
    assert _per_call("expert-forecast", {}, "rows_wasted", t) == [[0, 1], [0, 0], [0, 1], [0, 0]]
    assert _per_call("expert-forecast", {}, "prefetched", t) == [[None, 2]] * 4
    assert _per_call("expert-forecast", {}, "used", t) == [[None, 1], [None, 2], [None, 1], [None, 2]]
    assert _per_call("expert-forecast", {}, "d2h_bytes", t) == [[4, 8]] * 4
    # LRU 2 + forecast, layer 1: call 2 holds 23, so the forecast 12 prefetches 1 alone (wasted);
    # call 3 holds 23, prefetches 0 (used) and hits 3. A prefetch is never admitted unless routed.
    on = {"capacity": 2, "rule": "lru", "forecast": "on"}
    assert [r[1] for r in _per_call("expert-cache", on, "hits", t)] == [0, 0, 2, 1]
    assert [r[1] for r in _per_call("expert-cache", on, "misses", t)] == [2, 2, 0, 1]
    assert [r[1] for r in _per_call("expert-cache", on, "prefetched", t)] == [2, 2, 1, 1]
    assert [r[1] for r in _per_call("expert-cache", on, "used", t)] == [1, 2, 0, 1]
    assert [r[1] for r in _per_call("expert-cache", on, "rows_wasted", t)] == [1, 0, 1, 0]
    assert [r[1] for r in _per_call("expert-cache", on, "rows_copied", t)] == [3, 2, 1, 1]
    # Forecast off: the forecast sets are not read.
    assert [r[1] for r in _per_call("expert-cache", {"capacity": 2}, "prefetched", t)] == [None] * 4


def test_forecast_sets_round_trip_and_old_files_still_read(tmp_path):
    t = cache_trace()
    back = reread(t)
    # Catches a writer that drops the forecast members or shifts a set by one offset.
    assert [[f.tolist() for f in row] for row in back.forecasts] == [[f.tolist() for f in row] for row in t.forecasts]
    # A version-1 file (no forecast members) still reads; the forecast policies refuse it in one
    # line, the others replay it.
    v1 = _with_header(_members(cache_trace(forecasts=False)), version=1)
    p = tmp_path / "v1.trace"
    p.write_bytes(_zip(v1))
    old = read_trace(p)
    assert old.forecasts is None and len(old.calls) == 4
    assert [h[0] for h in [c["hits"] for c in sim.ledger(old, "expert-cache", {"capacity": 2, "rule": "lfu"})]] == [
        0, 2, 0, 2]
    for name, params in (("expert-forecast", {}), ("expert-cache", {"capacity": 2, "forecast": "on"})):
        with pytest.raises(sim.SimulateError, match="forecast sets") as e:
            sim.ledger(old, name, params)
        assert "\n" not in str(e.value)
    good = _members(t)
    # Each catches a reader that trusts a forecast member: one without its pair, forecast members
    # in a version-1 file, a forecast for layer 0 (nothing before it to forecast from).
    _refused(tmp_path, _zip({k: v for k, v in good.items() if k != "forecast_indices.npy"}), "without its pair")
    _refused(tmp_path, _zip(_with_header(good, version=1)), "version-1")
    bad = {**good, "forecast_offsets.npy": _npy(np.array([0, 1, 3, 3, 5, 5, 7, 7, 9], dtype="<i8")),
           "forecast_indices.npy": _npy(np.array([3, 0, 2, 2, 3, 1, 2, 0, 3], dtype="<u4"))}
    _refused(tmp_path, _zip(bad), "layer 0")


def test_no_forecast_is_made_for_or_after_a_layer_without_experts(tmp_path):
    """A forecast for layer l comes from the MoE input of the layer with experts before it
    (version 3): none for a dense layer or the first layer with experts, one for a layer after a
    dense one (a Qwen3-MoE with `decoder_sparse_step` 2). Version-2 files were written by an
    engine that forecast from layer l-1 alone (none for layer 0, a dense layer or the layer after
    one): they are read by that rule, and a file that holds a forecast where its rule makes none
    is refused. Catches the planted bug "trace: forecast after a dense layer allowed" (version 2),
    and the bug where version 3 kept that rule: the layer after a dense one never had a forecast,
    so expert-forecast replayed as a plain packet on such a model."""
    model = TraceModel(family="qwen3_moe", unit="expert", layers=5, units=4, unit_bytes=1000, k=2,
                       layers_without_units=(0, 2))
    assert tr.VERSION == 3
    assert [tr.forecast_possible(model, layer) for layer in range(5)] == [False, False, False, True, True]
    assert [tr.forecast_possible(model, layer, 2) for layer in range(5)] == [False, False, False, False, True]
    a = lambda *ids: np.array(ids, dtype=np.int64)  # noqa: E731
    sets = [[a(), a(0, 1), a(), a(0, 3), a(1, 2)]]
    calls = [TraceCall(0, "prefill", 2)]
    t = Trace(model=model, calls=calls, sets=sets, forecasts=[[a(), a(2), a(), a(0), a(1)]])
    with pytest.raises(TraceError) as e:
        trace_bytes(t)  # the writer reads back what it wrote
    assert str(e.value) == ("call 0 has a forecast for layer 1, where none can be made (a layer without units, "
                            "or the first layer with units); empty it")
    t.forecasts[0][1] = a()
    back = reread(t)
    assert back.version == 3 and json.loads(_members(t)["header.json"])["version"] == 3
    assert [f.tolist() for f in back.forecasts[0]] == [[], [], [], [0], [1]]
    ledger = sim.ledger(back, "expert-forecast", {})[0]
    assert ledger["prefetched"] == [None, None, None, 1, 1] and ledger["used"] == [None, None, None, 1, 1]
    # A version-2 file: layer 3 (after dense layer 2) has no forecast; one there is refused.
    old = Trace(model=model, calls=calls, sets=sets, forecasts=[[a(), a(), a(), a(0), a(1)]], version=2)
    with pytest.raises(TraceError) as e:
        trace_bytes(old)
    assert str(e.value) == ("call 0 has a forecast for layer 3, where none can be made (layer 0, or a layer with "
                            "or after a layer without units); empty it")
    old.forecasts[0][3] = a()
    back = reread(old)
    # Read by its own rule, and written back as version 2 (its sets keep their meaning).
    assert back.version == 2 and json.loads(_members(old)["header.json"])["version"] == 2
    ledger = sim.ledger(back, "expert-forecast", {})[0]
    assert ledger["prefetched"] == [None, None, None, None, 1] and ledger["d2h_bytes"] == [0, 4, 0, 4, 8]
    # A trace without forecasts is written as version 3, whatever it was read as.
    plain = Trace(model=model, calls=calls, sets=sets, version=1)
    assert reread(plain).version == 3


def test_expert_cache_specs_are_checked():
    assert sim.parse_policy("expert-cache:capacity=4,rule=lfu,forecast=on", "expert") == (
        "expert-cache", {"capacity": 4, "rule": "lfu", "forecast": "on"})
    with pytest.raises(sim.SimulateError, match="lru, lfu"):
        sim.parse_policy("expert-cache:capacity=4,rule=fifo", "expert")
    with pytest.raises(sim.SimulateError, match="cannot be simulated"):
        sim.parse_policy("expert-cache:capacity=4", "row")
    with pytest.raises(sim.SimulateError, match="needs capacity"):
        sim.ledger(cache_trace(), "expert-cache", {})
    with pytest.raises(ValueError, match="capacity"):
        sim.ledger(cache_trace(), "expert-cache", {"capacity": -1})


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


def test_a_parameter_given_twice_or_in_other_digits_is_refused():
    """`expert-cache:capacity=4,rule=lru,rule=lfu` replayed LFU under a label naming both rules, and
    `capacity=4,capacity=5` capacity 5; `capacity=٤` (an Arabic-Indic four) ran capacity 4 under a
    label no table of capacities sorts or matches: each is refused in one line."""
    for bad, words in (("expert-cache:capacity=4,rule=lru,rule=lfu", "rule is given twice"),
                       ("expert-cache:capacity=4,capacity=5", "capacity is given twice"),
                       ("expert-cache:capacity=\u0664", "must be an integer"),
                       ("expert-cache:capacity=1_0", "must be an integer"),
                       ("expert-cache:capacity= 4", "must be an integer")):
        with pytest.raises(sim.SimulateError, match=words):
            sim.parse_policy(bad, "expert")
    assert sim.parse_policy("expert-cache:capacity=-1", "expert")[1] == {"capacity": -1}  # the range is the CLI's


MACHINE = {"name": "m", "pinned_h2d_gbps": {"value": 50.0, "source": "s"},
           "decode_compute_ms": {"mixtral-8x7b:4": {"value": 8.0, "source": "s"}}}


def test_predicted_time_is_compute_plus_bytes_at_the_copy_rate():
    model = TraceModel(family="mixtral", unit="expert", layers=8, units=8, unit_bytes=10**6, k=2, shape="mixtral-8x7b")
    t = Trace(model=model, calls=[TraceCall(0, "prefill", 2)] + [TraceCall(0, "decode", 1)] * 2,
              sets=[[np.array([0, 1, 2])] * 8] + [[np.array([3, 4])] * 8] * 2)
    p = sim.predict(t, "packet", {"gather": "device"}, sim.ledger(t, "packet", {"gather": "device"}), MACHINE)
    # 2 experts x 8 layers x 1 MB a token at 50 GB/s = 0.32 ms; compute scaled 8/4 of 8 ms = 16 ms.
    assert p["copy_ms_per_token"] == pytest.approx(0.32)
    assert p["compute_ms_per_token"] == pytest.approx(16.0)
    assert p["decode_ms_per_token"] == pytest.approx(16.32)
    assert "scaled by layers" in p["compute_source"] and p["overlap"] == "serial"
    unnamed = Trace(model=TraceModel(family="x", unit="expert", layers=1, units=8, unit_bytes=1), calls=t.calls[:2],
                    sets=[[np.array([0])]] * 2)
    q = sim.predict(unnamed, "packet", {}, sim.ledger(unnamed, "packet", {}), MACHINE)
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


def test_a_screens_archive_given_as_a_trace_says_how_to_extract_one(tmp_path):
    # Catches the bare "the trace has no header.json" for a whole screen archive, which left the
    # user to find out that a traced screen keeps each episode's trace as a member of its own.
    archive = tmp_path / "screen.zip"
    archive.write_bytes(_zip({"manifest.json": b"{}", "active/00003.trace": b"x", "active/00001.trace": b"x",
                              "episodes/00001.json": b"{}"}))
    with pytest.raises(TraceError) as e:
        read_trace(archive)
    assert "screen's archive" in str(e.value) and "active/00001.trace, active/00003.trace" in str(e.value)
    assert "unzip ARCHIVE active/NNNNN.trace" in str(e.value) and "\n" not in str(e.value)
    untraced = tmp_path / "untraced.zip"
    untraced.write_bytes(_zip({"manifest.json": b"{}", "episodes/00001.json": b"{}"}))
    with pytest.raises(TraceError, match="holds no trace"):
        read_trace(untraced)
    other = tmp_path / "other.zip"  # any other zip keeps the member-by-member message
    other.write_bytes(_zip({"readme.txt": b"x"}))
    with pytest.raises(TraceError, match="the trace has no header.json"):
        read_trace(other)
