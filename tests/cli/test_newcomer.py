"""What a newcomer's first hour met: `results --role`, a CSV header that does not depend on what
matched, `protocol plan` finding a checkpoint's earlier episodes whatever the spelling of its
path, a screen interrupted before it started, and the API's `History` printed short.

Commands run in this process (tests/in_process.py); the database is seeded through `Store`."""

from __future__ import annotations

import csv
import io
import json
import platform
from pathlib import Path

import pytest
import yaml

from packbench.db.store import Store

ROOT = Path(__file__).resolve().parents[2]


def episode(plan_index: int, condition: str, *, role: str, wall_s: float) -> dict:
    return {"plan_index": plan_index, "condition": condition, "role": role, "prompt": 0, "status": "ok",
            "error": None, "tokens": [1] * 8, "wall_s": wall_s, "call_s": wall_s / 8, "h2d_weight_bytes": 100,
            "h2d_index_bytes": 0, "d2h_bytes": 4}


@pytest.fixture()
def seeded(tmp_path, tiny) -> tuple[str, Path]:
    """One done screen of the quickstart on this host's CPU: a slow warmup and two scored episodes
    per condition. Its protocol spells model.path `../elsewhere/../tiny` (relative), the screen
    stores the resolved directory, as submit does."""
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    body = {"name": "quickstart", "model": {"path": "../elsewhere/../tiny"}, "dtype": "float32"}
    with Store(url) as store:
        store.upgrade()
        protocol_id = store.put_protocol(sha256="ab" * 32, name="quickstart", canonical_json=json.dumps(body))
        machine = store.put_machine(host=platform.node(), gpu_name=None, driver=None, torch=None, cuda=None)
        screen_id = store.create_screen(protocol_id=protocol_id, submitter="me", model_dir=str(tiny.resolve()))
        attempt = store.start_attempt(screen_id=screen_id, worker="w", node="n", gpu_name="cpu", gpu_index=0,
                                      machine_id=machine, source_freeze={}, archive_path="a.zip")
        store.put_episodes(attempt.id, [episode(0, "dense-stream", role="warmup", wall_s=9.0),
                                        episode(1, "packet", role="warmup", wall_s=8.0),
                                        episode(2, "dense-stream", role="scored", wall_s=0.8),
                                        episode(3, "packet", role="scored", wall_s=0.4)])
        store.finish_attempt(attempt.id, status="done", archive_sha256="e" * 64)
    return url, tmp_path


def test_results_role_keeps_warmups_out_of_a_ranking(seeded, packbench_cli):
    """`--sort wall_s --desc` ranked the warmups first; the CLI had no --role (the API has)."""
    url, _ = seeded
    r = packbench_cli("results", "--role", "scored", "--sort", "wall_s", "--desc", "--json", "--db", url)
    assert r.returncode == 0, r.stderr
    assert [(e["role"], e["wall_s"]) for e in json.loads(r.stdout)] == [("scored", 0.8), ("scored", 0.4)]
    r = packbench_cli("results", "--role", "warmup", "--json", "--db", url)
    assert {e["role"] for e in json.loads(r.stdout)} == {"warmup"}
    r = packbench_cli("results", "--role", "warm", "--db", url)
    assert r.returncode == 2 and "unknown role 'warm'; use one of scored, warmup" in r.stderr


@pytest.mark.parametrize("gate", [None, "faithfulness"])
def test_results_csv_has_the_same_columns_when_nothing_matches(seeded, packbench_cli, gate):
    """34 columns with rows, 16 without: a script reading the CSV broke on an empty result."""
    url, _ = seeded
    gated = ["--gate", gate] if gate else []
    some = packbench_cli("results", "--format", "csv", *gated, "--db", url).stdout
    none = packbench_cli("results", "--format", "csv", "--condition", "nothing", *gated, "--db", url).stdout
    header = next(csv.reader(io.StringIO(none)))
    if not gate:  # the gate's verdicts are not seeded: its listing is empty too, with the same header
        assert len(list(csv.reader(io.StringIO(some)))) == 5
    assert next(csv.reader(io.StringIO(some))) == header and len(header) > 30
    assert ("gate" in header) == bool(gate)


def test_protocol_plan_finds_earlier_episodes_of_a_checkpoint_spelled_otherwise(seeded, packbench_cli, tiny):
    """The same checkpoint under another spelling of model.path found no earlier rate (109 rows
    by `results --model` against 377): a model is its resolved directory, not its spelling."""
    url, tmp_path = seeded
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny.parent / "." / tiny.name)  # absolute, another spelling again
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(body))
    r = packbench_cli("protocol", "plan", str(path), "--device", "cpu", "--sparsity", "0.94", "--json", "--db", url)
    assert r.returncode == 0, r.stderr
    time = json.loads(r.stdout)["time"]
    assert time["kind"] == "measured" and time["model"] == str(tiny.resolve())
    assert time["measured_episodes"] == 4


def test_plan_rates_match_a_row_by_its_resolved_directory():
    from types import SimpleNamespace

    from packbench.cli.plan_rates import comparable, model_key

    protocol = SimpleNamespace(model=SimpleNamespace(synth=None, path="../m/tiny"))
    key = model_key(protocol, model_dir=Path("/data/m/tiny"))
    row = {"status": "ok", "n_tokens": 8, "wall_s": 1.0, "model": "models/tiny", "model_dir": "/data/m/tiny",
           "dtype": "float32", "gpu_name": None, "host": "h", "condition": "packet"}
    assert key == "/data/m/tiny"
    assert comparable([row], model=key, dtype="float32", device="cpu", host="h") == [row]
    assert comparable([row], model="/data/m/other", dtype="float32", device="cpu", host="h") == []


def test_an_interrupted_wait_says_once_what_becomes_of_its_screen(tmp_path, tiny, packbench_cli, monkeypatch):
    """SIGINT during `submit --wait` printed "attempt 1 interrupted ... screen 1 queued for attempt
    2", then "screen 1 cancelled": two stories. Now one line: cancelled, its attempt kept."""
    import packbench.service.scheduler
    from packbench.service.screen import ScreenOutcome

    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()

    class Interrupted:
        """The dispatcher of `submit --wait`, stopped by SIGINT in its screen's first attempt."""
        fatal = outage = None
        stopping = "SIGINT"
        refusals, slots, held = [], [], []

        def __init__(self, store, settings, pool, *, on_outcome, only_screen, **options) -> None:
            self.store, self.on_outcome, self.only = store, on_outcome, only_screen

        def run(self):
            dispatcher = self.store.register_dispatcher("d", platform.node())
            claim = self.store.claim_screen(dispatcher, lease_s=60, archive_dir=str(tmp_path), source_freeze={})
            status = self.store.release(claim.attempt.id, "SIGINT")  # interrupted; the screen queued again
            outcome = ScreenOutcome(screen_id=self.only, attempt_id=claim.attempt.id, archive_path=tmp_path / "x.zip",
                                    archive_sha256=None, status="interrupted", error="stopped by SIGINT",
                                    attempt_number=1, screen_status=status)
            self.on_outcome(outcome)
            return [outcome]

    monkeypatch.setattr(packbench.service.scheduler, "Scheduler", Interrupted)
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    r = packbench_cli("submit", str(tmp_path / "p.yaml"), "--wait", "--archive-dir", str(tmp_path), "--db", url)
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "interrupted: screen 1 cancelled, so no `packbench dispatch` runs it unasked (attempt 1, interrupted, is "
        "kept); `packbench screens retry 1` queues it again"], r.stderr
