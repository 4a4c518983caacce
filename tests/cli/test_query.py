"""`packbench results | screens list | screens show | compare`, the schema refusal and bad input.

Output formats run in-process (typer's CliRunner, fast); the refusal and bad input run the
console entry point `cli.main.main()` in this process (tests/conftest.py `packbench_cli`: its
exit codes and one-line errors): milliseconds a command, where a `python -m packbench` subprocess
costs half a second.
"""

import csv
import io
import json
import os
import re
import sqlite3
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.core.errors import PackbenchError
from packbench.db.queries import GATES
from packbench.db.store import Store

ROOT = Path(__file__).resolve().parents[2]
TABLES = ("protocols", "machines", "screens", "attempts", "episodes", "verdicts", "audits")
PG_ENV = "PACKBENCH_TEST_PG_URL"


def body(name: str, model: str, dtype: str) -> str:
    return json.dumps({"name": name, "model": {"path": model}, "dtype": dtype}, sort_keys=True)


def episode(plan_index: int, condition: str, *, role: str = "scored", h2d: int = 1000, ok: bool = True,
            energy: float | None = None) -> dict:
    record = {"plan_index": plan_index, "condition": condition, "role": role, "prompt": plan_index // 2,
              "status": "ok" if ok else "failed", "error": None if ok else "boom", "tokens": [1, 2],
              "wall_s": 1.0, "call_s": 0.5, "h2d_weight_bytes": h2d, "h2d_index_bytes": 0, "d2h_bytes": 4,
              "energy_j": energy if ok else None}
    return record


def verdict(gate: str, condition: str, passed: bool, value: float = 0.0) -> dict:
    return {"gate": gate, "condition": condition, "phase": "all", "passed": passed, "value": value,
            "threshold": 0.5, "interval": None, "episodes": [], "detail": ""}


def seed(url: str) -> None:
    """Screen 1 (tiny/float32, passes), screen 2 (opt-1.3b/float16, packet fails faithfulness,
    one failed episode), screen 3 queued. Energy per ok episode (J): screen 1 dense-stream 30,
    packet 10; screen 2 dense-stream 40, packet 12."""
    with Store(url) as store:
        store.upgrade()
        tiny = store.put_protocol(sha256="ab" * 32, name="quickstart", canonical_json=body("quickstart", "models/tiny", "float32"))
        big = store.put_protocol(sha256="cd" * 32, name="big", canonical_json=body("big", "/models/opt-1.3b", "float16"))
        h200 = store.put_machine(host="box-a", gpu_name="NVIDIA H200", driver="570", torch="2.11", cuda="12.8")
        for protocol_id, packet_bytes, packet_ok, (dense_j, packet_j) in ((tiny, 300, True, (30.0, 10.0)),
                                                                         (big, 600, False, (40.0, 12.0))):
            screen_id = store.create_screen(protocol_id=protocol_id, submitter="alice")
            attempt = store.start_attempt(screen_id=screen_id, worker="w", node="node-1", gpu_name="NVIDIA H200",
                                          gpu_index=0, machine_id=h200, source_freeze={}, archive_path="a.zip")
            store.put_episodes(attempt.id, [episode(0, "dense-stream", energy=dense_j),
                                            episode(1, "packet", h2d=packet_bytes, energy=packet_j),
                                            episode(2, "dense-stream", energy=dense_j),
                                            episode(3, "packet", ok=packet_ok, energy=packet_j)])
            store.put_verdicts(attempt.id, [verdict("faithfulness", "dense-stream", True),
                                            verdict("faithfulness", "packet", packet_ok),
                                            verdict("acquisition", "packet", True, packet_bytes / 1000)])
            store.finish_attempt(attempt.id, status="done", archive_sha256="e" * 64)
        store.create_screen(protocol_id=tiny, submitter="bob")


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("query") / "packbench.db"
    seed(f"sqlite:///{path}")
    return path


def invoke(db: Path, *args: str):
    result = CliRunner().invoke(app, [*args, "--db", f"sqlite:///{db}"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result


# -- formats (in-process) ----------------------------------------------------------------------


def test_results_screen_view_is_unchanged(db):
    """`results --screen N --json` keeps the summary shape `submit --json` prints."""
    summary = json.loads(invoke(db, "results", "--screen", "2", "--json").stdout)
    assert set(summary) == {"screen_id", "status", "protocol", "protocol_sha256", "attempt", "archive_path",
                            "archive_sha256", "error", "audit", "verdicts", "episodes", "spread", "fidelity_caveat"}
    assert summary["screen_id"] == 2 and [e["index"] for e in summary["episodes"]] == [0, 1, 2, 3]
    assert set(summary["episodes"][0]) == {"index", "condition", "tier", "role", "prompt", "status", "tokens",
                                           "h2d_bytes", "d2h_bytes", "wall_s"}  # tier: exact or approximate
    failed = [e for e in summary["episodes"] if e["status"] == "failed"]
    assert [e["error"] for e in failed] == ["boom"]  # a failed episode says why, beside its row
    assert "boom" in invoke(db, "results", "--screen", "2").stdout
    assert json.loads(invoke(db, "results", "--json").stdout)["screen_id"] == 3  # default: latest
    assert invoke(db, "results", "--screen", "1").stdout.startswith("screen 1 (quickstart, done)")


def test_results_of_a_screen_give_each_conditions_wall_spread(db):
    """`results --screen N`: per condition n, median, p10 and p90 of the scored ok walls, beside the
    episodes (table and JSON), so no wall is read alone."""
    from packbench.core.dispersion import spread

    summary = json.loads(invoke(db, "results", "--screen", "2", "--json").stdout)
    by = {r["condition"]: r for r in summary["spread"]}
    assert list(by) == ["dense-stream", "packet"]
    for c, r in by.items():
        walls = [e["wall_s"] for e in summary["episodes"] if e["condition"] == c and e["status"] == "ok"
                 and e["role"] == "scored"]
        tier = next(e["tier"] for e in summary["episodes"] if e["condition"] == c)
        assert r == {"condition": c, "tier": tier, **spread(walls)} and r["n"] == len(walls)
    assert by["packet"]["n"] == 1  # its failed episode is not a wall to judge by
    out = invoke(db, "results", "--screen", "2").stdout
    assert "episode wall per condition (scored ok episodes, seconds)" in out and "p90_over_p10" in out


def test_results_listing_json_filters(db):
    rows = json.loads(invoke(db, "results", "--dtype", "float16", "--condition", "packet", "--format", "json").stdout)
    assert [(r["screen_id"], r["plan_index"], r["status"], r["model"]) for r in rows] == [
        (2, 1, "ok", "/models/opt-1.3b"), (2, 3, "failed", "/models/opt-1.3b")]
    assert "gate" not in rows[0] and rows[0]["started_at"].endswith("+00:00")
    # --json is --format json; --screen narrows a listing.
    assert len(json.loads(invoke(db, "results", "--screen", "1", "--status", "ok", "--json").stdout)) == 4
    failed = json.loads(invoke(db, "results", "--gate", "faithfulness", "--failed", "--json").stdout)
    assert [(r["screen_id"], r["condition"], r["passed"]) for r in failed] == [(2, "packet", False)] * 2
    assert json.loads(invoke(db, "results", "--protocol", "nothing", "--json").stdout) == []


def test_results_listing_csv_and_table(db):
    text = invoke(db, "results", "--gate", "acquisition", "--machine", "h200", "--format", "csv").stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 4 and {r["gate"] for r in rows} == {"acquisition"}
    assert [r["value"] for r in rows] == ["0.3", "0.3", "0.6", "0.6"]
    assert rows[0]["peak_sampled_bytes"] == "" and rows[0]["h2d_bytes"] == "300"
    table = invoke(db, "results", "--protocol", "ab", "--since", "2000-01-01").stdout.splitlines()
    assert table[0].split()[:3] == ["screen_id", "attempt", "protocol"] and len(table) == 5
    assert invoke(db, "results", "--until", "2000-01-01").stdout.strip() == "no episodes match"


def test_results_limit_says_more_matched(db):
    result = invoke(db, "results", "--limit", "3", "--json")
    assert len(json.loads(result.stdout)) == 3
    assert "--limit 0" in result.stderr
    result = invoke(db, "results", "--limit", "0", "--json")
    assert len(json.loads(result.stdout)) == 8 and result.stderr == ""
    # Exactly the limit matched: nothing more to say (catches the planted bug "results --limit:
    # the note printed when exactly the limit matched"); one fewer, and more matched.
    result = invoke(db, "results", "--limit", "8", "--json")
    assert len(json.loads(result.stdout)) == 8 and result.stderr == ""
    assert "--limit 0" in invoke(db, "results", "--limit", "7", "--json").stderr


def test_screens_list_and_show(db):
    listed = json.loads(invoke(db, "screens", "list", "--json").stdout)
    assert [(s["id"], s["status"], s["attempts"], s["passed"], s["failed"]) for s in listed] == [
        (3, "queued", 0, 0, 0), (2, "done", 1, 2, 1), (1, "done", 1, 3, 0)]
    table = invoke(db, "screens", "list", "--status", "done").stdout.splitlines()
    assert table[0].split() == ["id", "protocol", "protocol_sha256", "status", "created_at", "attempts", "latest",
                                "passed", "failed"]
    assert [line.split()[0] for line in table[1:]] == ["2", "1"]
    shown = json.loads(invoke(db, "screens", "show", "2", "--json").stdout)
    [attempt] = shown["attempts"]
    assert (attempt["attempt"]["status"], attempt["episodes"], attempt["failed_episodes"]) == ("done", 4, 1)
    assert [v["passed"] for v in attempt["verdicts"]] == [True, True, False]
    # The seeded attempts name archives this machine does not have: the time section says so.
    assert shown["time"][0]["note"].startswith("archive not readable here") and shown["time"][0]["load"] is None
    text = invoke(db, "screens", "show", "2").stdout
    assert "big" in text and "FAIL" in text and "none; run `packbench audit`" in text
    assert "no attempts yet" in invoke(db, "screens", "show", "latest").stdout


def test_screens_list_says_which_attempt_its_verdicts_are_of(tmp_path):
    """Bug caught: `screens list` showed "passed 0, failed 0" for a screen whose latest attempt was
    running or had died (it stored no verdicts), which reads as "no gate failed", and never said
    which attempt the counts were of: an earlier attempt's failed verdict was hidden behind zeros."""
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()
        protocol = store.put_protocol(sha256="ab" * 32, name="quickstart",
                                      canonical_json=body("quickstart", "models/tiny", "float32"))
        machine = store.put_machine(host="box-a", gpu_name=None, driver=None, torch="2.11", cuda=None)
        screen = store.create_screen(protocol_id=protocol, submitter="alice", max_attempts=3)
        for number in (1, 2):
            attempt = store.start_attempt(screen_id=screen, worker="w", node="n", gpu_name="cpu", gpu_index=0,
                                          machine_id=machine, source_freeze={}, archive_path=f"{number}.zip")
            if number == 1:
                store.put_verdicts(attempt.id, [verdict("faithfulness", "packet", False)])
                store.finish_attempt(attempt.id, status="failed", error="every episode failed")
                store.retry_screen(screen)
        store.finish_attempt(attempt.id, status="interrupted", error="worker died", requeue=True)
    table = invoke(tmp_path / "pb.db", "screens", "list").stdout.splitlines()
    assert table[1].split()[-3:] == ["interrupted", "-", "-"], table
    [row] = json.loads(invoke(tmp_path / "pb.db", "screens", "list", "--json").stdout)
    assert (row["attempts"], row["latest_status"], row["passed"], row["failed"]) == (2, "interrupted", 0, 0)
    assert "its latest attempt's status (`latest`)" in " ".join(invoke(tmp_path / "pb.db", "screens", "list",
                                                                         "--help").stdout.split())


def test_screens_list_csv_header_is_the_same_with_and_without_rows(tmp_path, db):
    """Bug caught: `screens list --format csv` with no screen wrote the table's header (`latest`,
    no `submitter`), with screens the rows' (`latest_status`, `submitter`): a script reading the
    header found a column named differently when nothing matched."""
    empty = tmp_path / "empty.db"
    with Store(f"sqlite:///{empty}") as store:
        store.upgrade()
    header = invoke(db, "screens", "list", "--format", "csv").stdout.splitlines()[0]
    assert invoke(empty, "screens", "list", "--format", "csv").stdout.splitlines() == [header]
    assert "latest_status" in header.split(",")
    filtered = invoke(db, "screens", "list", "--status", "cancelled", "--format", "csv").stdout.splitlines()
    assert filtered == [header]


def test_compare(db):
    c = json.loads(invoke(db, "compare", "1", "2", "--json").stdout)
    h2d = {m["condition"]: m for m in c["metrics"] if m["metric"] == "h2d_bytes"}
    # Totals over ok scored episodes: screen 2's failed packet episode adds nothing and is counted.
    assert (h2d["packet"]["a"], h2d["packet"]["b"]) == (1300, 600)
    assert h2d["packet"]["ratio"] == pytest.approx(600 / 1300)
    failed = {m["condition"]: (m["a"], m["b"]) for m in c["metrics"] if m["metric"] == "failed"}
    assert failed == {"dense-stream": (0, 0), "packet": (0, 1)}
    assert (h2d["dense-stream"]["a"], h2d["dense-stream"]["ratio"]) == (2000, 1.0)
    faith = [v for v in c["verdicts"] if v["gate"] == "faithfulness" and v["condition"] == "packet"]
    assert [(v["a_passed"], v["b_passed"]) for v in faith] == [(True, False)]
    text = invoke(db, "compare", "1", "2").stdout
    assert "A: screen 1 (quickstart" in text and "B/A" in text and "FAIL" in text


def test_format_options_are_checked(db):
    for args in (["--format", "xml"], ["--format", "csv", "--json"], ["--limit", "-1"]):
        with pytest.raises(PackbenchError):
            invoke(db, "results", *args)
    for command in (["status"], ["compare", "1", "2"]):
        with pytest.raises(PackbenchError, match="unknown --format 'xml'"):
            invoke(db, *command, "--format", "xml")
        with pytest.raises(PackbenchError, match="--json and --format csv disagree"):
            invoke(db, *command, "--format", "csv", "--json")


# -- energy, --gate, formats of compare and status -----------------------------------------------


def test_results_show_filter_and_sort_by_energy(db):
    rows = json.loads(invoke(db, "results", "--sort", "energy_j", "--desc", "--json").stdout)
    # Largest first; the failed episodes (no reading) last, in the usual order.
    assert [r["energy_j"] for r in rows] == [40.0, 40.0, 30.0, 30.0, 12.0, 10.0, 10.0, None]
    assert [(r["screen_id"], r["plan_index"]) for r in rows][-1] == (2, 3)
    ascending = json.loads(invoke(db, "results", "--sort", "energy_j", "--limit", "0", "--json").stdout)
    assert [r["energy_j"] for r in ascending][:3] == [10.0, 10.0, 12.0]
    band = json.loads(invoke(db, "results", "--min-energy", "11", "--max-energy", "35", "--json").stdout)
    assert sorted((r["screen_id"], r["condition"], r["energy_j"]) for r in band) == [
        (1, "dense-stream", 30.0), (1, "dense-stream", 30.0), (2, "packet", 12.0)]
    table = invoke(db, "results", "--screen", "2", "--status", "ok").stdout.splitlines()
    assert table[0].split()[-1] == "energy_j" and table[1].split()[-1] == "40"
    rows = list(csv.DictReader(io.StringIO(invoke(db, "results", "--screen", "2", "--format", "csv").stdout)))
    assert [r["energy_j"] for r in rows] == ["40.0", "12.0", "40.0", ""]


@pytest.mark.parametrize(("args", "message"), [
    (["--min-energy", "5", "--max-energy", "2"], "--min-energy 5.0 J is above --max-energy 2.0 J; swap them"),
    (["--max-energy", "-1"], "--max-energy -1.0 is not a finite number of joules >= 0"),
    (["--sort", "speed"], "unknown sort column 'speed'; use one of energy_j, wall_s"),
    (["--desc"], "give --sort too"),
    (["--phase", "decode"], "give --gate too"),
    (["--gate", "runtime", "--phase", "warm"], "unknown phase 'warm'; use one of all, prefill, decode"),
])
def test_results_energy_and_sort_options_are_checked(db, args, message):
    with pytest.raises(PackbenchError, match=re.escape(message)):
        invoke(db, "results", *args)


@pytest.fixture()
def phased(stored) -> Path:
    """Screen 4: warmups and scored episodes; acquisition gated per phase over the scored
    episodes (prefill passed, decode failed), faithfulness over every episode, warmups too."""
    with Store(f"sqlite:///{stored}") as store:
        protocol_id = store.put_protocol(sha256="ef" * 32, name="phased",
                                         canonical_json=body("phased", "models/tiny", "float32"))
        screen_id = store.create_screen(protocol_id=protocol_id, submitter="dana")
        attempt = store.start_attempt(screen_id=screen_id, worker="w", node="node-1", gpu_name="NVIDIA H200",
                                      gpu_index=0, machine_id=None, source_freeze={}, archive_path="b.zip")
        store.put_episodes(attempt.id, [episode(0, "dense-stream", role="warmup"), episode(1, "packet", role="warmup"),
                                        *[episode(i, ("dense-stream", "packet")[i % 2]) for i in range(2, 6)]])
        judged = {"threshold": 0.5, "interval": None, "detail": ""}
        store.put_verdicts(attempt.id, [
            {**judged, "gate": "acquisition", "condition": "packet", "phase": "prefill", "passed": True,
             "value": 0.4, "episodes": [2, 3, 4, 5]},
            {**judged, "gate": "acquisition", "condition": "packet", "phase": "decode", "passed": False,
             "value": 0.6, "episodes": [2, 3, 4, 5]},
            {**judged, "gate": "faithfulness", "condition": "packet", "phase": "all", "passed": True,
             "value": 0.0, "episodes": [0, 1, 2, 3, 4, 5]}])
        store.finish_attempt(attempt.id, status="done", archive_sha256="a" * 64)
    assert screen_id == 4
    return stored


def test_results_gate_lists_each_judged_episode_once(phased):
    rows = json.loads(invoke(phased, "results", "--screen", "4", "--gate", "acquisition", "--json").stdout)
    # Not the warmup (plan index 1), not once per phase: the phases fold, and pass only together.
    assert [(r["plan_index"], r["role"], r["phase"], r["passed"], r["value"]) for r in rows] == [
        (3, "scored", "prefill+decode", False, None), (5, "scored", "prefill+decode", False, None)]
    decode = json.loads(invoke(phased, "results", "--screen", "4", "--gate", "acquisition", "--phase", "decode",
                               "--failed", "--json").stdout)
    assert [(r["plan_index"], r["phase"], r["value"], r["threshold"]) for r in decode] == [
        (3, "decode", 0.6, 0.5), (5, "decode", 0.6, 0.5)]
    assert json.loads(invoke(phased, "results", "--screen", "4", "--gate", "acquisition", "--passed",
                             "--json").stdout) == []
    # Exactness includes warmups: the faithfulness verdict judged the packet warmup, so it carries it.
    faithful = json.loads(invoke(phased, "results", "--screen", "4", "--gate", "faithfulness", "--json").stdout)
    assert [(r["plan_index"], r["role"], r["passed"]) for r in faithful] == [
        (1, "warmup", True), (3, "scored", True), (5, "scored", True)]
    text = invoke(phased, "results", "--screen", "4", "--gate", "acquisition", "--limit", "1").stdout.splitlines()
    assert len(text) == 2 and text[1].split()[-5:] == ["acquisition", "prefill+decode", "FAIL", "-", "-"]


def test_compare_shows_energy_and_takes_every_format(db):
    c = json.loads(invoke(db, "compare", "1", "2", "--format", "json").stdout)
    assert c == json.loads(invoke(db, "compare", "1", "2", "--json").stdout)
    energy = {(m["condition"], m["metric"]): (m["a"], m["b"], m["ratio"]) for m in c["metrics"]
              if m["metric"].startswith("energy")}
    # Over ok scored episodes with a reading, 2 generated tokens each: screen 2's failed packet
    # episode adds nothing.
    assert energy[("packet", "energy_j_per_episode")] == (10.0, 12.0, pytest.approx(1.2))
    assert energy[("packet", "energy_j_per_token")] == (5.0, 6.0, pytest.approx(1.2))
    assert energy[("dense-stream", "energy_j_per_token")] == (15.0, 20.0, pytest.approx(20 / 15))
    rows = list(csv.DictReader(io.StringIO(invoke(db, "compare", "1", "2", "--format", "csv").stdout)))
    spread_title = next(r["section"] for r in rows if r["section"].startswith("episode wall spread"))
    assert {r["section"] for r in rows} == {"verdicts", spread_title, next(r["section"] for r in rows if r["metric"])}
    per_token = [r for r in rows if r["metric"] == "energy_j_per_token" and r["condition"] == "packet"]
    assert [(r["a"], r["b"]) for r in per_token] == [("5.0", "6.0")]
    faith = [r for r in rows if r["gate"] == "faithfulness" and r["condition"] == "packet"]
    assert [(r["a_passed"], r["b_passed"]) for r in faith] == [("True", "False")]
    text = invoke(db, "compare", "1", "2").stdout
    assert "energy_j_per_token" in text and "with an NVML reading" in text


def test_an_unknown_condition_gets_the_nearest_name(db):
    out = invoke(db, "results", "--condition", "pakcet").stdout.strip()
    assert out == ("no episodes match: no episode has condition 'pakcet'; did you mean --condition packet? "
                   "(conditions: dense-stream, packet)")
    as_json = invoke(db, "results", "--condition", "pakcet", "--json")
    assert json.loads(as_json.stdout) == [] and "did you mean --condition packet?" in as_json.stderr


def test_compare_gives_each_conditions_spread_and_flags_a_ratio_within_noise(db):
    c = json.loads(invoke(db, "compare", "1", "2", "--json").stdout)
    spread = {r["condition"]: r for r in c["spread"]}
    # Every wall is 1 s: dense-stream's B/A interval is [1, 1], within noise; screen 2's packet
    # has one finished scored episode, too few to judge.
    assert (spread["dense-stream"]["a_n"], spread["dense-stream"]["b_n"]) == (2, 2)
    assert (spread["dense-stream"]["ratio_lo"], spread["dense-stream"]["ratio_hi"]) == (1.0, 1.0)
    assert spread["dense-stream"]["noise"] == "within noise" and spread["packet"]["noise"] == "too few episodes"
    result = invoke(db, "compare", "1", "2")
    assert "warning: condition dense-stream: wall B/A 1 is within noise" in result.stderr
    assert "warning: condition packet" not in result.stderr


def test_verdicts_carry_their_interval_and_detail(tmp_path):
    url = f"sqlite:///{tmp_path / 'packbench.db'}"
    seed(url)
    runtime = {**verdict("runtime", "packet", False, 0.995228), "threshold": 1.0, "interval": [0.4496, 2.493],
               "detail": "0.95 bootstrap upper bound 2.493 > 1.0"}
    with Store(url) as store:
        store.put_verdicts(store.latest_attempt(1).id, [runtime])
    summary = json.loads(invoke(tmp_path / "packbench.db", "results", "--screen", "1", "--json").stdout)
    [v] = [v for v in summary["verdicts"] if v["gate"] == "runtime"]
    assert (v["interval_lo"], v["interval_hi"], v["detail"]) == (0.4496, 2.493, runtime["detail"])
    text = invoke(tmp_path / "packbench.db", "results", "--screen", "1").stdout
    line = next(line for line in text.splitlines() if line.startswith("runtime"))
    assert line.split() == ["runtime", "packet", "all", "FAIL", "0.995228", "[0.4496,", "2.493]", "<=", "1",
                            "upper", "bound", "2.493", ">", "1"]
    assert "  runtime packet all: 0.95 bootstrap upper bound 2.493 > 1.0" in text
    c = json.loads(invoke(tmp_path / "packbench.db", "compare", "1", "2", "--json").stdout)
    [pair] = [p for p in c["verdicts"] if p["gate"] == "runtime"]
    assert (pair["a_interval_lo"], pair["a_interval_hi"], pair["a_detail"], pair["b_passed"]) == (
        0.4496, 2.493, runtime["detail"], None)
    assert "FAIL 0.995228 [0.4496, 2.493]" in invoke(tmp_path / "packbench.db", "compare", "1", "2").stdout


def test_status_takes_every_format_and_json_is_pure(queue_db):
    url = f"sqlite:///{queue_db}"
    with Store(url) as store:
        d = store.register_dispatcher("d1", "box-a", pid=7)
        store.claim_screen(d, lease_s=600, archive_dir="archives", source_freeze={}, worker="w0", node="node-1",
                           gpu_name="NVIDIA H200", gpu_index=2, model_state="cold")
        store.heartbeat(d, [{"name": "w0", "node": "node-1", "state": "busy", "screen_id": 3}])
    result = invoke(queue_db, "status", "--format", "json")
    st = json.loads(result.stdout)  # the whole of stdout parses: no progress or notes in it
    assert result.stderr == "" and st["counts"]["running"] == 1 and st["running"][0]["screen_id"] == 3
    assert st == {**json.loads(invoke(queue_db, "status", "--json").stdout), "now": st["now"]}
    rows = list(csv.DictReader(io.StringIO(invoke(queue_db, "status", "--format", "csv").stdout)))
    counts = {r["state"]: r["screens"] for r in rows if r["section"] == "screens"}
    assert counts == {"queued": "0", "running": "1", "done": "2", "failed": "0", "cancelled": "0"}
    [running] = [r for r in rows if r["section"] == "running"]
    assert (running["screen_id"], running["gpu_index"], running["dispatcher"]) == ("3", "2", "d1")
    [dispatcher] = [r for r in rows if r["section"] == "dispatchers"]
    assert json.loads(dispatcher["workers"])[0]["state"] == "busy"
    assert "0 queued, 1 running, 2 done" in invoke(queue_db, "status", "--format", "table").stdout


# -- the command line: refusal and bad input ----------------------------------------------------


@pytest.fixture
def pb(packbench_cli):
    """`packbench ARGS` against `url`, in `cwd`, in this process."""
    return lambda *args, url, cwd: packbench_cli(*args, env={"PACKBENCH_DB_URL": url}, cwd=cwd)


def assert_one_line_error(r, *fragments: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def row_counts(path: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        return {t: connection.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}


def test_old_schema_is_refused_by_every_command_but_db(tmp_path, pb):
    path = tmp_path / "old.db"
    url = f"sqlite:///{path}"
    with Store(url) as store:
        store.upgrade("0001_initial")
    head = Store.head()
    commands = (["results"], ["results", "--gate", "runtime"], ["screens", "list"], ["screens", "show", "1"],
                ["compare", "1", "2"], ["audit", "latest"], ["dispatch"], ["submit", "protocol.yaml"])
    for args in commands:
        message = assert_one_line_error(pb(*args, url=url, cwd=tmp_path), "`packbench db upgrade`", head)
        assert "0001_initial" in message, (args, message)
    current = pb("db", "current", url=url, cwd=tmp_path)
    assert current.returncode == 0 and "0001_initial" in current.stdout and "packbench db upgrade" in current.stdout
    assert pb("db", "history", url=url, cwd=tmp_path).stdout.startswith(f"{head}:")
    assert pb("db", "upgrade", url=url, cwd=tmp_path).returncode == 0
    assert pb("screens", "list", url=url, cwd=tmp_path).stdout.startswith("no screens")


@pytest.fixture()
def stored(db, tmp_path) -> Path:
    """A private copy of the seeded database, whose rows must survive every bad command."""
    path = tmp_path / "stored.db"
    with sqlite3.connect(db) as source, sqlite3.connect(path) as copy:
        source.backup(copy)
    return path


@pytest.mark.parametrize(
    ("case", "args", "fragments"),
    [
        ("unreachable", ["results", "--protocol", "big"], ["127.0.0.1:1", "connection refused", "PACKBENCH_DB_URL"]),
        ("no such role", ["screens", "list"], ['role "nosuchuser" does not exist', "PACKBENCH_DB_URL"]),
        ("no such database", ["results"], ['database "pb_no_such_db" does not exist', "createdb pb_no_such_db"]),
        ("scheme", ["results"], ["unsupported database URL scheme 'mysql'", "PACKBENCH_DB_URL"]),
        ("unknown gate", ["results", "--gate", "speed"], ["unknown gate 'speed'", *GATES]),
        ("unknown status", ["results", "--status", "done"], ["unknown episode status 'done'", "ok, failed"]),
        ("bad date", ["results", "--since", "last week"], ["--since 'last week' is not an ISO date"]),
        ("unknown screen", ["screens", "show", "42"], ["no screen with id 42", "packbench screens list"]),
    ],
)
def test_bad_input_is_one_line_and_loses_nothing(stored, tmp_path, case, args, fragments, pb):
    urls = {
        "unreachable": "postgresql+psycopg://postgres@127.0.0.1:1/test",
        # Trust auth lets any existing role in without a password; a missing role or
        # database is still refused by the server.
        "no such role": "postgresql+psycopg://nosuchuser@127.0.0.1:5432/test",
        "no such database": "postgresql+psycopg://postgres@127.0.0.1:5432/pb_no_such_db",
        "scheme": "mysql://u@db.example/packbench",
    }
    if case in ("no such role", "no such database") and not os.environ.get(PG_ENV):
        pytest.skip(f"{PG_ENV} is not set: no PostgreSQL server to ask")
    before = row_counts(stored)
    assert_one_line_error(pb(*args, url=urls.get(case, f"sqlite:///{stored}"), cwd=tmp_path), *fragments)
    assert row_counts(stored) == before


def test_read_only_sqlite(stored, tmp_path, tiny, pb):
    """Reading a read-only file works; writing (a migration, a submit) fails in one line."""
    read_only = f"sqlite:///file:{stored}?mode=ro&uri=true"
    before = row_counts(stored)
    assert pb("results", "--json", url=read_only, cwd=tmp_path).returncode == 0
    protocol = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    protocol["model"]["path"] = str(tiny)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(protocol))
    assert_one_line_error(pb("submit", "p.yaml", url=read_only, cwd=tmp_path), "read-only", "writable")
    assert row_counts(stored) == before

    old = tmp_path / "old.db"
    with Store(f"sqlite:///{old}") as store:
        store.upgrade("0001_initial")
    assert_one_line_error(pb("db", "upgrade", url=f"sqlite:///file:{old}?mode=ro&uri=true", cwd=tmp_path),
                          "read-only", "writable")
    with Store(f"sqlite:///{old}") as store:
        assert store.current() == "0001_initial"


@contextmanager
def pg_schema(base: str):
    """A fresh schema on the test server, dropped afterwards (as tests/db/conftest.py does)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    schema = f"pb_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, poolclass=NullPool)
    with admin.begin() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.begin() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def test_postgresql_gives_the_same_listing(db, tmp_path, pb):
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set")
    args = ["results", "--gate", "faithfulness", "--failed", "--json"]
    expected = json.loads(pb(*args, url=f"sqlite:///{db}", cwd=tmp_path).stdout)
    with pg_schema(base) as url:
        seed(url)
        r = pb(*args, url=url, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
    drop = ("started_at",)  # set at insert time
    assert [{k: v for k, v in row.items() if k not in drop} for row in got] == [
        {k: v for k, v in row.items() if k not in drop} for row in expected]


# -- the queue: screens cancel|retry, status ----------------------------------------------------


@pytest.fixture()
def queue_db(db, tmp_path) -> Path:
    """A private copy of the seeded database with a dispatcher running screen 3."""
    path = tmp_path / "queue.db"
    with sqlite3.connect(db) as source, sqlite3.connect(path) as copy:
        source.backup(copy)
    return path


def test_status_cancel_and_retry(queue_db):
    url = f"sqlite:///{queue_db}"
    with Store(url) as store:
        d = store.register_dispatcher("d1", "box-a", pid=7)
        claim = store.claim_screen(d, lease_s=600, archive_dir="archives", source_freeze={}, worker="w0",
                                   node="node-1", gpu_name="NVIDIA H200", gpu_index=2, model_state="cold")
        store.heartbeat(d, [{"name": "w0", "node": "node-1", "gpu": "NVIDIA H200", "gpu_index": 2, "state": "busy",
                             "screen_id": claim.screen.id},
                            {"name": "w1", "node": "node-1", "gpu": "NVIDIA H200", "gpu_index": 3, "state": "idle"}])
        waiting = store.create_screen(protocol_id=claim.protocol.id, submitter="carol", priority=3, gpu_type="B200")
        store.set_unplaceable(waiting, "no B200 worker in the cluster")
    st = json.loads(invoke(queue_db, "status", "--json").stdout)
    assert st["counts"] == {"queued": 1, "running": 1, "done": 2, "failed": 0, "cancelled": 0}
    [r] = st["running"]
    assert (r["screen_id"], r["node"], r["gpu_index"], r["dispatcher"], r["episodes_done"]) == (3, "node-1", 2, "d1", 0)
    assert st["queued"][0]["unplaceable_reason"] == "no B200 worker in the cluster"
    assert [(x["name"], x["live"]) for x in st["dispatchers"]] == [("d1", True)]
    assert (st["idle_workers"], st["busy_workers"]) == (1, 1)
    text = invoke(queue_db, "status").stdout
    assert "1 queued, 1 running, 2 done" in text and "no B200 worker" in text and "1 idle, 1 busy" in text

    assert "stops after the episode in flight" in invoke(queue_db, "screens", "cancel", "3").stdout
    assert json.loads(invoke(queue_db, "status", "--json").stdout)["running"][0]["cancel_requested"] is True
    cancelled = json.loads(invoke(queue_db, "screens", "cancel", str(waiting), "--json").stdout)
    assert cancelled["status"] == "cancelled"
    assert "queued again" in invoke(queue_db, "screens", "retry", str(waiting)).stdout
    with Store(url) as store:
        assert store.screen(waiting).status == "queued"
        store.finish_attempt(claim.attempt.id, status="cancelled")
    with pytest.raises(PackbenchError, match="only a failed or cancelled screen"):
        invoke(queue_db, "screens", "retry", "1")  # done
    with pytest.raises(PackbenchError, match="already cancelled"):
        invoke(queue_db, "screens", "cancel", "3")


# -- tiers and fidelity ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> Path:
    """Two screens of one protocol: dense-stream (exact) and int8 (quantized, approximate), the
    int8 episodes with fidelity figures (screen 2's worse)."""
    path = tmp_path_factory.mktemp("tiers") / "packbench.db"
    conditions = [{"name": "dense-stream", "policy": "dense-stream", "params": {}},
                  {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}}]
    canonical = json.dumps({"name": "q", "model": {"path": "m"}, "dtype": "float16", "conditions": conditions})
    with Store(f"sqlite:///{path}") as store:
        store.upgrade()
        pid = store.put_protocol(sha256="ef" * 32, name="q", canonical_json=canonical)
        box = store.put_machine(host="box", gpu_name="", driver="", torch="2.13", cuda="")
        for kl, top1, step in ((0.001, 1.0, None), (0.004, 0.75, 3)):
            attempt = store.start_attempt(screen_id=store.create_screen(protocol_id=pid, submitter="a"), worker="w",
                                          node="n", gpu_name="cpu", gpu_index=0, machine_id=box,
                                          source_freeze={}, archive_path="a.zip")
            fid = {"mean_kl": kl, "p99_kl": 2 * kl, "top1": top1, "max_abs_logit": 0.5, "divergence_step": step}
            # The first int8 episode agrees a little more often: the compared top-1 is the worst one's.
            store.put_episodes(attempt.id, [episode(0, "dense-stream"),
                                            {**episode(1, "int8", h2d=0), "fidelity": {**fid, "top1": min(1.0, top1 + 0.125)}},
                                            episode(2, "dense-stream"),
                                            {**episode(3, "int8", h2d=0), "fidelity": {**fid, "mean_kl": kl / 2}}])
            store.finish_attempt(attempt.id, status="done", archive_sha256="e" * 64)
    return path


def test_results_label_every_row_with_its_tier_and_show_fidelity(tiered, db):
    rows = json.loads(invoke(tiered, "results", "--screen", "1", "--format", "json").stdout)
    assert [(r["condition"], r["tier"], r["fidelity_mean_kl"]) for r in rows] == [
        ("dense-stream", "exact", None), ("int8", "approximate", 0.001), ("dense-stream", "exact", None),
        ("int8", "approximate", 0.0005)]
    header = invoke(tiered, "results", "--sort", "wall_s").stdout.splitlines()[0].split()
    assert header[header.index("condition") + 1] == "tier" and "fidelity_top1" in header
    assert "fidelity_top1" not in invoke(db, "results").stdout  # exact-only rows: no fidelity columns
    view = invoke(tiered, "results", "--screen", "2").stdout
    assert re.search(r"3\s+int8\s+approximate\s+scored.*0\.002\s+0\.008\s+0\.75\s+0\.5\s+3", view), view


def test_compare_labels_tiers_and_compares_fidelity(tiered):
    out = json.loads(invoke(tiered, "compare", "1", "2", "--json").stdout)
    metrics = {(m["condition"], m["metric"]): m for m in out["metrics"]}
    assert {m["tier"] for m in out["metrics"] if m["condition"] == "int8"} == {"approximate"}
    assert {m["tier"] for m in out["metrics"] if m["condition"] == "dense-stream"} == {"exact"}
    kl = metrics["int8", "fidelity_mean_kl_max"]
    assert (kl["a"], kl["b"]) == (0.001, 0.004) and kl["ratio"] == pytest.approx(4.0)
    assert metrics["int8", "fidelity_mean_kl_mean"]["a"] == pytest.approx(0.00075)
    # The worst scored episode's top-1 (0.75, not screen 2's other 0.875): catches the planted bug
    # "compare: the best top-1 shown, not the worst".
    assert (metrics["int8", "fidelity_top1_min"]["b"], metrics["int8", "fidelity_divergence_step_min"]["b"]) == (0.75, 3)
    assert metrics["int8", "fidelity_divergence_step_min"]["a"] is None  # never diverged
    assert not any(m.startswith("fidelity") for c, m in metrics if c == "dense-stream")
    table = invoke(tiered, "compare", "1", "2").stdout
    assert re.search(r"int8\s+approximate\s+fidelity_top1_min\s+1\s+0\.75", table), table


@pytest.fixture(scope="module")
def archived(tmp_path_factory) -> Path:
    """Two screens whose attempts point at a real archive (tests/data/gates-v2.zip): 18 recorded
    episodes of four exact conditions with their call ledgers."""
    import shutil

    root = tmp_path_factory.mktemp("archived")
    zips = [shutil.copy(ROOT / "tests" / "data" / "gates-v2.zip", root / f"s{i}.zip") for i in (1, 2)]
    path = root / "packbench.db"
    with Store(f"sqlite:///{path}") as store:
        store.upgrade()
        proto = store.put_protocol(sha256="ef" * 32, name="gates-v2", canonical_json=body("gates-v2", "tiny", "float32"))
        machine = store.put_machine(host="box-a", gpu_name="cpu", driver="", torch="2.13", cuda="")
        for z in zips:
            screen_id = store.create_screen(protocol_id=proto, submitter="alice")
            attempt = store.start_attempt(screen_id=screen_id, worker="w", node="node-1", gpu_name="cpu",
                                          gpu_index=0, machine_id=machine, source_freeze={}, archive_path=str(z))
            store.put_episodes(attempt.id, [episode(0, "dense-stream"), episode(1, "packet")])
            store.finish_attempt(attempt.id, status="done", archive_sha256="e" * 64)
    return path


def test_results_show_serving_figures_runtime_ratios_and_the_position_check_from_the_archive(archived):
    """Issue 43: TTFT, TPOT, ITL percentiles, decode tokens/s and the wall outside the calls, the
    median ratio beside the summed-walls gate, and the plan-position check, in the table and in
    --json, computed from the archive's ledgers (the same functions as the report's)."""
    from packbench.core.report import read_screen
    from packbench.core.serving import episode_serving

    summary = json.loads(invoke(archived, "results", "--screen", "1", "--json").stdout)
    rows = {r["condition"]: r for r in summary["serving"]}
    assert list(rows) == ["dense-stream", "packet", "phase-switched", "extents"]
    screen = read_screen(ROOT / "tests" / "data" / "gates-v2.zip")
    packet = [e.record for e in screen.of("packet")]
    ttft = sorted(r["calls"][0]["wall_s"] for r in packet)
    assert rows["packet"]["ttft_s"] == pytest.approx((ttft[1] + ttft[2]) / 2)  # median of 4 by hand
    tpots = sorted((r["wall_s"] - r["calls"][0]["wall_s"]) / (len(r["calls"]) - 1) for r in packet)
    assert rows["packet"]["tpot_s"] == pytest.approx((tpots[1] + tpots[2]) / 2)
    assert rows["packet"]["tier"] == "exact" and rows["packet"]["episodes"] == 4
    assert [episode_serving(r)["ttft_s"] for r in packet] == [r["calls"][0]["wall_s"] for r in packet]
    ratios = {r["condition"]: r for r in summary["runtime_ratios"]}
    assert set(ratios) == {"packet", "phase-switched", "extents"} and ratios["extents"]["control"] == "dense-stream"
    assert summary["position"]["flagged"] == [] and len(summary["position"]["positions"]) == 16
    previous = {r["condition"]: r for r in summary["steady_by_previous"]}
    assert sum(p["n"] for p in previous["packet"]["previous"]) == 4  # gates-v2 predates the record's field: the plan says
    out = invoke(archived, "results", "--screen", "1").stdout
    for text in ("TTFT (first use)", "TPOT", "ITL p50/p90/p99", "tok/s", "outside calls", "beyond 3 IQR",
                 "summed walls (gate)", "median ratio", "position check: no plan position above 2x",
                 "steady decode call by what the worker ran before"):
        assert text in out, text


def test_compare_shows_serving_figures_and_each_screens_runtime_ratios(archived):
    c = json.loads(invoke(archived, "compare", "1", "2", "--json").stdout)
    tpot = {r["condition"]: r for r in c["serving"] if r["figure"] == "tpot_s"}
    assert tpot["packet"]["B/A"] == pytest.approx(1.0) and tpot["packet"]["tier"] == "exact"
    assert {r["screen"] for r in c["runtime_ratios"]} == {"A", "B"}
    assert c["position"]["a"]["flagged"] == []
    out = invoke(archived, "compare", "1", "2").stdout
    assert "serving figures per condition" in out and "A: position check" in out
    # The table shows milliseconds and names them so; it read "tpot_s" beside a value in ms.
    line = next(x for x in out.splitlines() if x.startswith("packet") and "tpot (ms)" in x)
    assert f"{tpot['packet']['A'] * 1e3:.4g}"[:4] in line and "tpot_s" not in out, line
