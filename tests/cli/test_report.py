"""`packbench report`: a report rendered from a real screen (local Ray, SQLite, a real archive),
its content checked against the archive's own records, and the page opened in headless Chromium.

One module-scoped screen: a schema-2 protocol on the tiny checkpoint with allowance-based gates
(so thresholds print in MiB) and a runtime gate (so the paired interval is drawn), audited once
so the page has an audit to show. Its `submit --wait` runs in a subprocess on the session's Ray;
every other command runs in this process (tests/in_process.py).
"""

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from packbench.core import report as data
from packbench.core.archive import ArchiveReader
from packbench.core.protocol import MIB
from in_process import Ran, run_packbench  # tests/in_process.py

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
from browser import INSTALL_HINT, check_page, chromium  # tests/cli/browser.py (pytest puts tests/cli on the path)

ray = pytest.mark.ray  # the tests that use the real screen
ONE_SCREEN_PLOTS = {"h2d", "wall", "decode", "heatmap", "union", "workload", "frontier"}  # + memory, energy where a GPU sampled them


def cli(*args: str, cwd: Path, env: dict) -> Ran:
    """`packbench ARGS` in this process, with the settings in `env` (tests/in_process.py)."""
    return run_packbench(*args, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny) -> Path:
    d = tmp_path_factory.mktemp("report")
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body.update(name="report-screen", continuation_tokens=6, allowance_mib=1,
                model={"path": str(tiny)},
                gates={"faithfulness": {"tolerance": 0.0}, "resources": {}, "capacity": {},
                       "acquisition": [{"control": "dense-stream", "max_ratio": 0.5},
                                       {"control": "dense-stream", "max_ratio": 0.3, "phase": "decode"}],
                       "runtime": {"control": "dense-stream", "max_ratio": 5.0, "resamples": 500}})
    (d / "protocol.yaml").write_text(yaml.safe_dump(body))
    return d


@pytest.fixture(scope="module")
def env(workdir) -> dict:
    """The settings every command of the module runs with."""
    return {"PACKBENCH_DB_URL": f"sqlite:///{workdir / 'packbench.db'}"}


@pytest.fixture(scope="module")
def screen(workdir, env, ray_address) -> dict:
    """A real screen, run and audited: its `results --json` summary plus the audit's record.
    `submit --wait` runs in a subprocess that joins the session's Ray (tests/conftest.py)."""
    up = cli("db", "upgrade", cwd=workdir, env=env)
    assert up.returncode == 0, up.stderr
    out = subprocess.run([sys.executable, "-m", "packbench", "submit", "protocol.yaml", "--wait", "--json"], cwd=workdir,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env, "PACKBENCH_RAY_ADDRESS": ray_address, "PYTHONPATH": str(ROOT),
                              "RAY_AUTH_MODE": "disabled"})
    assert out.returncode in (0, 1), out.stderr[-3000:]  # resources fails closed on the CPU: still a screen
    summary = json.loads(out.stdout)
    audit = cli("audit", str(summary["screen_id"]), "--json", cwd=workdir, env=env)
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    return {**summary, "audit": json.loads(audit.stdout)}


@pytest.fixture(scope="module")
def page(screen, workdir, env) -> Path:
    out = cli("report", str(screen["screen_id"]), "--out", "screen.html", cwd=workdir, env=env)
    assert out.returncode == 0, out.stderr
    path = workdir / "screen.html"
    assert out.stdout.strip() == f"wrote screen.html ({path.stat().st_size:,} bytes)"
    return path


def text_of(path: Path) -> str:
    """The page's visible text, tags dropped and entities decoded, whitespace collapsed."""
    body = path.read_text(encoding="utf-8")
    body = re.sub(r"<svg.*?</svg>", " ", body, flags=re.S)
    body = re.sub(r"<style>.*?</style>", " ", body, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", body)))


# ----------------------------------------------------------------------------- content


@ray
def test_report_shows_the_screen_as_its_archive_holds_it(screen, page):
    archive = Path(screen["archive_path"])
    s = data.read_screen(archive)
    text = text_of(page)
    raw = page.read_text()
    # protocol, frozen hash, source freeze, machine
    assert s.protocol.sha256 == screen["protocol_sha256"] and s.protocol.sha256 in text
    freeze = ArchiveReader(archive).manifest["source_freeze"]
    assert freeze["engine_sha256"] in text and freeze["git_commit"] in text
    assert s.environment["host"] in text and s.environment["torch"] in text
    # every verdict, with its threshold as the protocol wrote it
    assert f"Verdicts: {sum(v['passed'] for v in screen['verdicts'])} of {len(screen['verdicts'])} pass" in text
    for v in s.verdicts:
        # each row labelled with its condition's tier (exact or approximate)
        assert re.search(rf"{v['gate']} {re.escape(v['condition'])} exact {v['phase']} (PASS|FAIL)", text), v
    assert "1 MiB" in text and "1.04858e+06" not in text  # resources/capacity: allowance_mib as written
    runtime = next(v for v in s.verdicts if v["gate"] == "runtime")
    assert data.interval_text(runtime) in text and runtime["interval"] is not None
    # per-call H2D bytes, derived from the ledgers: dense-stream copies every outgoing row every call
    start = s.start
    assert f"{start['host_outgoing_bytes'] / 1e6:,.4g} MB" in text
    # the audit the database recorded for this very file: where, when, digest
    assert screen["audit"]["digest"] in raw and "AGREE" in text
    assert s.archive_sha256 == screen["archive_sha256"] and s.archive_sha256 in text
    # no network at view time: nothing is fetched, the policy forbids it
    assert "default-src 'none'" in raw
    assert not re.search(r"""(src|href)=["']https?:""", raw)


@ray
def test_plots_are_inline_svg_and_cpu_gaps_say_why(page):
    raw = page.read_text()
    plots = set(re.findall(r'<figure class="plot" data-plot="([a-z0-9-]+)">\s*<svg', raw))
    assert plots == ONE_SCREEN_PLOTS
    missing = set(re.findall(r'data-missing="([a-z0-9-]+)"', raw))
    assert missing == {"memory", "energy"}  # a CPU run samples no GPU memory and reads no energy
    assert "a CPU run samples no GPU" in text_of(page)


@ray
def test_series_are_derived_from_the_ledger(screen):
    s = data.read_screen(Path(screen["archive_path"]))
    per_call = data.h2d_per_call(s)
    outgoing = s.start["host_outgoing_bytes"]
    assert set(per_call["dense-stream"]["prefill"]) == {outgoing}
    assert len(per_call["dense-stream"]["decode"]) == 3 * (6 - 1)  # 3 prompts x 5 decode calls
    assert all(0 < b < outgoing for b in per_call["packet"]["decode"])
    assert data.neurons_per_layer(s) == 256  # model.path: derived from bytes, the tiny shape's ffn
    assert s.start["unit"] == "row" and data.unit_name(s) == "neurons"  # an OPT checkpoint: rows are neurons
    heat = data.active_heatmap(s)
    assert heat["condition"] == "packet" and heat["rows"].shape == (2, 3 * 6)
    union = data.union_sparsity(s)
    assert [t for t, _ in union["curve"]] == [1, 32]
    assert union["curve"][0][1] < union["curve"][1][1]  # a 32-token union is denser than one token
    workload = data.workload_by_layer(s)
    decode = [c["active_rows"] for e in s.of("packet") for c in e.calls if c["phase"] == "decode"]
    assert workload["decode"] == pytest.approx([sum(r[i] for r in decode) / len(decode) / 256 for i in range(2)])
    assert workload["target"] is None and workload["anchors"] == []  # model.path: no profile, no shape to match
    interval = data.runtime_intervals(s)[0]
    runtime = next(v for v in s.verdicts if v["gate"] == "runtime")
    assert (interval["source"], interval["value"], interval["interval"]) == ("gate", runtime["value"],
                                                                             runtime["interval"])


@ray
def test_report_of_an_archive_file_needs_no_database(screen, workdir, env, tmp_path):
    out = cli("report", screen["archive_path"], "--out", str(tmp_path / "a.html"),
              cwd=workdir, env={**env, "PACKBENCH_DB_URL": "sqlite:////nonexistent/dir/x.db"})
    assert out.returncode == 0, out.stderr
    text = text_of(tmp_path / "a.html")
    assert "audit status: no database given" in text
    with_db = cli("report", screen["archive_path"], "--db", env["PACKBENCH_DB_URL"], "--out",
                  str(tmp_path / "b.html"), cwd=workdir, env=env)
    assert with_db.returncode == 0, with_db.stderr
    assert screen["audit"]["digest"] in (tmp_path / "b.html").read_text()


@ray
def test_compare_puts_screens_side_by_side_with_verdict_agreement(screen, workdir, env, tmp_path):
    archive = screen["archive_path"]
    out = cli("report", "--compare", archive, archive, str(DATA / "gates-v2.zip"), "--out",
              str(tmp_path / "c.html"), cwd=workdir, env=env)
    assert out.returncode == 0, out.stderr
    text = text_of(tmp_path / "c.html")
    s = data.read_screen(Path(archive))
    g = data.read_screen(DATA / "gates-v2.zip")
    agreement = data.verdict_agreement([s, s, g])
    assert not agreement["same_protocol"]
    assert agreement["judged_by_all"] > 0 and agreement["agree"] <= agreement["judged_by_all"]
    assert (f"Verdict agreement: {agreement['agree']} of {agreement['judged_by_all']} verdicts judged by every "
            f"screen agree") in text
    same = data.verdict_agreement([s, s])
    assert same["same_protocol"] and same["agree"] == same["judged_by_all"] == len(s.verdicts)
    raw = (tmp_path / "c.html").read_text()
    assert set(re.findall(r'data-plot="([a-z0-9-]+)"', raw)) == {"compare-decode", "compare-h2d", "compare-wall"}


def test_bad_input_is_one_line_with_the_fix(workdir, env, tmp_path):
    for args, words in ((["no-such.zip"], "no archive no-such.zip"),
                        (["--compare", str(DATA / "gates-v2.zip")], "--compare needs two or more"),
                        ([str(DATA / "gates-v2.zip"), "--out", "r.txt"], "write the report to a .html file"),
                        (["not-a-screen"], "neither an archive file nor a screen id")):
        r = cli("report", *args, cwd=tmp_path, env=env)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr


# ----------------------------------------------------------------------------- in a browser


@ray
def test_report_renders_in_headless_chromium_without_console_errors(page, screen, workdir, env, tmp_path):
    if chromium() is None:
        pytest.fail(INSTALL_HINT)
    check = check_page(page)
    assert check.console_errors == []
    assert {p["name"] for p in check.plots} == ONE_SCREEN_PLOTS
    for p in check.plots:  # laid out at the page's width, with content drawn
        assert p["width"] > 500 and p["height"] > 150 and p["drawn"] > 20, p
    heat = next(p for p in check.plots if p["name"] == "heatmap")
    assert heat["images"] and all(i.startswith("data:image/png") for i in heat["images"])
    assert check.tables and check.overflowing == []  # every table in sight, none scrolled
    out = cli("report", "--compare", screen["archive_path"], str(DATA / "gates-v2.zip"), "--out",
              str(tmp_path / "c.html"), cwd=workdir, env=env)
    assert out.returncode == 0, out.stderr
    check = check_page(tmp_path / "c.html")
    assert check.console_errors == [] and len(check.plots) == 3 and check.overflowing == []
    assert all(p["width"] > 500 and p["drawn"] > 10 for p in check.plots)


def test_the_browser_check_sees_a_broken_page(tmp_path):
    """The check itself: a script error and an external fetch are console errors, an empty
    plot has no size."""
    if chromium() is None:
        pytest.fail(INSTALL_HINT)
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
                   'script-src \'unsafe-inline\'"><img src="https://example.invalid/x.png">'
                   '<figure class="plot" data-plot="empty"></figure><script>undefinedFunction()</script>')
    check = check_page(bad)
    assert any("undefinedFunction" in e for e in check.console_errors), check.console_errors
    assert any("example.invalid" in e or "Content Security Policy" in e for e in check.console_errors)
    assert check.plots == [{"name": "empty", "width": 0, "height": 0, "drawn": 0, "images": []}]


# ----------------------------------------------------------------------------- pure data, no screen


def test_verdict_display_keeps_the_protocols_units():
    s = data.read_screen(DATA / "gates-v2.zip")
    by = {(v["gate"], v["condition"], v["phase"]): v for v in s.verdicts}
    assert data.threshold_text(by[("resources", "packet", "all")], s.protocol) == "1 MiB"
    assert data.threshold_text(by[("capacity", "packet", "all")], s.protocol) == "1 MiB"
    assert data.value_text(by[("capacity", "packet", "all")]) == f"{597504 / MIB:.1f} MiB (597,504 B)"
    assert data.threshold_text(by[("acquisition", "packet", "decode")], s.protocol) == "0.3"
    assert data.threshold_text(by[("useful_latency", "packet", "all")], s.protocol) == "5.0 s"


def test_historical_archives_report_without_traces_or_energy():
    """Archives written before traces/ existed still report; the gaps are named, not drawn."""
    for name in ("quickstart-v1.zip", "negative-v1.zip", "gates-v2.zip"):
        s = data.read_screen(DATA / name)
        assert s.complete and s.problems == ()
        assert all(not v for v in data.memory_traces(s).values())
        assert all(not v for v in data.energy(s).values())
        assert [r["condition"] for r in data.condition_summary(s)] == list(s.conditions)


@ray
def test_screens_show_says_where_the_attempts_time_went(screen, workdir, env):
    """`screens show` reads the attempt's archive: the cold load, the episodes' own walls and
    the worker's time around them (activation, measurements), within the claim-to-end span."""
    out = cli("screens", "show", str(screen["screen_id"]), "--json", cwd=workdir, env=env)
    assert out.returncode == 0, out.stderr
    [time] = json.loads(out.stdout)["time"]
    archive = ArchiveReader(Path(screen["archive_path"]))
    records = [archive.read_json(e.record) for e in archive.episodes()]
    # startswith: a packbench worker running elsewhere on this machine is named after it ("host shared ...")
    assert time["model"] == "cold" and time["load"] > 0 and time["note"].startswith(f"{len(records)} episodes")
    assert time["episodes_wall"] == pytest.approx(sum(r["wall_s"] for r in records), abs=1e-3)
    # (the load's clock starts at the worker's entry, before the claim: it is not inside the span)
    assert 0 < time["around_episodes"] and time["episodes_wall"] + time["around_episodes"] < time["claim_to_end"]
    text = cli("screens", "show", str(screen["screen_id"]), cwd=workdir, env=env).stdout
    assert "time (s; from each attempt's archive)" in text and "around_episodes" in text


def test_a_condition_shows_the_params_it_ran_with_defaults_spelled_out():
    """A protocol frozen before schema 3 says `packet` without `gather`: it ran the host gather,
    and the report says so (since schema 3 the same words would mean the device gather)."""
    from packbench.cli.report_page import protocol_section

    s = data.read_screen(DATA / "quickstart-v1.zip")
    packet = next(r for r in data.condition_summary(s) if r["condition"] == "packet")
    assert packet["params"] == "gather=host"
    assert html.escape(json.dumps({"gather": "host"})) in protocol_section(s)


def test_an_interrupted_archive_reports_what_it_holds(tmp_path):
    """No manifest, no verdicts, half the episodes: the page says so and draws what is there."""
    from packbench.core.archive import ArchiveWriter, episode_member, logits_member
    from packbench.cli.report_page import AuditStatus, screen_page

    src = ArchiveReader(DATA / "gates-v2.zip")
    partial = tmp_path / "partial.zip"
    w = ArchiveWriter(partial)
    for name in ("protocol.json", "plan.json", "worker.json"):
        w.add_json(name, src.read_json(name))
    for index in range(9):
        w.add_episode(src.read_json(episode_member(index)), src.read_array(logits_member(index)))
    w.close()
    s = data.read_screen(partial)
    assert not s.complete and len(s.episodes) == 9 and s.planned == 18 and s.verdicts == []
    assert any("incomplete" in p for p in s.problems)
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", screen_page(s, audit=AuditStatus()))))
    assert "9 of 18 planned" in text and "no verdicts.json: the screen did not finish" in text
    assert "the archive has no source freeze (no manifest)" in text


def test_large_screens_keep_the_page_small():
    """Dense scatters become one embedded image and long memory traces are thinned (keeping
    the peak): a plot's size is bounded by the picture, not by the number of calls."""
    import numpy as np

    from packbench.cli import report_figures as figs

    rng = np.random.default_rng(0)
    with figs.style():
        decode = figs.decode_figure({"dense-stream": list(rng.normal(36, 1, 50_000)),
                                     "packet": list(rng.normal(30, 5, 50_000))}, ("dense-stream", "packet"))
        t = np.column_stack([np.linspace(0, 60, 100_000), rng.integers(1, 4000, 100_000) * MIB])
        t[73_123, 1] = 4700 * MIB
        memory = figs.memory_figure({"packet": [(0, t)]}, ("packet",), 4800 * MIB)
    assert len(decode) < 300_000 and len(memory) < 200_000, (len(decode), len(memory))
    thin = figs.thin_trace(t)
    assert len(thin) <= figs.MAX_TRACE_POINTS + 1 and thin[:, 1].max() == 4700 * MIB
    assert np.all(np.diff(thin[:, 0]) > 0)


def test_a_shared_gpu_is_named_on_the_page():
    """Episodes whose sampler saw other processes on the GPU: the conditions section says so, with
    the processes; malformed entries from a hostile archive are ignored, not trusted."""
    from packbench.cli.report_page import summary_section

    s = data.read_screen(DATA / "gates-v2.zip")
    assert data.gpu_sharing(s) == {"episodes": [], "processes": {}}
    assert "gpu-shared" not in summary_section(s)
    first, second, third = s.episodes[:3]
    first.record["sampler"] = {"other_processes": [[4242, 512 << 20], [77, 0]]}
    second.record["sampler"] = {"other_processes": [[4242, 600 << 20], ["x", 1], [5, -1], [True, 3]]}
    third.record["sampler"] = {"other_processes": "everything"}
    shared = data.gpu_sharing(s)
    assert shared == {"episodes": [first.index, second.index], "processes": {4242: 600 << 20, 77: 0}}
    page = summary_section(s)
    assert 'id="gpu-shared"' in page and "2 episodes saw other processes" in page
    assert "pid 4242 holding up to 600 MiB" in page and "pid 77 holding up to 0 MiB" in page


def edited_attempt(path, edit):
    """An attempt (as `screens show` reads one) whose archive at `path` is a copy of gates-v2.zip
    with each episode record passed through `edit(index, record)`."""
    import types

    from packbench.core.archive import ArchiveWriter, episode_member

    src = ArchiveReader(DATA / "gates-v2.zip")
    w = ArchiveWriter(path)
    for index, entry in enumerate(src.episodes()):
        record = src.read_json(entry.record)
        edit(index, record)
        w.add_json(episode_member(record["plan_index"]), record)
    w.close()
    return types.SimpleNamespace(number=1, model_state="cold", finished_at=None, archive_path=path)


def test_screens_show_names_a_shared_gpu(tmp_path):
    """`screens show`'s time table reads the archive: a note names the processes that shared the GPU."""
    from packbench.cli.query import attempt_time

    def edit(index, record):
        if index < 2:
            record["sampler"] = {"other_processes": [[4242, 1 << 30], [9, 0]] if index else [["bad"], [4242, 5]]}

    attempt = edited_attempt(tmp_path / "shared.zip", edit)
    assert attempt_time(attempt)["note"] == "18 episodes; GPU shared with pid 9, 4242 in 2 of them"
    clean = edited_attempt(tmp_path / "clean.zip", lambda index, record: None)
    assert attempt_time(clean)["note"] == "18 episodes"


def test_a_shared_host_is_named_on_the_page_and_in_screens_show(tmp_path):
    """Episodes run while other packbench workers were busy on the host (`host_workers`): the page and
    `screens show` name them; malformed entries from a hostile archive are ignored."""
    from packbench.cli.query import attempt_time
    from packbench.cli.report_page import summary_section

    s = data.read_screen(DATA / "gates-v2.zip")
    assert data.host_sharing(s) == {"episodes": [], "workers": {}} and "host-shared" not in summary_section(s)
    first, second, third = s.episodes[:3]
    first.record["host_workers"] = [[4242, "GPU-other"], [7, "cpu"]]
    second.record["host_workers"] = [[4242, "GPU-other"], ["x", "cpu"], [5, 3], [True, "cpu"], [-1, "cpu"], [8]]
    third.record["host_workers"] = "everyone"
    assert data.host_sharing(s) == {"episodes": [first.index, second.index], "workers": {4242: "GPU-other", 7: "cpu"}}
    page = summary_section(s)
    assert 'id="host-shared"' in page and "2 episodes ran while other packbench workers were busy" in page
    assert "pid 7 on cpu, pid 4242 on GPU-other" in page
    third.record["host_workers"] = [[9, "<i>GPU</i>"]]
    assert "pid 9 on &lt;i&gt;GPU&lt;/i&gt;" in summary_section(s)  # a hostile device name is text

    def edit(index, record):
        if index < 3:
            record["host_workers"] = [[31, "GPU-x"]] if index else [["bad"], {"pid": 1}]

    attempt = edited_attempt(tmp_path / "host.zip", edit)
    assert attempt_time(attempt)["note"] == "18 episodes; host shared with packbench worker pid 31 in 2 of them"


def test_the_comparison_wall_bars_have_error_bars_and_say_whose_host_was_shared(tmp_path):
    from packbench.cli import report_figures as figs
    from packbench.cli.report_page import AuditStatus, _compare_sharing, _wall_ranges, compare_page

    s, t = data.read_screen(DATA / "gates-v2.zip"), data.read_screen(DATA / "gates-v2.zip")
    ranges = _wall_ranges(s)
    for c, walls in data.wall_per_episode(s).items():
        ws = sorted(w for _, w in walls)
        assert ranges[c][0] >= ws[0] and ranges[c][1] <= ws[-1] and ranges[c][0] <= ranges[c][1]
    assert "No screen's host or GPU was seen shared" in _compare_sharing(["A", "B"], [s, t])
    t.episodes[0].record["host_workers"] = [[4242, "cpu"]]
    note = _compare_sharing(["A", "B"], [s, t])
    assert 'class="fail"' in note and f"screen B&#x27;s host was shared with other packbench workers in 1 of " \
                                      f"{len(t.episodes)} episodes" in note
    page = compare_page([s, t], [AuditStatus(), AuditStatus()])
    wall = page[page.index('data-plot="compare-wall"'):]
    assert "error bars span the 10th to the 90th percentile" in wall[:wall.index("</figure>")]
    with figs.style():
        bars = [figs.compare_bars_figure("w", ["A"], [{"packet": 0.3}], ["packet"], "s", ranges=r)
                for r in (None, [{"packet": (0.1, 0.5)}])]
    assert bars[0] != bars[1] and bars[1].count("<path") > bars[0].count("<path")  # the error bar is drawn


def test_figures_read_as_what_was_measured():
    """A slow outlier puts decode ms/token on a log axis; two measured token counts are not
    joined as a curve; verdict details are rounded for reading (the stored one is not)."""
    from packbench.cli import report_figures as figs
    from packbench.cli.summary import detail_text

    assert figs.wants_log([1.0, 1.1, 0.9, 1.0, 45.0]) and not figs.wants_log([1.0, 1.1, 0.9, 3.0])
    # one condition 100x slower than another: on a linear axis the fast one's box is a line at 0
    assert figs.wants_log([1.1, 0.6, 1.2], [116.0, 90.0, 284.0]) and not figs.wants_log([7.0, 7.1], [34.0, 35.0])
    with figs.style():
        svg = figs.decode_figure({"packet": [1.0, 1.1, 0.9, 1.0, 45.0]}, ("packet",))
    assert "(log scale)" in svg
    assert (figs.union_style(2), figs.union_style(3)) == ("o", "o-")
    assert detail_text("first episode 149.35989795600017 s <= 200.0 s; 1 episodes, 11 episodes") == \
        "first episode 149.4 s <= 200.0 s; 1 episode, 11 episodes"


def test_the_frontier_marks_each_point_by_tier_and_fidelity():
    from packbench.cli import report_figures as figs

    view = {"memory": "held", "points": [
        {"condition": "packet", "tier": "exact", "decode_ms": 6.8, "memory_bytes": 4650 << 20,
         "fidelity_mean_kl_max": None, "fidelity_top1_min": None, "fidelity_passed": None},
        {"condition": "int8", "tier": "approximate", "decode_ms": 11.6, "memory_bytes": 2879 << 20,
         "fidelity_mean_kl_max": 0.00123, "fidelity_top1_min": 0.985, "fidelity_passed": False}]}
    with figs.style():
        svg = figs.frontier_figure(view, ("packet", "int8"))
        sampled = figs.frontier_figure({**view, "memory": "sampled"}, ("packet", "int8"))
        nothing = figs.frontier_figure({"memory": "held", "points": [{**view["points"][0], "decode_ms": None}]},
                                       ("packet",))
    assert "packet (exact)" in svg and "int8 (approximate)" in svg
    assert "KL 0.00123, top-1 0.985, fidelity FAIL" in svg
    assert "no GPU sampled" in svg and "peak sampled GPU memory" in sampled and nothing is None


def wide_summary(rows):
    """gates-v2's condition rows, and seven more as wide as a GPU screen of every policy and a
    competitor writes them (long names and parameters, GPU peaks, energy, fidelity)."""
    more = [{**rows[-1], "condition": f"early-forecast-device-{n}", "tier": "approximate",
             "policy": "quantized", "params": "method=int8-weight-only, mode=compile, weights=dtype",
             "failed": 1, "peak_sampled_bytes": 4650 * MIB + n, "energy_j_per_episode": 1234.5,
             "energy_j_per_token": 12.345, "fidelity_mean_kl_max": 0.0012345, "fidelity_top1_min": 0.98765}
            for n in range(7)]
    return rows + more


def test_a_wide_conditions_table_fits_the_page(tmp_path, monkeypatch):
    """Nine conditions with parameters, GPU peaks, energy and fidelity: the conditions table fits the
    page's width in Chromium (its policy parameters wrap under the policy, paired figures share a
    cell), where one column per figure ran past the page."""
    from packbench.cli.report_page import html_page, summary_section

    if chromium() is None:
        pytest.fail(INSTALL_HINT)
    s = data.read_screen(DATA / "gates-v2.zip")
    rows = wide_summary(data.condition_summary(s))
    monkeypatch.setattr(data, "condition_summary", lambda screen: rows)
    page = tmp_path / "wide.html"
    page.write_text(html_page("wide", "", summary_section(s)))
    check = check_page(page, width=1400)
    assert len(check.tables) == 1 and check.tables[0]["cls"] == "conditions"
    assert check.overflowing == [], check.tables
    text = text_of(page)
    assert "method=int8-weight-only, mode=compile" in text and f"{rows[-1]['scored']} (1 failed)" in text
    assert "KL 0.001234" in text and "top-1 0.9877" in text


def test_the_condition_tables_carry_each_times_spread():
    """Both reports give each condition's wall and decode ms/token as a median over its p10-p90
    (core/dispersion.py), beside the scored count."""
    from packbench.cli.report_page import AuditStatus, compare_page, summary_section
    from packbench.core.dispersion import spread

    s = data.read_screen(DATA / "gates-v2.zip")
    walls = {c: spread([w for _, w in v]) for c, v in data.wall_per_episode(s).items()}
    decode = {c: spread(v) for c, v in data.decode_ms_per_token(s).items()}
    for r in data.condition_summary(s):
        assert r["wall_s_spread"] == walls[r["condition"]] and r["decode_ms_spread"] == decode[r["condition"]]
    table = summary_section(s)
    compared = compare_page([s, data.read_screen(DATA / "gates-v2.zip")], [AuditStatus(), AuditStatus()])
    for c, w in walls.items():
        cell = f'{w["median"]:.3g}<br><span class="detail">{w["p10"]:.3g}-{w["p90"]:.3g}</span>'
        assert cell in table and cell in compared, c
    assert "wall s: median, p10-p90" in table and "decode ms/token: median, p10-p90" in compared


def test_a_busy_host_is_named_on_the_single_screen_page():
    """Other processes' CPU on the host (each record's host_load, from /proc): half a core or more
    during an episode, and the conditions section says so, as the comparison report does."""
    from packbench.cli.report_page import summary_section

    s = data.read_screen(DATA / "gates-v2.zip")
    assert "host-busy" not in summary_section(s)  # an archive from before host_load: nothing claimed
    for n, e in enumerate(s.episodes[:3]):
        e.record.update(episode_s=1.0, host_load={"other_cpu_s": [1.5, 0.2, 0.7][n]})
    page = summary_section(s)
    assert 'id="host-busy"' in page
    assert f"in 2 of {len(s.episodes)} episodes other processes kept 0.5 core or more busy (up to 1.5 cores" in page


def test_the_frontier_leaves_overlapping_names_to_its_legend():
    """Points a few pixels apart: one exact name is written, the others are left to the legend; an
    approximate point's fidelity label is always written."""
    from packbench.cli import report_figures as figs

    def point(name, tier, ms, mib):
        return {"condition": name, "tier": tier, "decode_ms": ms, "memory_bytes": int(mib * MIB),
                "fidelity_mean_kl_max": 0.001 if tier == "approximate" else None,
                "fidelity_top1_min": 0.99 if tier == "approximate" else None, "fidelity_passed": True}

    names = [f"packet-{n}" for n in range(5)]
    view = {"memory": "held", "points": [point(c, "exact", 1.0 + 0.01 * n, 0.6 + 0.001 * n)
                                         for n, c in enumerate(names)]
            + [point("int8", "approximate", 1.02, 0.601), point("resident", "exact", 12.0, 0.3)]}
    with figs.style():
        svg = figs.frontier_figure(view, (*names, "int8", "resident"))
    body = svg[:svg.index("legend")] if "legend" in svg else svg
    written = [c for c in names if f">{c}<" in body or f"{c}</text>" in body]
    assert "KL 0.001, top-1 0.99, fidelity PASS" in svg and "resident" in body
    assert len(written) <= 1, written


def test_a_screen_recorded_without_the_ledger_shows_no_bytes_rather_than_zero(tmp_path):
    """Bug caught: `recording: false` runs without the per-call ledger, so every byte count in its
    records is a zero that measured nothing; the report's conditions table said 0 MB per call and
    `results --screen` listed h2d_bytes 0 for every episode, as if nothing had been moved."""
    from bench.audit import synthetic_protocol, write_synthetic_screen

    raw = synthetic_protocol(prompts_n=2)
    raw["recording"] = False
    raw["gates"].pop("acquisition", None)  # refused without the ledger
    write_synthetic_screen(tmp_path / "off.zip", raw)
    write_synthetic_screen(tmp_path / "on.zip", synthetic_protocol(prompts_n=2))
    off, on = data.read_screen(tmp_path / "off.zip"), data.read_screen(tmp_path / "on.zip")
    assert not off.protocol.recording and on.protocol.recording
    for s, recorded in ((off, False), (on, True)):
        for row in data.condition_summary(s):
            for key in ("prefill_h2d_per_call", "decode_h2d_per_call"):
                assert (row[key] is not None) == recorded, (row["condition"], key, row[key])
        assert any(calls for phases in data.h2d_per_call(s).values() for calls in phases.values()) == recorded
