"""`packbench history` over three real commits of the engine, each screened for real.

A test repository is made from this tree's packages (`git init`, three commits), and the
quickstart protocol is screened from it at each commit, through a real local Ray, a real SQLite
database and real archives: the worker records the test repository's own commit
(`core/source.py`), and `history` orders the screens by it. Each commit's `dispatch` runs the
test repository's code in a subprocess and joins the module's Ray cluster, whose workers run that
code too (their PYTHONPATH, tests/local_ray.py): a worker starts at each dispatch, so it imports
the engine as committed then. `db upgrade`, `submit` and `history` run in this process
(tests/in_process.py): they read no engine code.

- commit 1: the engine as it is, plus `BASE_S` of sleep in every forward call (inside the
  call's timed region). A tiny CPU episode computes for a few milliseconds, which a busy
  2-core host multiplied by up to 60 (0.006 s against 0.4 s walls of one protocol, minutes
  apart); the sleep makes the figures the engine's own, not the neighbours'.
- commit 2: a change to the engine that does not change what it does (a comment).
- commit 3: the injected slowdown, `SLOW_S` of sleep per call instead of `BASE_S`.

Three screens at each of the first two commits (six repeats of one behaviour: no step may be
found among them) and two at the third (the step, and the run that confirms it). The worker runs
one host thread (PACKBENCH_WORKER_THREADS=1): with two on this 2-core host and another process
busy, the same commit's dense-stream walls ran 107 ms at one dispatch and 440 ms at the next
(two intra-op threads waiting on each other for a core); with one, 87.5-89.5 ms over all six
repeats, a CPU hog running beside them or not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from in_process import run_packbench  # tests/in_process.py
from local_ray import clean_environment, ray_head  # tests/local_ray.py

ROOT = Path(__file__).resolve().parents[2]
ANCHOR = "        logits = model.forward(ids, cache).float().cpu()  # the .cpu() synchronises the call\n"
BASE_S, SLOW_S = 0.01, 0.04  # seconds of sleep per forward call: before and after the slowdown
RUNS = (3, 3, 2)  # screens per commit
TIMED = ("wall_ms", "call_ms", "decode_ms_per_token")

pytestmark = pytest.mark.ray


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def sleep_per_call(repo: Path, seconds: float, *, first: bool) -> None:
    """Put `seconds` of sleep before every forward call of engine/episode.py (within the timed call)."""
    path = repo / "packbench" / "engine" / "episode.py"
    text = path.read_text()
    if first:
        assert ANCHOR in text, "engine/episode.py's forward call moved: update ANCHOR in this test"
        text = text.replace(ANCHOR, f"        time.sleep({BASE_S!r})  # the stand-in for a heavier call\n" + ANCHOR)
    else:
        text = text.replace(f"time.sleep({BASE_S!r})", f"time.sleep({seconds!r})")
    path.write_text(text)


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=packbench tests", "-c", "user.email=tests@packbench.invalid",
        "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def screen_at(repo: Path, work: Path, settings: dict, address: str, replicas: int) -> None:
    """`replicas` screens of the protocol, queued, then run by one dispatch (one worker) with the
    test repository's code as it is now, on the Ray cluster at `address`."""
    queued = run_packbench("submit", "protocol.yaml", "--replicas", str(replicas), cwd=work, env=settings)
    assert queued.returncode == 0, queued.stderr
    env = {**os.environ, **settings, "PACKBENCH_RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-m", "packbench", "dispatch"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def history(tmp_path_factory, tiny) -> tuple[list[str], dict]:
    base = tmp_path_factory.mktemp("commits")
    repo, work = base / "repo", base / "work"
    shutil.copytree(ROOT / "packbench", repo / "packbench", ignore=shutil.ignore_patterns("__pycache__"))
    work.mkdir()
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    (work / "protocol.yaml").write_text(yaml.safe_dump(body))
    settings = {"PACKBENCH_DB_URL": f"sqlite:///{work / 'packbench.db'}", "PACKBENCH_WORKER_THREADS": "1"}
    git(repo, "init", "-q")
    sleep_per_call(repo, BASE_S, first=True)
    commits = [commit(repo, "engine")]
    up = run_packbench("db", "upgrade", cwd=work, env=settings)
    assert up.returncode == 0, up.stderr
    with ray_head({**clean_environment(), "PYTHONPATH": str(repo)}) as address:
        screen_at(repo, work, settings, address, RUNS[0])
        with (repo / "packbench" / "engine" / "episode.py").open("a") as f:
            f.write("# a change that changes nothing the engine does\n")
        commits.append(commit(repo, "engine: a comment"))
        screen_at(repo, work, settings, address, RUNS[1])
        sleep_per_call(repo, SLOW_S, first=False)
        commits.append(commit(repo, "engine: the injected slowdown"))
        screen_at(repo, work, settings, address, RUNS[2])
    out = run_packbench("history", "quickstart", "--json", cwd=work, env=settings)
    assert out.returncode == 0, out.stderr
    return commits, json.loads(out.stdout)


def test_the_screens_are_ordered_by_the_commits_their_workers_recorded(history):
    commits, h = history
    assert len(set(commits)) == 3
    assert [s["commit"] for s in h["screens"]] == [c for c, n in zip(commits, RUNS) for _ in range(n)]


def test_the_slowdown_is_one_confirmed_step_and_the_repeats_raise_no_alarm(history):
    commits, h = history
    first_slow = h["screens"][RUNS[0] + RUNS[1]]["screen_id"]
    timed = [s for s in h["series"] if s["metric"] in TIMED]
    assert len(timed) == 2 * len(TIMED)  # dense-stream and packet
    for s in timed:
        assert [st["screen_id"] for st in s["steps"]] == [first_slow], s  # none among the six repeats
        (st,) = s["steps"]
        assert st["confirmed"] and st["change_pct"] > 100, st  # 4x the sleep per call
    for s in h["series"]:
        if s["metric"] not in TIMED:
            assert s["changes"] == [], s  # bytes, rows and tokens: the same engine output at every commit
