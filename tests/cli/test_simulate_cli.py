"""`packbench model stats DIR --trace OUT` then `packbench simulate OUT`: the trace of real episodes
replayed by every policy, with a predicted time from a machine file; bad input in one line, exit 2."""

import json

import pytest

from packbench.core import simulate as sim
from packbench.core.trace import read_trace


def one_line(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def opt_trace(tiny, tmp_path_factory):
    from in_process import run_packbench

    out = tmp_path_factory.mktemp("trace") / "tiny.trace"
    r = run_packbench("model", "stats", str(tiny), "--prefix", "16", "--continuation", "4", "--count", "2",
                      "--trace", str(out))
    assert r.returncode == 0, r.stderr
    assert "wrote the trace of 2 episodes (8 calls)" in r.stderr
    return out


def test_simulate_json_is_the_ledger_of_every_policy(opt_trace, packbench_cli):
    r = packbench_cli("simulate", str(opt_trace), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    t = read_trace(opt_trace)
    assert [p["policy"] for p in out["policies"]] == [
        "resident", "dense-stream", "packet", "packet:gather=device", "phase-switched", "phase-switched:gather=device",
        "sparse-extents", "row-retention:rows_per_layer=25", "early-forecast", "early-forecast:gather=device"]
    # Catches a CLI that prints other figures than the library's ledger (or drops calls).
    for p in out["policies"]:
        assert p["calls"] == json.loads(json.dumps(sim.ledger(t, p["name"], p["params"])))
    assert out["model"]["shape"] == "tiny" and out["source"]["tool"] == "packbench model stats --trace"
    assert "not a measurement" in out["assumptions"]


def test_a_machine_file_predicts_compute_plus_copy(opt_trace, packbench_cli, tmp_path):
    machine = {"name": "box", "pinned_h2d_gbps": {"value": 0.001, "source": "made up"},
               "decode_compute_ms": {"tiny:2": {"value": 2.5, "source": "made up"}}}
    (tmp_path / "box.json").write_text(json.dumps(machine))
    r = packbench_cli("simulate", str(opt_trace), "--policy", "packet", "--policy", "dense-stream",
                      "--machine", str(tmp_path / "box.json"), "--json")
    assert r.returncode == 0, r.stderr
    rows = {p["policy"]: p for p in json.loads(r.stdout)["policies"]}
    d = rows["packet"]["totals"]["decode"]
    copy_ms = (d["h2d_weight_bytes"] + d["h2d_index_bytes"]) / d["tokens"] / 1e6 * 1e3
    # packet: serial; OPT dense-stream: overlapped with compute (the larger of the two).
    assert rows["packet"]["prediction"]["decode_ms_per_token"] == pytest.approx(2.5 + copy_ms)
    dense = rows["dense-stream"]["totals"]["decode"]["h2d_weight_bytes"] / 6 / 1e6 * 1e3
    assert rows["dense-stream"]["prediction"]["decode_ms_per_token"] == pytest.approx(max(2.5, dense))
    text = packbench_cli("simulate", str(opt_trace), "--machine", "h200")
    assert text.returncode == 0 and "no measured compute rate for tiny" in text.stdout


def test_moe_trace_decode_moves_k_experts_a_layer(tmp_path, packbench_cli):
    r = packbench_cli("model", "synth", "--out", str(tmp_path / "m"), "--shape", "mixtral-tiny", "--layers", "2")
    assert r.returncode == 0, r.stderr
    r = packbench_cli("model", "stats", str(tmp_path / "m"), "--prefix", "16", "--continuation", "3", "--count", "1",
                      "--json", "--trace", str(tmp_path / "m.trace"))
    assert r.returncode == 0, r.stderr
    out = json.loads(packbench_cli("simulate", str(tmp_path / "m.trace"), "--json").stdout)
    rows = {p["policy"]: p for p in out["policies"]}
    # One decode token routes exactly k = 2 distinct experts in each of the 2 layers.
    for c in rows["packet"]["calls"]:
        if c["phase"] == "decode":
            assert c["rows_copied"] == [2, 2]
    assert rows["dense-stream"]["totals"]["decode"]["rows_copied"] == 2 * 2 * 8
    assert set(rows) == {"resident", "dense-stream", "packet", "packet:gather=device", "packet:gather=mapped",
                         "phase-switched", "phase-switched:gather=device", "phase-switched:gather=mapped",
                         "expert-cache:capacity=2,rule=lru", "expert-cache:capacity=2,rule=lfu", "expert-forecast",
                         "expert-cache:capacity=2,rule=lru,forecast=on"}
    # The mapped gather (an MoE model's sync-free one) moves the routed experts as packet does, and
    # neither an index nor a readback in a decode call (simulate refused `gather=mapped` before).
    packet, mapped = rows["packet"]["totals"]["decode"], rows["packet:gather=mapped"]["totals"]["decode"]
    assert mapped["h2d_weight_bytes"] == packet["h2d_weight_bytes"] > 0 and mapped["rows_copied"] == packet["rows_copied"]
    assert (mapped["h2d_index_bytes"], mapped["d2h_bytes"]) == (0, 0) and packet["d2h_bytes"] > 0
    # The caches' figures are the library's replay of the same trace (hits beside Belady's), and
    # a forecast made in one layer prefetched experts for the next (layer 1 only).
    t = read_trace(tmp_path / "m.trace")
    for name in ("expert-cache:capacity=2,rule=lru", "expert-forecast"):
        assert rows[name]["calls"] == json.loads(json.dumps(sim.ledger(t, rows[name]["name"], rows[name]["params"])))
    lru = rows["expert-cache:capacity=2,rule=lru"]["totals"]["decode"]
    assert lru["hits"] + lru["misses"] == lru["active_rows"] == 2 * 2 * 2 and lru["belady_hits"] >= lru["hits"]
    assert all(c["prefetched"][0] is None and c["prefetched"][1] >= 1 for c in rows["expert-forecast"]["calls"])
    # The table shows the cache columns: a cache's hits and Belady's rate, a forecast's used.
    text = packbench_cli("simulate", str(tmp_path / "m.trace"), "--policy", "expert-cache:capacity=2,rule=lfu",
                         "--policy", "expert-forecast", "--policy", "packet", "--per-call")
    assert text.returncode == 0, text.stderr
    header = next(line for line in text.stdout.splitlines() if line.startswith("policy"))
    for column in ("hits", "misses", "hit%", "belady%", "prefetch", "used"):
        assert column in header.split(), header
    lfu_line = next(line for line in text.stdout.splitlines() if line.startswith("expert-cache:capacity=2,rule=lfu"))
    lfu = rows["expert-cache:capacity=2,rule=lfu"]["totals"]["decode"]
    assert f" {lfu['hits']} " in lfu_line and f"{100 * lfu['belady_rate']:.1f}" in lfu_line, lfu_line
    assert "belady_hits" in text.stdout and "prefetched" in text.stdout  # --per-call shows them
    # The wasted column is the decode calls', as prefetch and used beside it are: it summed the
    # prefill's waste too, so used + wasted did not make prefetch.
    fc_line = next(line for line in text.stdout.splitlines() if line.startswith("expert-forecast"))
    fc = rows["expert-forecast"]["totals"]["decode"]
    cells = fc_line.split()
    assert (int(cells[4]), int(cells[9]), int(cells[10])) == (fc["rows_wasted"], fc["prefetched"], fc["used"])
    assert fc["used"] + fc["rows_wasted"] == fc["prefetched"]
    # With a machine file, a forecast's prediction hides its prefetch behind compute, as the library
    # computes it from the same ledger, and the table says how much; a policy without one has none.
    machine = {"name": "box", "pinned_h2d_gbps": {"value": 0.001, "source": "made up"},
               "decode_compute_ms": {"mixtral-tiny:2": {"value": 4.0, "source": "made up"}}}
    (tmp_path / "box.json").write_text(json.dumps(machine))
    r = packbench_cli("simulate", str(tmp_path / "m.trace"), "--policy", "expert-forecast", "--policy", "packet",
                      "--machine", str(tmp_path / "box.json"), "--json")
    assert r.returncode == 0, r.stderr
    preds = {p["policy"]: p["prediction"] for p in json.loads(r.stdout)["policies"]}
    t = read_trace(tmp_path / "m.trace")
    hidden = sim.prefetch_hidden_ms(t.model, sim.ledger(t, "expert-forecast", {}), 4.0, 0.001)
    assert hidden > 0 and preds["expert-forecast"]["prefetch_hidden_ms_per_token"] == pytest.approx(hidden)
    assert "prefetch_hidden_ms_per_token" not in preds["packet"]
    text = packbench_cli("simulate", str(tmp_path / "m.trace"), "--policy", "expert-forecast", "--machine",
                         str(tmp_path / "box.json"))
    assert f"prefetch of expert-forecast: {hidden:.2f} ms a token of its " in text.stdout, text.stdout


def test_forecast_policies_refuse_a_trace_without_forecasts(tmp_path, packbench_cli):
    import io
    import zipfile

    r = packbench_cli("model", "synth", "--out", str(tmp_path / "m"), "--shape", "qwen3-moe-tiny", "--layers", "2")
    assert r.returncode == 0, r.stderr
    r = packbench_cli("model", "stats", str(tmp_path / "m"), "--prefix", "8", "--continuation", "3", "--count", "1",
                      "--json", "--trace", str(tmp_path / "m.trace"))
    assert r.returncode == 0, r.stderr
    with zipfile.ZipFile(tmp_path / "m.trace") as zf:
        members = {n: zf.read(n) for n in zf.namelist() if not n.startswith("forecast_")}
    header = json.loads(members["header.json"])
    members["header.json"] = json.dumps({**header, "version": 1}).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for n, v in members.items():
            zf.writestr(n, v)
    (tmp_path / "v1.trace").write_bytes(buf.getvalue())
    # A version-1 trace: the default list leaves the forecast policies out; asking for one is one line.
    out = json.loads(packbench_cli("simulate", str(tmp_path / "v1.trace"), "--json").stdout)
    names = [p["policy"] for p in out["policies"]]
    assert "expert-cache:capacity=4,rule=lru" in names and not any("forecast" in n for n in names)
    one_line(packbench_cli("simulate", str(tmp_path / "v1.trace"), "--policy", "expert-forecast"),
             "--policy expert-forecast", "forecast sets")


def test_bad_input_is_one_line(opt_trace, packbench_cli, tmp_path):
    one_line(packbench_cli("simulate", str(opt_trace), "--policy", "warp"), "--policy", "cannot be simulated")
    one_line(packbench_cli("simulate", str(opt_trace), "--policy", "row-retention"), "rows_per_layer")
    one_line(packbench_cli("simulate", str(opt_trace), "--machine", "nowhere"), "no such machine", "h200")
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "pinned_h2d_gbps": 5}))
    one_line(packbench_cli("simulate", str(opt_trace), "--machine", str(tmp_path / "bad.json")), "pinned_h2d_gbps")
    one_line(packbench_cli("simulate", str(tmp_path / "absent.trace")), "TRACE", "cannot read it")
    # An existing --trace is never overwritten.
    one_line(packbench_cli("model", "stats", str(tmp_path), "--trace", str(opt_trace)), "exists")


def test_hostile_trace_files_are_one_line_exit_2(opt_trace, packbench_cli, tmp_path):
    import io
    import zipfile

    data = opt_trace.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}

    def rezip(**changes) -> bytes:
        header = json.loads(members["header.json"])
        header.update({k: v for k, v in changes.items() if k != "model"})
        header["model"].update(changes.get("model", {}))
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for n, v in {**members, "header.json": json.dumps(header).encode()}.items():
                zf.writestr(n, v)
        return buf.getvalue()

    # Each: the command names the file's problem on one line and exits 2, never a traceback.
    for body, words in ((data[: len(data) // 3], "truncated"), (rezip(version=9), "version 9"),
                        (rezip(model={"units": 4, "shape": None}), "out of range"),
                        (rezip(model={"units": 4}), "model.shape 'tiny' is packbench's preset")):
        bad = tmp_path / "bad.trace"
        bad.write_bytes(body)
        one_line(packbench_cli("simulate", str(bad)), "TRACE", words)


def test_hostile_machine_files_are_one_line_exit_2(opt_trace, packbench_cli, tmp_path):
    """Catches `--machine FILE` figures that reached the arithmetic or `int()` before: a rate of 400
    digits (OverflowError: int too large to convert to float), a layer count `²` (str.isdigit holds,
    int() raises) or of 5,000 digits (ValueError past Python's digit limit), arrays nested 100,000
    deep (RecursionError) each exited 70 as a packbench bug; a rate of 5e-324 GB/s printed an
    infinite time (`Infinity` in --json, which is no JSON). Each is now one line, exit 2."""
    good = {"name": "m", "pinned_h2d_gbps": {"value": 10, "source": "s"}}
    big = "1" + "0" * 400
    for name, text, words in (
            ("rate", json.dumps(good).replace('"value": 10', f'"value": {big}'), "pinned_h2d_gbps"),
            ("small", json.dumps(good).replace('"value": 10', '"value": 5e-324'), "pinned_h2d_gbps"),
            ("compute", json.dumps({**good, "decode_compute_ms": {"tiny:2": {"value": 1, "source": "s"}}})
             .replace('"value": 1,', f'"value": {big},'), "decode_compute_ms['tiny:2']"),
            ("superscript", json.dumps({**good, "decode_compute_ms": {"tiny:\u00b2": {"value": 1, "source": "s"}}}),
             "shape:layers"),
            ("digits", json.dumps({**good, "decode_compute_ms": {"tiny:" + "9" * 5000: {"value": 1, "source": "s"}}}),
             "shape:layers"),
            ("overhead", json.dumps({**good, "overhead_us": {"packet": {"layer_us": {"value": 1, "source": "s"}}}})
             .replace('"value": 1,', f'"value": {big},'), "overhead_us['packet']['layer_us']"),
            ("family", json.dumps({**good, "decode_compute_ms": {"tiny:2": {
                "value": 1, "source": "s", "families": {"expert-cache": {"value": 2, "source": "s"}}}}})
             .replace('"value": 2,', f'"value": {big},'), "decode_compute_ms['tiny:2']['families']['expert-cache']"),
            ("family-key", json.dumps({**good, "decode_compute_ms": {"tiny:2": {
                "value": 1, "source": "s", "families": {"x" * 5000: {"value": 2, "source": "s"}}}}}),
             "['families'] key"),
            ("deep", "[" * 100_000 + "]" * 100_000, "is not JSON")):
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        r = packbench_cli("simulate", str(opt_trace), "--machine", str(path))
        one_line(r, f"--machine {path}", words)
        assert len(r.stderr) < 400, r.stderr  # the 5,000-digit key is shown cut


def test_free_text_in_a_trace_or_machine_file_cannot_split_the_table(opt_trace, packbench_cli, tmp_path):
    """Catches the table printing a trace's model.family / shape / dtype and a machine file's name
    raw: a newline split the header line and an ESC or U+202E reached the terminal."""
    import io
    import zipfile

    with zipfile.ZipFile(opt_trace) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    header = json.loads(members["header.json"])
    # A shape of none of packbench's presets (a preset's family must be the preset's: test_trace.py).
    header["model"].update(family="opt\n\x1b[2J", dtype="\u202efloat32", shape="tiny\u202e\n")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for n, v in {**members, "header.json": json.dumps(header).encode()}.items():
            zf.writestr(n, v)
    (tmp_path / "t.trace").write_bytes(buf.getvalue())
    (tmp_path / "m.json").write_text(json.dumps({"name": "box\n\x1b[31m", "pinned_h2d_gbps": {"value": 10, "source": "s"}}))
    r = packbench_cli("simulate", str(tmp_path / "t.trace"), "--machine", str(tmp_path / "m.json"))
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\u202e" not in r.stdout, r.stdout
    assert r.stdout.splitlines()[0].endswith("calls") and "opt\\n\\x1b[2J tiny\\u202e\\n," in r.stdout.splitlines()[0]
    assert "machine box\\n\\x1b[31m: pinned copy 10 GB/s" in r.stdout


def test_a_trace_of_2_31_rows_a_layer_is_replayed_without_row_retention(opt_trace, packbench_cli, tmp_path):
    """Catches row-retention's replay allocating a slot per row of every layer before checking how
    many: a trace whose model.units is 2^31 - 1 (the reader's bound; its ids are small) made
    `simulate TRACE` exit 70 on a 32 GiB MemoryError. The default list now leaves row-retention
    out; asking for it is one line naming the cause."""
    import io
    import zipfile

    with zipfile.ZipFile(opt_trace) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    header = json.loads(members["header.json"])
    header["model"].update(units=2**31 - 1, shape=None)  # no preset has that many rows a layer
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for n, v in {**members, "header.json": json.dumps(header).encode()}.items():
            zf.writestr(n, v)
    (tmp_path / "wide.trace").write_bytes(buf.getvalue())
    r = packbench_cli("simulate", str(tmp_path / "wide.trace"), "--json")
    assert r.returncode == 0, r.stderr
    names = [p["policy"] for p in json.loads(r.stdout)["policies"]]
    assert "packet" in names and not any(n.startswith("row-retention") for n in names), names
    one_line(packbench_cli("simulate", str(tmp_path / "wide.trace"), "--policy", "row-retention:rows_per_layer=8"),
             "--policy row-retention:rows_per_layer=8", "2147483647 rows is over")


def header_rewriter(opt_trace, tmp_path, packbench_cli):
    """The trace's header.json as text, and a function that writes the trace with another header
    text to tmp_path/t.trace and runs `simulate ... --policy packet --json` on it."""
    import io
    import zipfile

    with zipfile.ZipFile(opt_trace) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}

    def trace(header: str):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for n, v in {**members, "header.json": header.encode()}.items():
                zf.writestr(n, v)
        (tmp_path / "t.trace").write_bytes(buf.getvalue())
        return packbench_cli("simulate", str(tmp_path / "t.trace"), "--policy", "packet", "--json")

    return json.dumps(json.loads(members["header.json"])), trace


def test_nan_or_a_key_given_twice_in_a_trace_or_machine_file_is_one_line(opt_trace, packbench_cli, tmp_path):
    """Catches a trace header or machine file read by Python's lenient JSON: NaN or Infinity in a
    field no check reads (the trace's source, the machine's description) came back in `--json`'s
    output, which was then no JSON; a key given twice (`"version": 7, "version": 2`, two
    `pinned_h2d_gbps`) was read as its last value, where another reader keeps the first."""
    text, trace = header_rewriter(opt_trace, tmp_path, packbench_cli)

    one_line(trace(text.replace('"source": {', '"source": {"note": NaN, ', 1)),
             "TRACE: header.json holds NaN, which JSON does not have; rewrite the trace")
    one_line(trace(text.replace('"version": 3', '"version": 7, "version": 3', 1)),
             "TRACE: header.json gives the key 'version' twice (another reader may keep the other value)")
    good = '{"name": "m", "pinned_h2d_gbps": {"value": 10, "source": "s"}'
    for name, body, words in (("nan", good + ', "description": Infinity}', "holds Infinity, which JSON does not have"),
                              ("twice", good + ', "pinned_h2d_gbps": {"value": 1, "source": "t"}}',
                               "gives the key 'pinned_h2d_gbps' twice")):
        path = tmp_path / f"{name}.json"
        path.write_text(body)
        one_line(packbench_cli("simulate", str(opt_trace), "--machine", str(path), "--json"), f"--machine {path}", words)
    path.write_text(good + "}")
    assert json.loads(packbench_cli("simulate", str(opt_trace), "--machine", str(path), "--json").stdout,
                      parse_constant=lambda c: pytest.fail(c))["machine"]["pinned_h2d_gbps"]["value"] == 10


def test_a_number_beyond_a_double_or_a_huge_integer_in_a_trace_or_machine_file_is_one_line(
        opt_trace, packbench_cli, tmp_path):
    """Catches strict JSON that refused the literals NaN and Infinity yet took 1e999 (a JSON number
    Python reads as inf): in the trace's source or a machine file's description it came back in
    `--json`'s output as Infinity or -Infinity, which is no JSON, exit 0; and an integer of 5000
    digits was said to be "not JSON" (Python's digit limit) without saying what to fix."""
    text, trace = header_rewriter(opt_trace, tmp_path, packbench_cli)

    one_line(trace(text.replace('"source": {', '"source": {"note": 1e999, ', 1)),
             "TRACE: header.json holds the number '1e999', beyond a double's range (read as infinity); rewrite the trace")
    one_line(trace(text.replace('"source": {', '"source": {"note": ' + "7" * 4301 + ", ", 1)),
             "TRACE: header.json holds an integer of 4301 digits, more than 4300; rewrite the trace")
    good = '{"name": "m", "pinned_h2d_gbps": {"value": 10, "source": "s"}'
    for name, body, words in (("neg", good + ', "description": -1E+400}', "holds the number '-1E+400', beyond a double"),
                              ("rate", '{"name": "m", "pinned_h2d_gbps": {"value": 1e309, "source": "s"}}',
                               "holds the number '1e309', beyond a double's range")):
        path = tmp_path / f"{name}.json"
        path.write_text(body)
        one_line(packbench_cli("simulate", str(opt_trace), "--machine", str(path), "--json"), f"--machine {path}", words)
    # At the edges: the largest double and an integer of 4300 digits are JSON, read and printed back.
    (tmp_path / "edge.json").write_text(good + ', "description": [1.7976931348623157e308, ' + "7" * 4300 + "]}")
    r = packbench_cli("simulate", str(opt_trace), "--policy", "packet", "--machine", str(tmp_path / "edge.json"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout, parse_constant=lambda c: pytest.fail(c))["machine"]["description"] == [
        1.7976931348623157e308, int("7" * 4300)]


def test_one_episode_and_one_call_are_not_plural(tiny, tmp_path, packbench_cli):
    """`model stats --trace` and `simulate`'s header said "1 episodes" and "1 calls"."""
    from in_process import run_packbench

    from packbench.core.text import counted

    assert (counted(1, "episode"), counted(0, "call"), counted(1234, "call")) == ("1 episode", "0 calls", "1,234 calls")
    out = tmp_path / "one.trace"
    r = run_packbench("model", "stats", str(tiny), "--prefix", "1", "--continuation", "1", "--count", "1",
                      "--trace", str(out))
    assert r.returncode == 0, r.stderr
    assert "wrote the trace of 1 episode (1 call)" in r.stderr
    r = packbench_cli("simulate", str(out), "--policy", "dense-stream")
    assert r.returncode == 0, r.stderr
    assert "; 1 episode, 1 call" in r.stdout
    # ... and "1 layers x 1 experts": a layer and a unit counted as the episodes are.
    import numpy as np

    from packbench.core.trace import Trace, TraceCall, TraceModel, write_trace

    one = Trace(model=TraceModel(family="mixtral", unit="expert", layers=1, units=1, unit_bytes=1000, k=1),
                calls=[TraceCall(0, "prefill", 1)], sets=[[np.array([0])]])
    r = packbench_cli("simulate", str(write_trace(one, tmp_path / "unit.trace")), "--policy", "packet")
    assert r.returncode == 0, r.stderr
    assert ": mixtral (unnamed shape), 1 layer x 1 expert of 1,000 B, ; 1 episode, 1 call\n" in r.stdout, r.stdout
    assert ", 2 layers x 256 rows of 256 B, float32; 1 episode, 1 call\n" in packbench_cli(
        "simulate", str(out), "--policy", "packet").stdout
    r = run_packbench("model", "stats", str(tiny), "--prefix", "2", "--continuation", "2", "--count", "1")
    assert r.returncode == 0 and "; 1 prompt (" in r.stdout and "+ 1 decode call\n" in r.stdout, r.stdout


def test_the_table_says_which_policies_use_their_family_s_own_compute(packbench_cli, tmp_path):
    """A machine file whose entry holds expert-cache's own zero-copy compute: the caches' rows are
    priced by it and the table says so per policy; the packet, without a figure, keeps resident's."""
    import numpy as np

    from packbench.core.trace import Trace, TraceCall, TraceModel, write_trace

    ids = lambda *e: np.array(e, dtype=np.int64)  # noqa: E731
    model = TraceModel(family="mixtral", unit="expert", layers=2, units=4, unit_bytes=1000, k=2, shape="box-moe")
    write_trace(Trace(model=model, calls=[TraceCall(0, "prefill", 3), TraceCall(0, "decode", 1)],
                      sets=[[ids(0, 1, 2), ids(1, 2, 3)], [ids(0, 1), ids(2, 3)]]), tmp_path / "t.trace")
    machine = {"name": "box", "pinned_h2d_gbps": {"value": 1, "source": "s"},
               "decode_compute_ms": {"box-moe:2": {"value": 10, "source": "r",
                                                   "families": {"expert-cache": {"value": 12, "source": "z"}}}}}
    (tmp_path / "m.json").write_text(json.dumps(machine))
    r = packbench_cli("simulate", str(tmp_path / "t.trace"), "--machine", str(tmp_path / "m.json"),
                      "--policy", "packet:gather=device", "--policy", "expert-cache:capacity=2,rule=lru")
    assert r.returncode == 0, r.stderr
    assert ("compute: resident compute (the entry has no packet figure; overhead_us adds its layer and routed "
            "terms), measured at box-moe:2 (r)") in r.stdout
    assert ("compute of expert-cache:capacity=2,rule=lru: expert-cache's own zero-copy compute, measured at "
            "box-moe:2 (z)") in r.stdout


def _eight_expert_trace(path):
    import numpy as np

    from packbench.core.trace import Trace, TraceCall, TraceModel, write_trace

    ids = lambda *e: np.array(e, dtype=np.int64)  # noqa: E731
    model = TraceModel(family="mixtral", unit="expert", layers=2, units=8, unit_bytes=1000, k=2)
    return write_trace(Trace(model=model, calls=[TraceCall(0, "prefill", 3), TraceCall(0, "decode", 1)],
                             sets=[[ids(0, 1, 2), ids(1, 2, 3)], [ids(0, 1), ids(2, 3)]]), path)


def test_a_cache_beyond_the_trace_s_experts_is_refused_as_at_submit(packbench_cli, tmp_path):
    """Catches `simulate` replaying expert-cache:capacity=9 on an 8-expert trace as a cache of 8 (its
    row labelled 9), where submit refuses the same condition (core/moe.py capacity_refusal)."""
    from packbench.core.moe import capacity_refusal

    trace = _eight_expert_trace(tmp_path / "e8.trace")
    one_line(packbench_cli("simulate", str(trace), "--policy", "expert-cache:capacity=9"),
             "--policy expert-cache:capacity=9", "capacity 9 experts a layer", "has 8",
             "give a capacity from 0 to 8")
    assert capacity_refusal(9, 8, "the trace's model") in packbench_cli(
        "simulate", str(trace), "--policy", "expert-cache:capacity=9").stderr
    r = packbench_cli("simulate", str(trace), "--policy", "expert-cache:capacity=8", "--json")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("spec, fix", [("packet:", "write 'packet' alone or packet:key=value"),
                                       ("packet:gather=device,", "write 'packet' alone or packet:key=value"),
                                       ("packet:,gather=device", "write 'packet' alone or packet:key=value"),
                                       ("resident:", "write 'resident' alone (it takes no parameters)")])
def test_an_empty_parameter_part_is_refused(packbench_cli, tmp_path, spec, fix):
    """Catches `--policy packet:` (and an empty item between commas) replayed as `packet` under the
    label as typed, where --sweep FIELD= is refused: a separator with nothing after it is a typo."""
    trace = _eight_expert_trace(tmp_path / "e8.trace")
    one_line(packbench_cli("simulate", str(trace), "--policy", spec), f"policy {spec!r} has an empty parameter", fix)
    assert sim.parse_policy("packet:gather=device", "expert") == ("packet", {"gather": "device"})
    assert sim.parse_policy("packet", "expert") == ("packet", {})


def test_a_refused_policy_is_refused_before_any_policy_is_replayed(opt_trace, monkeypatch):
    """Several policies, the last refused (row-retention without rows_per_layer): one line, exit 2,
    and no ledger replayed first. Bug caught: the earlier policies were replayed in full (minutes on
    a long trace) and then discarded by the refusal of a later one."""
    from in_process import run_packbench

    replayed = []
    real = sim.ledger
    monkeypatch.setattr(sim, "ledger", lambda t, name, params: replayed.append(name) or real(t, name, params))
    one_line(run_packbench("simulate", str(opt_trace), "--policy", "packet", "--policy", "dense-stream",
                           "--policy", "row-retention"), "--policy row-retention: row-retention needs rows_per_layer")
    assert replayed == []
    r = run_packbench("simulate", str(opt_trace), "--policy", "packet", "--policy", "dense-stream", "--json")
    assert r.returncode == 0 and replayed == ["packet", "dense-stream"], r.stderr
