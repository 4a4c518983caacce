"""Submit + audit end to end through a real local Ray, a real SQLite database and real archives.

The commands that run episodes (`submit --wait`, `dispatch`, `audit --ray`, `--reexecute`) run in
subprocesses that join the session's Ray (tests/conftest.py `ray_address`); the ones that only
read, check or queue run in this process (tests/in_process.py)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from packbench.core.archive import ArchiveReader
from in_process import Ran, run_packbench  # tests/in_process.py

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path, env: dict) -> Ran:
    """`packbench ARGS` in this process, with the settings in `env`."""
    return run_packbench(*args, cwd=cwd, env=env)


def cli_ray(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """`packbench ARGS` in a subprocess, with the settings in `env` (a Ray address among them)."""
    return subprocess.run([sys.executable, "-m", "packbench", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", **env},
                          timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny) -> Path:
    """A protocol pointing at the tiny checkpoint, in a folder with its own database."""
    d = tmp_path_factory.mktemp("screen")
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    (d / "protocol.yaml").write_text(yaml.safe_dump(body))
    return d


@pytest.fixture(scope="module")
def env(workdir) -> dict:
    """The settings every command of the module runs with."""
    return {"PACKBENCH_DB_URL": f"sqlite:///{workdir / 'packbench.db'}"}


@pytest.fixture(scope="module")
def ray_env(env, ray_address) -> dict:
    """... and the commands that run episodes, on the session's Ray."""
    return {**env, "PACKBENCH_RAY_ADDRESS": ray_address}


@pytest.fixture(scope="module")
def screen(workdir, env, ray_env) -> dict:
    up = cli("db", "upgrade", cwd=workdir, env=env)
    assert up.returncode == 0, up.stderr
    out = cli_ray("submit", "protocol.yaml", "--wait", "--json", cwd=workdir, env=ray_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_submit_runs_every_planned_episode_and_passes(screen):
    assert screen["status"] == "done"
    assert {(v["gate"], v["condition"]) for v in screen["verdicts"]} == {
        ("faithfulness", "dense-stream"), ("faithfulness", "packet"), ("acquisition", "packet")}
    assert all(v["passed"] for v in screen["verdicts"])
    eps = screen["episodes"]
    assert [e["index"] for e in eps] == list(range(8))  # 2 warmups + 3 prompts x 2 conditions
    assert all(e["status"] == "ok" and len(e["tokens"]) == 8 for e in eps)
    packet = sum(e["h2d_bytes"] for e in eps if e["condition"] == "packet" and e["role"] == "scored")
    dense = sum(e["h2d_bytes"] for e in eps if e["condition"] == "dense-stream" and e["role"] == "scored")
    assert dense == 3 * 8 * 2 * 64 * 256 * 4  # prompts x calls x layers x outgoing bytes (float32)
    assert 0 < packet < dense / 2


def test_audit_agrees_and_repeats_its_digest(screen, workdir, env, ray_env):
    a = cli("audit", str(screen["screen_id"]), "--json", cwd=workdir, env=env)
    b = cli_ray("audit", "latest", "--ray", "--json", cwd=workdir, env=ray_env)  # as a Ray task
    assert a.returncode == 0 and b.returncode == 0, a.stdout + a.stderr
    ra, rb = json.loads(a.stdout), json.loads(b.stdout)
    assert ra["result"] == "agree" and ra["problems"] == []
    assert ra["digest"] == rb["digest"]


def test_results_json_matches_submit(screen, workdir, env):
    r = cli("results", "--screen", str(screen["screen_id"]), "--json", cwd=workdir, env=env)
    assert r.returncode == 0
    got = json.loads(r.stdout)
    audit = got.pop("audit")  # the audits above ran after submit printed its summary
    assert screen["audit"] is None and audit["result"] == "agree" and audit["audits"] >= 2
    assert audit["archive_sha256_matches"] is True and {audit["kind"]} <= {"local", "ray"}
    assert got == {k: v for k, v in screen.items() if k != "audit"}


def flip_byte_in_member(archive: Path, name: str, out: Path) -> Path:
    """Copy `archive` to `out` with one bit flipped in the middle of member `name`'s stored data."""
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo(name)
    data = bytearray(archive.read_bytes())
    offset = info.header_offset
    # The member's data starts after its 30-byte local header, name and extra field.
    name_len = int.from_bytes(data[offset + 26:offset + 28], "little")
    extra_len = int.from_bytes(data[offset + 28:offset + 30], "little")
    data[offset + 30 + name_len + extra_len + info.compress_size // 2] ^= 0x01
    out.write_bytes(bytes(data))
    return out


def test_flipped_byte_in_any_member_fails_audit_naming_it(screen, workdir, env, tmp_path):
    from packbench.core.audit import audit_archive

    archive = Path(screen["archive_path"])
    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
    assert len(names) == 5 + 3 * 8  # protocol, plan, worker, verdicts, manifest; episodes, logits, traces
    for name in names:
        report = audit_archive(flip_byte_in_member(archive, name, tmp_path / "flipped.zip"),
                               expected_sha256=screen["archive_sha256"])
        assert not report.agrees, name
        assert any(name in p for p in report.problems), (name, report.problems)
    # And through the CLI: exit 1, the member named.
    flipped = flip_byte_in_member(archive, "logits/00003.npy", tmp_path / "flipped.zip")
    r = cli("audit", str(screen["screen_id"]), "--archive", str(flipped), "--json", cwd=workdir, env=env)
    assert r.returncode == 1
    assert any("logits/00003.npy" in p for p in json.loads(r.stdout)["problems"])


def test_archive_is_complete_and_self_describing(screen):
    reader = ArchiveReader(Path(screen["archive_path"]))
    assert reader.complete and reader.verify() == []
    names = set(reader.names)
    assert {"protocol.json", "plan.json", "worker.json", "verdicts.json", "manifest.json"} <= names
    assert sum(n.startswith("logits/") for n in names) == 8
    m = reader.manifest
    assert m["format_version"] == 1 and m["screen_id"] == screen["screen_id"]
    assert set(m["source_freeze"]) == {"package_version", "git_commit", "git_dirty", "engine_sha256"}


def test_a_worker_failure_is_recorded_with_its_partial_archive(workdir, env, ray_env, tiny, tmp_path):
    """A checkpoint that passes the driver's config check but lacks tensors fails on the worker:
    one line, exit 2, the attempt kept as failed with its cause, its partial archive kept."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    sd = load_file(tiny / "model.safetensors")
    sd.pop("model.decoder.layers.1.fc2.weight")
    save_file(sd, broken / "model.safetensors")
    body = yaml.safe_load((workdir / "protocol.yaml").read_text())
    body["model"]["path"] = str(broken)
    (workdir / "broken.yaml").write_text(yaml.safe_dump(body))
    r = cli_ray("submit", "broken.yaml", "--wait", cwd=workdir, env=ray_env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "lacks 1 tensors" in r.stderr
    summary = json.loads(cli("results", "--screen", "latest", "--json", cwd=workdir, env=env).stdout)
    assert summary["status"] == "failed" and "lacks 1 tensors" in summary["error"]
    reader = ArchiveReader(Path(summary["archive_path"]))
    assert not reader.complete and reader.names == ["protocol.json"]


def test_schema2_screen_with_synthetic_model_and_token_file(screen, workdir, env, ray_env, tmp_path):
    """Every gate, a model generated on the worker, prompts from a file: submit, then dispatch."""
    data = ROOT / "tests" / "data"
    for name in ("gates-v2.yaml", "gates-v2-prompts.json"):
        (tmp_path / name).write_bytes((data / name).read_bytes())
    cache = {"PACKBENCH_MODEL_CACHE": str(tmp_path / "models")}
    queued = cli("submit", str(tmp_path / "gates-v2.yaml"), cwd=workdir, env={**env, **cache})
    assert queued.returncode == 0 and "queued screen" in queued.stdout, queued.stderr
    out = cli_ray("dispatch", "--json", cwd=workdir, env={**ray_env, **cache})
    assert out.returncode == 1, out.stderr[-2000:]  # capacity and resources fail (below): a script can tell
    summary = json.loads(out.stdout)
    verdicts = {(v["gate"], v["condition"], v["phase"]): v["passed"] for v in summary["verdicts"]}
    assert all(passed for (gate, _, _), passed in verdicts.items() if gate == "faithfulness")
    assert verdicts[("capacity", "packet", "all")] is False  # the tiny model fits 1 MiB: preserved failure
    assert verdicts[("resources", "packet", "all")] is False  # nothing samples GPU memory on the CPU
    assert verdicts[("acquisition", "packet", "decode")] is True
    assert any((tmp_path / "models").iterdir())  # the worker generated the checkpoint
    audit = cli("audit", str(summary["screen_id"]), "--json", cwd=workdir, env=env)
    assert audit.returncode == 0 and json.loads(audit.stdout)["result"] == "agree", audit.stdout[-2000:]


def test_reexecution_agrees_and_is_recorded_as_its_own_kind(screen, workdir, env, ray_env):
    """`audit SCREEN --reexecute K`: episodes drawn (one per condition at least), re-run on a fresh
    worker, exact parts equal; the audit row says kind reexecute. Times on this CPU are noise
    (other tests share the cores): the tolerance is widened, and recorded as such."""
    from packbench.db.store import Store

    r = cli_ray("audit", str(screen["screen_id"]), "--reexecute", "1", "--seed", "3", "--time-factor", "1000",
                "--json", cwd=workdir, env=ray_env)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["result"] == "agree" and out["problems"] == [] and out["time_factor"] == 1000
    by = {e["index"]: e for e in screen["episodes"]}
    assert {by[i]["condition"] for i in out["episodes"]} == {"dense-stream", "packet"}
    assert by[out["reference_twice"]]["condition"] == "dense-stream"
    with Store(env["PACKBENCH_DB_URL"]) as store:
        attempt = store.latest_attempt(screen["screen_id"])
        kinds = [(a.kind, a.result, a.digest) for a in store.audits(attempt.id)]
    assert ("reexecute", "agree", out["digest"]) in kinds


def test_reexecution_runs_on_the_archives_recorded_threads(screen, workdir, env, ray_env):
    """Host arithmetic can depend on the thread count (tests/engine/test_cpu_threads.py): an archive
    is re-executed on the count its worker recorded, even where --worker-threads asks for another,
    and the audit checks the worker ran it (catches a re-run on the deployment's own count, which
    on another host made an honest archive DISAGREE)."""
    threads = ArchiveReader(Path(screen["archive_path"])).read_json("worker.json")["environment"]["threads"]
    r = cli_ray("audit", "--archive", screen["archive_path"], "--reexecute", "1", "--seed", "5", "--time-factor",
                "1000", cwd=workdir, env={**ray_env, "PACKBENCH_WORKER_THREADS": str(threads + 1)})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]  # exit 0: agree, no problem (a thread mismatch is one)
    assert f"re-executing on the archive's {threads} host thread(s)" in r.stderr.splitlines()
    assert "thread(s), the archive" not in r.stdout + r.stderr


def test_reexecution_catches_a_consistent_forgery_the_static_audit_cannot(screen, workdir, env, ray_env, tmp_path):
    """One episode's ledger forged consistently (totals, verdicts, manifest; no key): the static
    audit of the file agrees, the re-execution disagrees naming that episode, exit 1."""
    from bench.forge import forge_ledger

    forged = tmp_path / "forged.zip"
    index = forge_ledger(Path(screen["archive_path"]), forged)
    static = cli("audit", "--archive", str(forged), "--json", cwd=workdir, env=env)
    assert static.returncode == 0 and json.loads(static.stdout)["result"] == "agree", static.stdout
    r = cli_ray("audit", "--archive", str(forged), "--reexecute", "8", "--time-factor", "1000", "--json",
                cwd=workdir, env=ray_env)
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert index in out["episodes"] and out["result"] == "disagree"
    named = [p for p in out["problems"] if p.startswith(f"episode {index} (packet): ")]
    assert any("h2d_weight_bytes" in p for p in named), out["problems"]
    assert all(p.startswith(f"episode {index} ") for p in out["problems"]), out["problems"]


def test_reexecution_a_worker_refuses_is_one_line_and_exit_2(screen, workdir, ray_env, tmp_path):
    """The checkpoint is not where --model-dir says: the worker's refusal, one line, no traceback."""
    r = cli_ray("audit", "--archive", screen["archive_path"], "--reexecute", "1", "--model-dir",
                str(tmp_path / "gone"), cwd=workdir, env=ray_env)
    assert r.returncode == 2, r.stdout + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not exist" in errors[0] and "Traceback" not in r.stderr, r.stderr


def test_reexecution_of_a_screen_refuses_a_model_dir_it_would_not_use(screen, workdir, ray_env, tmp_path, tiny):
    """Bug caught: `audit SCREEN --reexecute K --model-dir DIR` re-executed the checkpoint the
    screen's row names and dropped --model-dir silently (AGREE, exit 0, whatever DIR held: a
    checkpoint edited since, another model). --model-dir gives the checkpoint of an --archive file
    re-executed alone; with screen ids it is refused in one line, exit 2, before any worker runs."""
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    r = cli_ray("audit", str(screen["screen_id"]), "--reexecute", "1", "--time-factor", "1000", "--model-dir",
                str(other), cwd=workdir, env=ray_env)
    assert r.returncode == 2, r.stdout + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model-dir" in errors[0] and "--archive" in errors[0], r.stderr
    assert "re-executing" not in r.stderr and "Traceback" not in r.stderr



def test_reexecution_on_a_checkpoint_edited_since_the_screen_is_refused_not_disagree(screen, workdir, ray_env,
                                                                                     tiny, tmp_path):
    """Bug caught: a checkpoint whose config.json was edited after its screen ran (here a key no
    model reads: the logits stay the same) was re-executed anyway and the honest archive audited
    DISAGREE, exit 1, its only problem `the re-run loaded a checkpoint with digest ..., the archive
    measured ...` (an edit that changes the model adds a difference for every drawn episode); for
    a screen that verdict was recorded against it. The re-run cannot check the archive on other
    weights: it is refused in one line naming both digests and the fix, exit 2, before any episode."""
    edited = tmp_path / "edited"
    shutil.copytree(tiny, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "edited_after_the_screen": True}))
    r = cli_ray("audit", "--archive", screen["archive_path"], "--reexecute", "1", "--time-factor", "1000",
                "--model-dir", str(edited), cwd=workdir, env=ray_env)
    assert r.returncode == 2, r.stdout + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    archived = ArchiveReader(Path(screen["archive_path"])).read_json("worker.json")["start"]["model_sha256"]
    assert len(errors) == 1 and archived in errors[0] and "--model-dir" in errors[0], r.stderr
    assert "DISAGREE" not in r.stdout and "re-executed episode" not in r.stderr and "Traceback" not in r.stderr
