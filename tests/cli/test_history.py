"""`packbench history` over three commits, `compare --fail-above`, and the detector's measured
false-alarm rate.

The screens are the real quickstart archive (tests/data/quickstart-v1.zip) recorded as if run at
three commits of the engine: the source commit injected where the worker records it (the
attempt's `source_freeze.git_commit`, core/source.py), each episode's times multiplied by a
seeded noise of 3 %, and the third commit's by 1.5 (the injected slowdown).
"""

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "api"))  # the archive-to-screen helper the API tests use

from browser import INSTALL_HINT, check_page, chromium  # noqa: E402  (tests/cli/browser.py)
from packbench.db.store import Store  # noqa: E402
from screens import QUICKSTART, archived, ingest_archive  # noqa: E402
from packbench.core.canonical import canonical_json  # noqa: E402
from packbench.service.history import TIMED, false_alarm_rate, steps  # noqa: E402

COMMITS = ("1" * 40, "2" * 40, "3" * 40)
RUNS = (7, 3, 3)  # per commit: seven repeats of the first measure the false-alarm rate


def slowed(factor: float, rng: random.Random):
    def edit(rec: dict) -> dict:
        f = factor * rng.lognormvariate(0.0, 0.03)
        rec = json.loads(json.dumps(rec))
        rec["wall_s"] *= f
        rec["call_s"] *= f
        for phase in rec.get("phases", {}).values():
            phase["call_s"] *= f
        return rec
    return edit


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('history') / 'p.db'}"
    rng = random.Random(7)
    with Store(url) as store:
        store.upgrade()
        n = 0
        for commit, factor, runs in zip(COMMITS, (1.0, 1.0, 1.5), RUNS):
            for _ in range(runs):
                n += 1
                ingest_archive(store, QUICKSTART, commit=commit, key=str(n), edit=slowed(factor, rng))
    return url


@pytest.fixture
def cli(packbench_cli):
    """`packbench ARGS --db URL`, in this process (tests/conftest.py `packbench_cli`)."""
    return lambda *args, url: packbench_cli(*args, "--db", url)


def test_the_injected_slowdown_is_one_step_and_the_repeats_raise_no_alarm(url, cli):
    out = cli("history", "quickstart-v1", "--json", url=url)
    assert out.returncode == 0, out.stderr
    h = json.loads(out.stdout)
    assert [s["commit"] for s in h["screens"]] == [c for c, n in zip(COMMITS, RUNS) for _ in range(n)]
    first_slow = h["screens"][RUNS[0] + RUNS[1]]["screen_id"]
    for s in h["series"]:
        if s["metric"] in ("wall_ms", "call_ms", "decode_ms_per_token"):
            assert [st["screen_id"] for st in s["steps"]] == [first_slow], s  # one step, where it was injected
            (st,) = s["steps"]
            assert st["confirmed"] and 35 < st["change_pct"] < 65
        else:
            assert s["changes"] == [], s  # the exact counters did not move
    assert h["false_alarm"] is not None and h["false_alarm"]["rate"] < 0.02


def test_the_table_names_each_commit_and_the_step(url, cli):
    out = cli("history", "quickstart-v1", "--condition", "packet", "--metric", "wall_ms", url=url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("1111111111") for line in lines) and any("3333333333" in ln for ln in lines)
    assert "STEP" in next(ln for ln in lines if ln.startswith("3333333333"))
    assert any(ln.startswith("step: packet wall_ms +") for ln in lines)
    assert "false-alarm rate on 500 shuffles" in out.stdout
    # Every figure of every condition: one table per condition, each line within a terminal's width
    # (one table of them all ran to 330 characters).
    out = cli("history", "quickstart-v1", url=url)
    lines = out.stdout.splitlines()
    assert {"dense-stream (exact)", "packet (exact)"} <= set(lines), lines[:3]  # one heading per condition, its tier
    assert max(map(len, lines[1:])) <= 200, max(lines[1:], key=len)


def test_fail_above_is_a_ci_gate(url, cli):
    gated = cli("history", "quickstart-v1", "--fail-above", "20", url=url)
    assert gated.returncode == 1
    assert "regression: packet wall_ms: +" in gated.stderr
    assert cli("history", "quickstart-v1", "--fail-above", "90", url=url).returncode == 0
    # compare A B: the first screen against a slow one, and against a repeat of its own commit
    assert cli("compare", "1", str(sum(RUNS)), "--fail-above", "20", url=url).returncode == 1
    same = cli("compare", "1", "2", "--fail-above", "20", url=url)
    assert same.returncode == 0, same.stderr


def test_an_exact_counter_flags_any_change(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with Store(url) as store:
        store.upgrade()
        for n in range(3):
            def edit(rec, n=n):
                if n == 2 and rec["condition"] == "packet":
                    rec = {**rec, "h2d_index_bytes": rec["h2d_index_bytes"] + 4}  # 4 bytes more: one index
                return rec
            ingest_archive(store, QUICKSTART, commit=COMMITS[n], key=str(n), edit=edit)
    out = cli("history", "quickstart-v1", "--metric", "h2d_bytes", "--fail-above", "50", url=url)
    assert out.returncode == 1
    assert "regression: packet h2d_bytes: changed at screen 3" in out.stderr
    assert "CHANGED" in out.stdout


def test_bad_input_is_one_line(url, cli):
    for args, words in ((("history", "nope"), "no done screen of protocol 'nope'"),
                        (("history", "quickstart-v1", "--metric", "speed"), "--metric 'speed' is not one of"),
                        (("history", "quickstart-v1", "--condition", "pakcet"), "--condition 'pakcet'"),
                        (("history", "quickstart-v1", "--fail-above", "-1"), "--fail-above -1.0 must be"),
                        (("compare", "1", "2", "--fail-above", "nan"), "--fail-above nan must be")):
        out = cli(*args, url=url)
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_the_detector_false_alarm_rate_and_power_as_documented():
    rng = np.random.default_rng(1)
    for sigma in (0.05, 0.1, 0.3):
        alarms = sum(any(s.confirmed for s in steps(list(np.exp(rng.normal(0, sigma, 12))))) for _ in range(2000))
        assert alarms / 2000 < 0.015, (sigma, alarms)
    found = 0
    for _ in range(500):
        xs = list(np.exp(rng.normal(0, 0.05, 12)))
        found += any(s.confirmed and s.index in (6, 7) for s in steps(xs[:6] + [1.5 * x for x in xs[6:]]))
    assert found / 500 > 0.95
    assert false_alarm_rate([1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99], shuffles=300) < 0.05


def test_a_blip_just_before_a_slowdown_is_not_the_step():
    """A +4.4 % blip on the last repeat, then the real 4x slowdown: the step is the slowdown's
    screen, not the blip's (the next run is beyond the bound but not at the blip's level)."""
    xs = [100.0, 100.2, 99.9, 100.1, 100.0, 104.4, 400.0, 401.0]
    assert [(s.index, s.confirmed) for s in steps(xs)] == [(6, True)]
    # a real step to the blip's level is still one
    assert [s.index for s in steps([100.0, 100.2, 99.9, 100.1, 100.0, 110.0, 110.5, 109.8])] == [5]


def test_the_history_page_has_one_plot_per_figure_and_renders(url, tmp_path, cli):
    page = tmp_path / "history.html"
    out = cli("history", "quickstart-v1", "--html", str(page), url=url)
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    for metric in ("wall_ms", "call_ms", "decode_ms_per_token", "h2d_bytes", "d2h_bytes", "rows"):
        assert f'data-plot="{metric}"' in text
    assert "https://" not in text.split("</head>")[1]  # self-contained
    if chromium() is None:
        pytest.fail(INSTALL_HINT)
    check = check_page(page)
    assert check.console_errors == []
    assert len(check.plots) == 6
    # one table per condition, in sight: one table of both conditions' 14 figures ran past the page
    assert len(check.tables) == 2 and check.overflowing == [], check.tables
    assert "<h3>dense-stream (exact)</h3>" in text and "<h3>packet (exact)</h3>" in text and "STEP</span>" in text
    rows = text[text.index('data-plot="rows"'):]
    assert ">4<" in rows[:rows.index("</figure>")] and "1e6" not in text  # whole counts, no offset
    for p in check.plots:
        assert p["width"] > 500 and p["height"] > 150 and p["drawn"] > 20, p


LONG = "x" * 100_000  # about the most one command-line argument holds (Linux: 128 KiB)


@pytest.mark.parametrize("args", [
    ["history", LONG], ["history", "quickstart-v1", "--condition", LONG],
    ["history", "quickstart-v1", "--metric", LONG], ["compare", "--protocol", LONG],
    ["results", "--condition", LONG], ["results", "--model", LONG], ["results", "--machine", LONG],
    ["screens", "list", "--tag", f"{LONG}=v"],
], ids=["history", "history-condition", "history-metric", "compare-protocol", "results-condition",
        "results-model", "results-machine", "tag-key"])
def test_a_long_argument_is_named_in_a_short_line(url, cli, args):
    """Each line quoted the argument whole: 100 KB of error (history's twice: 200 KB), and
    results --model/--machine reached SQLite's LIKE limit and said 'database error ... check the
    database'. The argument is shown cut to 60 characters; nothing else is lost."""
    out = cli(*args, url=url)
    assert out.returncode in (0, 2), out.stderr[-300:]
    text = (out.stderr or out.stdout).strip()
    assert len(text.splitlines()) == 1 and len(text) < 400, text[:300]
    assert "database error" not in text and "x" * 60 not in text and "..." in text or "substring of 100000" in text


def test_decode_ms_per_token_of_a_batch_divides_by_its_decode_tokens():
    """A batch of B sequences of N tokens decodes B x (N - 1) tokens, not B x N - 1: the figure
    is per decode token, as the report's and `results`' (docs/metrics.md). Screen 1 of a
    `batch: 2` protocol printed 0.3439 ms where its decode tokens give 0.3684."""
    from types import SimpleNamespace

    figure = TIMED["decode_ms_per_token"]
    batch = SimpleNamespace(decode_call_s=0.010, n_tokens=12, tokens=([1] * 6, [2] * 6))
    assert figure(batch) == pytest.approx(1e3 * 0.010 / 10)  # 2 sequences x 5 decode calls
    single = SimpleNamespace(decode_call_s=0.010, n_tokens=6, tokens=(1,) * 6)
    assert figure(single) == pytest.approx(1e3 * 0.010 / 5)
    assert figure(SimpleNamespace(decode_call_s=0.0, n_tokens=1, tokens=(1,))) is None


def test_a_name_shared_by_two_frozen_protocols_is_refused_not_one_series(tmp_path, cli):
    """Bug: `history NAME` took the done screens of every protocol of that name as one series. An
    edited protocol file keeps its name and freezes to a new SHA-256 (another prefix_tokens here):
    its tokens and bytes differ by construction, and `--fail-above` failed CI on 'changes' that
    were two different protocols. The name is refused as `compare --protocol` refuses it; each
    SHA-256 prefix still gives its own history."""
    import hashlib

    from packbench.core.archive import file_sha256

    url = f"sqlite:///{tmp_path / 'p.db'}"
    body, records, verdicts, manifest = archived()
    edited = {**body, "prefix_tokens": body["prefix_tokens"] // 2}
    edited_json = canonical_json(edited).decode()
    edited_sha = hashlib.sha256(edited_json.encode()).hexdigest()
    with Store(url) as store:
        store.upgrade()
        ingest_archive(store, QUICKSTART, commit=COMMITS[0], key="1")
        store.ingest_attempt(
            protocol_sha256=edited_sha, protocol_name=body["name"], protocol_json=edited_json,
            machine={"host": "ci-box", "gpu_name": "cpu"},
            attempt={"archive_path": str(QUICKSTART), "archive_sha256": file_sha256(QUICKSTART)[:48] + "2".rjust(16, "0"),
                     "source_freeze": {"git_commit": COMMITS[1]}, "ingested_from": "tests/cli", "node": "ci-box"},
            episodes=[{**r, "h2d_index_bytes": r["h2d_index_bytes"] + 4} for r in records], verdicts=verdicts)
    out = cli("history", "quickstart-v1", "--fail-above", "50", url=url)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "matches 2 frozen protocols" in out.stderr and edited_sha[:12] in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    for sha in (manifest["protocol_sha256"], edited_sha):
        one = cli("history", sha[:16], "--fail-above", "50", url=url)
        assert one.returncode == 0, one.stderr


def test_an_approximate_conditions_history_is_labelled_with_its_tier(tmp_path, cli):
    """A competitor of tier approximate beside exact loaders: its table heading, its JSON series and
    its API rows say `approximate`, as `results` and `compare` label every row. The bug it catches:
    history printed flexgen's or a low-bit model's figures under the bare condition name, beside the
    exact conditions' and in the same units, with nothing saying they are not exact."""
    from bench.audit import synthetic_protocol, write_synthetic_screen

    from packbench.service.history import history

    raw = synthetic_protocol(prompts_n=2, repetitions=1, conditions=("dense-stream", "int8"))
    raw["schema"] = 5
    raw["conditions"][1] = {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}}
    raw["gates"] = {"faithfulness": None, "fidelity": {"max_mean_kl": 0.01, "min_top1": 0.7}}
    path = tmp_path / "approx.zip"
    write_synthetic_screen(path, raw)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Store(url) as store:
        store.upgrade()
        ingest_archive(store, path, commit="1" * 40)
        h = history(store, raw["name"])
    assert h.tiers == {"dense-stream": "exact", "int8": "approximate"}
    assert {(r["condition"], r["tier"]) for r in h.rows()} == {("dense-stream", "exact"), ("int8", "approximate")}
    out = cli("history", raw["name"], url=url)
    assert out.returncode == 0, out.stderr
    headings = [line for line in out.stdout.splitlines() if line in ("dense-stream (exact)", "int8 (approximate)")]
    assert headings == ["dense-stream (exact)", "int8 (approximate)"]
    data = json.loads(cli("history", raw["name"], "--json", url=url).stdout)
    assert data["tiers"] == {"dense-stream": "exact", "int8": "approximate"}
    assert {(s["condition"], s["tier"]) for s in data["series"]} == {("dense-stream", "exact"), ("int8", "approximate")}
    page = tmp_path / "h.html"
    assert cli("history", raw["name"], "--html", str(page), url=url).returncode == 0
    assert "<h3>int8 (approximate)</h3>" in page.read_text() and "<h3>dense-stream (exact)</h3>" in page.read_text()
