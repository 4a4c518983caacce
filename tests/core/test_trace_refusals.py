"""core/trace.py's reader and writer at their edges: every refusal of a header field, member or
bound word for word (the line `packbench simulate` and the auditor print), each bound at it and
one past it, and the defaults a header may leave out. test_trace.py checks the format and the
replays; these pin what a hostile or hand-written file is told."""

import io
import json
import zipfile

import numpy as np
import pytest

from packbench.core import trace as tr
from packbench.core.trace import Trace, TraceCall, TraceError, TraceModel, parse_trace, read_trace, trace_bytes, \
    write_trace


def a(*ids):
    return np.array(ids, dtype=np.int64)


def opt(calls=2, *, layers=2, units=16, source=None) -> Trace:
    model = TraceModel(family="opt", unit="row", layers=layers, units=units, unit_bytes=100, hidden=50,
                       dtype="float16")
    sets = [[a(0, 3), a(1)], [a(3), a()]] * (calls // 2) + [[a(0, 3), a(1)]] * (calls % 2)
    phases = ["prefill"] + ["decode"] * (calls - 1)
    return Trace(model=model, calls=[TraceCall(0, p, 4 if p == "prefill" else 1) for p in phases],
                 sets=[row[:layers] + [a()] * (layers - 2) for row in sets], source=source or {"tool": "hand"})


def moe() -> Trace:
    model = TraceModel(family="mixtral", unit="expert", layers=2, units=4, unit_bytes=1000, k=2)
    return Trace(model=model, calls=[TraceCall(0, "prefill", 2), TraceCall(0, "decode", 1)],
                 sets=[[a(0, 1), a(2, 3)], [a(1, 2), a(0, 3)]], forecasts=[[a(), a(2)], [a(), a(0, 3)]])


def members(t: Trace) -> dict:
    with zipfile.ZipFile(io.BytesIO(trace_bytes(t))) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def zipped(m: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in m.items():
            zf.writestr(name, data)
    return buf.getvalue()


def header(m: dict, **changes) -> dict:
    h = json.loads(m["header.json"])
    for key, value in changes.items():
        if key.startswith("model_"):
            if value is ...:
                del h["model"][key[6:]]
            else:
                h["model"][key[6:]] = value
        elif value is ...:
            del h[key]
        else:
            h[key] = value
    return {**m, "header.json": json.dumps(h).encode()}


def npy(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def parse(m: dict, **kw) -> Trace:
    return parse_trace(zipfile.ZipFile(io.BytesIO(zipped(m))), **kw)


def refusal(m: dict, **kw) -> str:
    with pytest.raises(TraceError) as e:
        parse(m, **kw)
    return str(e.value)


CALL = {"episode": 0, "phase": "decode", "tokens": 1}
HEADER_REFUSALS = [
    (dict(model=3), "header.json's model is not an object; write the fields docs/traces.md lists"),
    (dict(model_unit="neuron"), "header.json's model.unit is 'neuron'; use one of row, expert"),
    (dict(model_family=""), "header.json's model.family is missing; name the model family (opt, mixtral, ...)"),
    (dict(model_family=3), "header.json's model.family is missing; name the model family (opt, mixtral, ...)"),
    (dict(model_layers=True), "header.json's model.layers is True; it must be an integer in 1..4096"),
    (dict(model_layers="2"), "header.json's model.layers is '2'; it must be an integer in 1..4096"),
    (dict(model_units=0), "header.json's model.units is 0; it must be an integer in 1..2147483647"),
    (dict(model_unit_bytes=2**40 + 1),
     "header.json's model.unit_bytes is 1099511627777; it must be an integer in 1..1099511627776"),
    (dict(model_hidden=2**24 + 1), "header.json's model.hidden is 16777217; it must be an integer in 0..16777216"),
    (dict(model_index_bytes=17), "header.json's model.index_bytes is 17; it must be an integer in 1..16"),
    (dict(model_k=-1), "header.json's model.k is -1; it must be an integer in 0..2147483647"),
    (dict(model_layers_without_units={}), "header.json's model.layers_without_units must list layer numbers in 0..1"),
    (dict(model_layers_without_units=[True]),
     "header.json's model.layers_without_units must list layer numbers in 0..1"),
    (dict(model_layers_without_units=[2]), "header.json's model.layers_without_units must list layer numbers in 0..1"),
    (dict(model_shape=3), "header.json's model.shape must be a string or null"),
    (dict(model_dtype=3), "header.json's model.dtype must be a string"),
    (dict(calls=[]), "header.json's calls must be a non-empty list of {episode, phase, tokens}"),
    (dict(calls=[CALL, {**CALL, "phase": "warm"}]), "header.json's calls[1].phase must be one of prefill, decode"),
    (dict(calls=[{**CALL, "episode": -1}, CALL]), "header.json's calls[0].episode is -1; it must be an integer >= 0"),
    (dict(calls=[{**CALL, "episode": True}, CALL]),
     "header.json's calls[0].episode is True; it must be an integer >= 0"),
    (dict(calls=[{**CALL, "episode": "0"}, CALL]),
     "header.json's calls[0].episode is '0'; it must be an integer >= 0"),
    (dict(calls=[CALL, {**CALL, "episode": 2**40 + 1}]),
     "header.json's calls[1].episode is 1099511627777; it must be an integer >= 0"),
    (dict(calls=[CALL, {**CALL, "tokens": 0}]), "header.json's calls[1].tokens is 0; it must be an integer >= 1"),
    (dict(calls=[CALL, {**CALL, "tokens": 2**40 + 1}]),
     "header.json's calls[1].tokens is 1099511627777; it must be an integer >= 1"),
    (dict(source=[]), "header.json's source must be an object"),
    (dict(version=4), "trace version 4 is not one this packbench reads (1, 2, 3); upgrade packbench or rewrite "
                      "the trace in version 3"),
]


@pytest.mark.parametrize("changes, line", HEADER_REFUSALS)
def test_header_refusals_word_for_word(changes, line):
    # Bugs: a check's `or` read as `and` (a bool, a string, an empty family or list, a layer number
    # past the model's, a repeated id accepted), a bound one off, the line misworded or empty.
    assert refusal(header(members(opt()), **changes)) == line


def test_header_fields_at_their_bounds_and_the_defaults_a_header_may_leave_out():
    # Bugs: a bound one off (`v < hi`, `lo` one higher), a field read under another name or not
    # read at all (index_bytes, k), a default other than the documented one (hidden 0, dtype "",
    # index_bytes 8, k 0, source {}).
    t = opt(units=1)
    t.sets = [[a(0), a()], [a(), a(0)]]
    m = header(members(t), model_unit_bytes=1, model_index_bytes=1,
               calls=[{**CALL, "phase": "prefill", "episode": 2**40}, {**CALL, "tokens": 2**40}])
    back = parse(m)
    assert (back.model.units, back.model.unit_bytes, back.model.index_bytes) == (1, 1, 1)
    assert [(c.episode, c.tokens) for c in back.calls] == [(2**40, 1), (0, 2**40)]
    t = opt()
    t.sets = [[a(), a(1)], [a(), a(0, 2)]]  # layer 0 without units
    top = parse(header(members(t), model_unit_bytes=2**40, model_hidden=2**24, model_index_bytes=16, model_k=2,
                       model_layers_without_units=[0], model_unit="expert"))
    assert (top.model.unit_bytes, top.model.hidden, top.model.index_bytes, top.model.k) == (2**40, 2**24, 16, 2)
    assert top.model.layers_without_units == (0,) and top.model.unit == "expert"
    m = header(members(opt()), model_hidden=..., model_dtype=..., model_index_bytes=..., model_k=..., source=...)
    bare = parse(m).model
    assert (bare.hidden, bare.dtype, bare.index_bytes, bare.k) == (0, "", 8, 0)
    assert parse(m).source == {}
    assert parse(header(members(opt()), model_index_bytes=4, model_k=3)).model.index_bytes == 4


def test_a_preset_shape_must_be_the_traces_model():
    """Catches a trace whose model.shape names one of packbench's presets it is not: an MoE trace
    of 4 experts that named opt-13b was read, and `simulate --machine` priced its decode with
    opt-13b's measured compute (an OPT model's, scaled from 40 layers). A preset's family, unit,
    units a layer, and hidden and k where given must be the preset's; any other name is free."""
    def preset(**model) -> str:
        return refusal(header(members(opt()), **{f"model_{k}": v for k, v in model.items()}))

    opt13 = "packbench's preset (family 'opt', unit 'row', units 20480, hidden 5120, k 0)"
    tiny_moe = "packbench's preset (family 'mixtral', unit 'expert', units 8, hidden 64, k 2)"
    fix = "; give the shape the trace was recorded from, or null"
    assert preset(shape="opt-13b") == f"header.json's model.shape 'opt-13b' is {opt13}, but model.units is 16{fix}"
    assert preset(shape="opt-13b", family="mixtral", unit="expert") == (
        f"header.json's model.shape 'opt-13b' is {opt13}, but model.family is 'mixtral'{fix}")
    assert preset(shape="opt-13b", units=20480, unit="expert") == (
        f"header.json's model.shape 'opt-13b' is {opt13}, but model.unit is 'expert'{fix}")
    assert preset(shape="opt-13b", units=20480, hidden=5121) == (
        f"header.json's model.shape 'opt-13b' is {opt13}, but model.hidden is 5121{fix}")
    assert preset(shape="opt-13b", units=20480, hidden=5120, k=2) == (
        f"header.json's model.shape 'opt-13b' is {opt13}, but model.k is 2{fix}")
    assert preset(shape="mixtral-tiny") == (
        f"header.json's model.shape 'mixtral-tiny' is {tiny_moe}, but model.family is 'opt'{fix}")
    moe = dict(shape="mixtral-tiny", family="mixtral", unit="expert", units=8, hidden=64)
    assert preset(**moe, k=3) == f"header.json's model.shape 'mixtral-tiny' is {tiny_moe}, but model.k is 3{fix}"
    assert preset(**{**moe, "hidden": 63}) == (
        f"header.json's model.shape 'mixtral-tiny' is {tiny_moe}, but model.hidden is 63{fix}")
    # Read: the preset itself, with hidden and k given or left 0 (a published dump's unknowns),
    # fewer layers than the preset's, and any name that is no preset.
    for model in (dict(moe, k=2), dict(moe, k=0, hidden=0), dict(shape="opt-13b", units=20480, hidden=0),
                  dict(shape="box-moe", family="mixtral", unit="expert", units=8, k=7)):
        back = parse(header(members(opt()), **{f"model_{k}": v for k, v in model.items()})).model
        assert (back.shape, back.unit, back.units) == (model["shape"], model.get("unit", "row"), model["units"])


def test_a_call_routing_more_experts_than_its_tokens_times_k_is_refused():
    """Catches a reader that took a one-token call of top-2 routing whose set held 3 experts (or a
    forecast of 3): `simulate` replayed experts the router cannot have chosen. At tokens x k it
    reads; k 0 (not stated) and a trace of rows are not checked."""
    import dataclasses

    def k2(t: Trace) -> dict:  # written with a k the writer takes, stated as 2 in the header
        t.model = dataclasses.replace(t.model, k=4)
        return header(members(t), model_k=2)

    t = moe()  # prefill of 2 tokens, decode of 1
    assert parse(k2(t)).sets[1][1].tolist() == [0, 3]  # at the bound: 2 experts for 1 token
    t.sets[1][1] = a(0, 1, 3)
    assert refusal(k2(t)) == ("call 1 routes 3 experts in layer 1, more than its 1 token x k 2; fix model.k "
                              "or the call's tokens")
    t.sets[0][0] = a(0, 1, 2, 3)  # the prefill: 4 experts for 2 tokens is at its bound; call 1 is still named
    assert refusal(k2(t)).startswith("call 1 routes 3 experts in layer 1")
    assert parse(header(k2(t), model_k=3)).sets[1][1].tolist() == [0, 1, 3]
    assert parse(header(k2(t), model_k=0)).model.k == 0
    t = moe()
    t.forecasts[1][1] = a(0, 2, 3)
    assert refusal(k2(t)) == ("call 1 forecasts 3 experts in layer 1, more than its 1 token x k 2; fix model.k "
                              "or the call's tokens")
    t = moe()
    t.sets[0][0] = a(0, 1, 2)
    assert refusal(header(k2(t), calls=[{**CALL, "phase": "prefill"}, CALL])) == (
        "call 0 routes 3 experts in layer 0, more than its 1 token x k 2; fix model.k or the call's tokens")
    rows = opt()  # a trace of rows states no k: its sets are not bounded by one
    rows.sets[1][0] = a(0, 1, 2, 3, 4, 5)
    assert parse(header(members(rows), model_k=1)).sets[1][0].size == 6


def test_layers_are_bounded_at_4096():
    # Bug: the layer bound one off.
    t = opt(1, layers=4096)
    assert len(parse(members(t)).sets[0]) == 4096
    assert refusal(header(members(t), model_layers=4097)) == (
        "header.json's model.layers is 4097; it must be an integer in 1..4096")


def test_member_refusals_word_for_word():
    # Bugs: offsets that do not start at 0 or go backwards, or a set that repeats an id, accepted; a
    # pickled (object) array unpickled; a member named wrongly or not at all in the line.
    good = members(opt())  # offsets [0, 2, 3, 4, 4], ids [0, 3, 1, 3]
    assert refusal({k: v for k, v in good.items() if k != "offsets.npy"}) == (
        "the trace has no offsets.npy; a trace file holds header.json, offsets.npy, indices.npy (docs/traces.md)")
    inconsistent = ("offsets.npy must hold calls x layers + 1 = 5 non-decreasing offsets from 0 to indices.npy' 4; "
                    "the file is truncated or inconsistent")
    assert refusal({**good, "offsets.npy": npy(np.array([1, 2, 3, 4, 4], dtype="<i8"))}) == inconsistent
    assert refusal({**good, "offsets.npy": npy(np.array([0, 3, 2, 4, 4], dtype="<i8"))}) == inconsistent
    assert refusal({**good, "indices.npy": npy(np.array([0, 0, 1, 3], dtype="<u4"))}) == (
        "a set in indices.npy is not strictly increasing; sort each set and drop repeats")
    assert refusal({**good, "offsets.npy": npy(np.array([0, 2, 3, 4, 4], dtype="<i4"))}) == (
        "offsets.npy must be a 1-D <i8 array, got <i4 of shape (5,)")
    assert refusal({**good, "indices.npy": npy(np.array([0, 3, 1, 3], dtype="<i4"))}) == (
        "indices.npy must be a 1-D <u4 array, got <i4 of shape (4,)")
    assert refusal({**good, "offsets.npy": npy(np.array([0, 2, 3, 4, 4], dtype=object))}) == (
        "offsets.npy must be a 1-D <i8 array, got |O of shape (5,)")  # refused from its header, never unpickled
    assert refusal({**good, "header.json": b"{"}) == "header.json is not JSON; rewrite the trace"
    assert refusal(header(good, model_layers_without_units=[0])) == (
        "call 0 has units in layer 0, which model.layers_without_units lists")
    forecast = members(moe())
    assert refusal({k: v for k, v in forecast.items() if k != "forecast_indices.npy"}) == (
        "the trace has forecast_offsets.npy without its pair; a trace holds both forecast_offsets.npy and "
        "forecast_indices.npy or neither; rewrite it")
    assert refusal(header(forecast, version=1)) == (
        "a version-1 trace holds no forecast members; drop them or write version 3")
    rows = {**good, "forecast_offsets.npy": good["offsets.npy"], "forecast_indices.npy": good["indices.npy"]}
    assert refusal(rows) == "forecast members are for a trace of experts; drop them from a trace of rows"


def npy_header(shape, descr="<i8") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


@pytest.mark.parametrize("stated", [2**50, 2**34, 6])
def test_a_member_stating_more_values_than_it_holds_is_refused_before_any_allocation(stated):
    """Catches a .npy member of a few bytes whose header states a huge shape: numpy's read_array
    allocated the stated array before reading (2^50 offsets: MemoryError for 8 PiB, `packbench
    simulate` exit 70 with a traceback), and a member one value short was refused only by the
    read running out of bytes."""
    good = members(opt())  # 5 offsets
    data = npy_header((stated,)) + good["offsets.npy"][-40:]
    assert refusal({**good, "offsets.npy": data}) == (
        f"offsets.npy states {stated} values ({stated * 8} bytes) but holds 40 bytes of them; the file is "
        f"truncated or inconsistent, rewrite the trace")
    assert refusal({**good, "offsets.npy": npy_header((2**40, 2**40))}) == (
        "offsets.npy must be a 1-D <i8 array, got <i8 of shape (1099511627776, 1099511627776)")
    assert refusal({**good, "offsets.npy": b"\x93NUMPY\x09\x00" + good["offsets.npy"][8:]}) == (
        "offsets.npy is not a readable .npy array (unsupported .npy version 9.0); rewrite the trace")
    assert parse({**good, "offsets.npy": npy_header((5,)) + good["offsets.npy"][-40:]}).sets[1][0].tolist() == [3]


def test_calls_and_sets_are_bounded_at_their_limits(monkeypatch):
    # Bugs: `>=` for `>` on the number of calls or of sets (a trace at the bound refused).
    monkeypatch.setattr(tr, "MAX_CALLS", 2)
    assert len(parse(members(opt(2))).calls) == 2
    assert refusal(header(members(opt(2)), calls=[CALL] * 3)) == (
        "the trace has 3 calls, more than 2; split it into several files")
    monkeypatch.setattr(tr, "MAX_CALLS", 10)
    monkeypatch.setattr(tr, "MAX_SETS", 4)  # 2 calls x 2 layers
    assert len(parse(members(opt(2))).sets) == 2
    assert refusal(header(members(opt(2)), calls=[CALL] * 3)) == (
        "3 calls x 2 layers is more than 4 sets; split the trace into several files")


def test_each_members_bound_is_its_documented_size_and_a_member_at_it_is_read(monkeypatch):
    # Bugs: a member's bound computed from the wrong count or margin (8 B an offset, 4 B an id,
    # 256 B of .npy header), a member at its bound refused (`>=`) or read short, the audit's cap
    # (`cap=`) not applied.
    monkeypatch.setattr(tr, "MAX_SETS", 4)
    monkeypatch.setattr(tr, "MAX_INDICES", 20)
    good = members(moe())
    for name, bound in (("offsets.npy", 8 * 5 + 256), ("indices.npy", 4 * 20 + 256),
                        ("forecast_offsets.npy", 8 * 5 + 256), ("forecast_indices.npy", 4 * 20 + 256)):
        assert refusal({**good, name: b"\0" * (bound + 1)}) == (
            f"{name} states {bound + 1} bytes, over the bound of {bound}; split the trace into several files")
    monkeypatch.setattr(tr, "MAX_HEADER_BYTES", len(good["header.json"]))
    assert parse(good).model.k == 2  # the header at its bound exactly
    assert refusal(good, cap=100) == (
        f"header.json states {len(good['header.json'])} bytes, over the bound of 100; split the trace into several "
        f"files")


def test_a_file_at_its_bound_is_read_and_a_damaged_member_named(tmp_path, monkeypatch):
    # Bugs: a file of exactly the bound refused; a member that cannot be inflated named without
    # its cause (or not in one line).
    path = write_trace(opt(), tmp_path / "t.trace")
    monkeypatch.setattr(tr, "MAX_FILE_BYTES", path.stat().st_size)
    assert len(read_trace(path).calls) == 2
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("indices.npy")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start:start + info.compress_size] = b"\xff" * info.compress_size  # not a DEFLATE stream
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert str(e.value) == (f"{path}: a member cannot be read (Error -3 while decompressing data: invalid block type); "
                            f"rewrite the trace")


def test_writer_refusals_and_what_it_writes():
    # Bugs: a trace with a set too few per layer, or forecasts of the wrong shape, written (the
    # `or` of the shape checks as `and`); a trace of no calls crashing the writer instead of the
    # reader's one line; the header's keys in insertion order (the same trace, other bytes);
    # the members stored instead of deflated (docs/traces.md: `write_trace` deflates); the model's
    # layers without units under another key.
    t = opt()
    t.sets[1] = t.sets[1][:1]
    with pytest.raises(TraceError) as e:
        trace_bytes(t)
    assert str(e.value) == "a trace needs one set per call and layer"
    t = moe()
    t.forecasts[1] = t.forecasts[1][:1]
    with pytest.raises(TraceError) as e:
        trace_bytes(t)
    assert str(e.value) == "a trace's forecasts need one set per call and layer"
    empty = Trace(model=opt().model, calls=[], sets=[])
    with pytest.raises(TraceError) as e:
        trace_bytes(empty)
    assert str(e.value) == "header.json's calls must be a non-empty list of {episode, phase, tokens}"
    one, other = opt(source={"a": 1, "b": 2}), opt(source={"b": 2, "a": 1})
    assert members(one)["header.json"] == members(other)["header.json"]
    assert list(json.loads(members(one)["header.json"])) == ["calls", "format", "model", "source", "version"]
    with zipfile.ZipFile(io.BytesIO(trace_bytes(moe()))) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_DEFLATED}
    assert moe().model.as_dict() == {"family": "mixtral", "unit": "expert", "layers": 2, "units": 4, "unit_bytes": 1000,
                                     "hidden": 0, "dtype": "", "index_bytes": 8, "k": 2, "shape": None,
                                     "layers_without_units": []}


def test_a_write_into_a_missing_directory_is_one_line(tmp_path):
    # Bug: the clean-up of the temporary file (absent: it was never created) raising instead of
    # the writer's line.
    path = tmp_path / "absent" / "t.trace"
    with pytest.raises(TraceError) as e:
        write_trace(opt(), path)
    assert str(e.value) == f"{path}: cannot write the trace (No such file or directory); choose another path"


def test_a_member_given_twice_is_refused():
    """Catches a trace zip holding two `indices.npy` (or header.json) members: the reader kept the
    last one silently, where `unzip` and other readers take the first."""
    import warnings

    good = members(opt())
    for name in ("header.json", "indices.npy"):
        buf = io.BytesIO()
        with warnings.catch_warnings(), zipfile.ZipFile(buf, "w") as zf:
            warnings.simplefilter("ignore")  # zipfile warns of the duplicate name, and writes it
            for n, data in good.items():
                zf.writestr(n, data)
            zf.writestr(name, good[name])
        with pytest.raises(TraceError) as e:
            parse_trace(zipfile.ZipFile(io.BytesIO(buf.getvalue())))
        assert str(e.value) == f"the trace holds {name} twice: which is the trace's cannot be told; rewrite the trace"


def test_a_trace_is_never_written_over_an_existing_path(tmp_path):
    """Catches write_trace renaming over a file: `model stats --trace OUT` checks OUT before it
    measures and traces, and a file made at OUT in the meantime (minutes, on a large model) was
    replaced by the trace, where the docs say an existing path is refused."""
    path = tmp_path / "t.trace"
    path.write_bytes(b"someone else's")
    with pytest.raises(TraceError) as e:
        write_trace(opt(), path)
    assert str(e.value) == f"{path} exists; give a new file path"
    assert path.read_bytes() == b"someone else's" and sorted(p.name for p in tmp_path.iterdir()) == ["t.trace"]
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # a dangling link is a path too: never followed
    with pytest.raises(TraceError, match="exists; give a new file path"):
        write_trace(opt(), tmp_path / "link")
    assert not (tmp_path / "nowhere").exists()
    assert read_trace(write_trace(opt(), tmp_path / "new.trace")).calls == opt().calls
