"""`submit --sweep` end to end on the CPU: the quickstart over two prefix lengths, through a real
local Ray, a real SQLite database and real archives; `protocol plan --sweep`; `report --sweep`.

`submit --sweep --wait` runs in a subprocess that joins the session's Ray (tests/conftest.py
`ray_address`); the commands that only read or refuse run in this process (`packbench_cli`)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from browser import INSTALL_HINT, check_page, chromium  # tests/cli/browser.py

ROOT = Path(__file__).resolve().parents[2]
ray = pytest.mark.ray


def cli(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packbench", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny) -> Path:
    d = tmp_path_factory.mktemp("sweep")
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    (d / "protocol.yaml").write_text(yaml.safe_dump(body))
    return d


@pytest.fixture(scope="module")
def env(workdir) -> dict:
    import os

    from packbench.db.store import Store

    e = dict(os.environ, PACKBENCH_DB_URL=f"sqlite:///{workdir / 'packbench.db'}", RAY_AUTH_MODE="disabled",
             PYTHONPATH=str(ROOT))
    with Store(e["PACKBENCH_DB_URL"]) as store:
        store.upgrade()
    return e


@pytest.fixture
def pb(packbench_cli, workdir, env):
    """A read-only or refused command, in this process, in the sweep's folder and database."""
    return lambda *args: packbench_cli(*args, env={"PACKBENCH_DB_URL": env["PACKBENCH_DB_URL"]}, cwd=workdir)


@pytest.fixture(scope="module")
def sweep(workdir, env, ray_address) -> str:
    """The sweep, run on the session's Ray (tests/conftest.py `ray_address`)."""
    out = cli("submit", "protocol.yaml", "--sweep", "prefix_tokens=16,32", "--wait", "--name", "prefix-sweep",
              "--tag", "study=prefix", cwd=workdir, env={**env, "PACKBENCH_RAY_ADDRESS": ray_address})
    assert out.returncode == 0, out.stderr[-3000:]
    return re.search(r"queued sweep (sw-[0-9a-f]+)", out.stdout).group(1)


def test_plan_lists_each_point_with_its_hash_and_cost(pb):
    out = pb("protocol", "plan", "protocol.yaml", "--sweep", "prefix_tokens=16,32", "--json")
    assert out.returncode == 0, out.stderr
    points = json.loads(out.stdout)["points"]
    assert [p["prefix_tokens"] for p in points] == [16, 32]
    assert len({p["sha256"] for p in points}) == 2
    assert points[0]["h2d_bytes"] < points[1]["h2d_bytes"]  # a longer prefill moves a denser union
    table = pb("protocol", "plan", "protocol.yaml", "--sweep", "prefix_tokens=16,32")
    assert "2 points" in table.stdout and "host-to-device" in table.stdout


@ray
def test_a_sweep_runs_one_protocol_per_point_under_one_id(sweep, env, pb):
    listed = json.loads(pb("screens", "list", "--tag", "study=prefix", "--json").stdout)
    assert [s["sweep"] for s in listed] == [sweep, sweep]
    assert {s["protocol"] for s in listed} == {"quickstart[prefix_tokens=16]", "quickstart[prefix_tokens=32]"}
    assert len({s["protocol_sha256"] for s in listed}) == 2
    assert all(s["status"] == "done" and s["failed"] == 0 and s["name"] == "prefix-sweep" for s in listed)
    import packbench

    db = packbench.connect(env["PACKBENCH_DB_URL"])
    screens = sorted(db.screens(sweep=sweep), key=lambda s: s.id)
    assert [s.point for s in screens] == [{"prefix_tokens": 16}, {"prefix_tokens": 32}]
    eps = db.episodes(sweep=sweep, role="scored")
    assert len(eps) == 12 and all(e.status == "ok" for e in eps)
    rows = pb("results", "--tag", "study=prefix", "--format", "json", "--limit", "0")
    assert len(json.loads(rows.stdout)) == 16  # every episode of both screens, warmups too


@ray
def test_the_sweep_report_plots_each_figure_against_the_field(sweep, pb, tmp_path):
    page = tmp_path / "sweep.html"
    out = pb("report", "--sweep", sweep, "--out", str(page))
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    assert set(re.findall(r'data-plot="([a-z_]+)"', text)) == {"decode_ms_per_token", "bytes_per_token", "verdicts"}
    assert ">prefix_tokens<" in text  # the x axis is the swept field
    if chromium() is None:
        pytest.fail(INSTALL_HINT)
    assert "131,072" in text and "e+0" not in text  # dense-stream's bytes per token, written out
    assert text.count("<td>prefix_tokens=16</td>") == 2  # a row per point and condition
    check = check_page(page)
    assert check.console_errors == [] and len(check.plots) == 3 and check.overflowing == []
    assert all(p["width"] > 500 and p["drawn"] > 20 for p in check.plots), check.plots


def test_a_bad_sweep_queues_nothing(pb):
    before = pb("screens", "list", "--json").stdout
    for args, words in ((["--sweep", "prefix_tokens"], "is not FIELD=V1,V2"),
                        (["--sweep", "nosuch.field=1"], "protocol field `nosuch`: unknown field"),
                        (["--sweep", "prefix_tokens=16,0"], "sweep point prefix_tokens=0: protocol field"),
                        (["--sweep", "prefix_tokens=16,16"], "repeats a value"),
                        (["--sweep", "prefix_tokens=16", "--tag", "oops"], "--tag 'oops' is not KEY=VALUE"),
                        (["--sweep", "prefix_tokens=16", "--replicas", "2"], "drop --replicas/--spread")):
        out = pb("submit", "protocol.yaml", *args)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1
    assert pb("screens", "list", "--json").stdout == before
    out = pb("report", "--sweep", "sw-nope")
    assert out.returncode == 2 and "no sweep 'sw-nope'" in out.stderr


def test_report_sweep_latest_without_a_sweep_says_so(packbench_cli, tmp_path):
    """`report --sweep latest` (docs/api.md's form) on a database with screens but no sweep: one
    line naming how to queue one, exit 2; a None id passed on would have read as `no sweep None`."""
    db = {"PACKBENCH_DB_URL": f"sqlite:///{tmp_path / 'empty.db'}"}
    assert packbench_cli("db", "upgrade", env=db, cwd=tmp_path).returncode == 0
    out = packbench_cli("report", "--sweep", "latest", env=db, cwd=tmp_path)
    assert out.returncode == 2 and "there is no sweep yet" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_sweep_page_of_a_sweep_with_a_failed_point_names_it_failed():
    """A point whose screen failed has no figures for a condition the other points measured:
    `report --sweep` raised KeyError on it (exit 70) instead of drawing the points that ran and
    listing the failed one as failed."""
    from packbench.cli.sweep_page import sweep_page
    from packbench.service.sweep import SweepPoint

    ran = {"decode_ms_per_token": 2.0, "decode_ms_per_token_min": 1.5, "decode_ms_per_token_max": 2.5,
           "bytes_per_token": 1000.0}
    points = [SweepPoint(1, {"prefix_tokens": 16}, "done", "a" * 64, {"packet": ran},
                         [{"gate": "faithfulness", "condition": "packet", "phase": "all", "passed": True}]),
              SweepPoint(2, {"prefix_tokens": 32}, "failed", "b" * 64, {}, [])]
    page = sweep_page("sw-1", points)
    assert set(re.findall(r'data-plot="([a-z_]+)"', page)) == {"decode_ms_per_token", "bytes_per_token", "verdicts"}
    assert re.search(r"<td>2</td><td>prefix_tokens=32</td><td>failed</td>", page), page[-3000:]
