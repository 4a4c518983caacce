"""protocols/int8-packets.yaml as a screen on the CPU: the worker runs every condition, each
int8 loader is judged bit for bit against the int8 dense-stream and passes, its ledger moves
hidden + 4 bytes a row, and the archive of the screen audits AGREE (the auditor checks int8
rows at their own size)."""

import json
from pathlib import Path

import pytest
import yaml

from packbench.core.archive import PLAN_NAME, PROTOCOL_NAME, VERDICTS_NAME, WORKER_NAME, ArchiveWriter
from packbench.core.audit import audit_archive
from packbench.core.gates import compute_verdicts
from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.worker import Worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def screen(tmp_path_factory, checkpoints):
    raw = yaml.safe_load((ROOT / "protocols" / "int8-packets.yaml").read_text())
    raw["model"] = {"path": str(checkpoints["float32"])}
    raw["prompts"] = {"generator": {"seed": 0, "count": 2}}
    frozen = freeze(raw)
    body = json.loads(frozen.canonical)
    worker = Worker(device="cpu")
    start = worker.load(body, str(checkpoints["float32"]))
    ids = prompts(body, vocab=start.pop("vocab"))
    entries = plan(body)
    path = tmp_path_factory.mktemp("int8-screen") / "screen.zip"
    writer = ArchiveWriter(path)
    writer.add_json(PROTOCOL_NAME, body)
    writer.add_json(PLAN_NAME, {"entries": entries, "prompts": ids})
    env = worker.describe()
    writer.add_json(WORKER_NAME, {"environment": env, "start": start})
    episodes = []
    for entry in entries:
        record = worker.run(entry, ids[entry["prompt"]])
        logits, trace = record.pop("logits"), record.pop("trace", None)
        record.pop("forced_logits", None)
        writer.add_episode(record, logits, trace)
        episodes.append({**record, "logits": logits})
    verdicts = compute_verdicts(body, episodes, start=start)
    writer.add_json(VERDICTS_NAME, verdicts)
    writer.seal({"protocol_sha256": frozen.sha256, "screen_id": 0, "attempt": 1, "environment": env})
    return body, episodes, verdicts, path


def test_every_verdict_passes_and_int8_loaders_name_their_reference(screen):
    body, _, verdicts, _ = screen
    assert body["schema"] == 6
    assert all(v["passed"] for v in verdicts), [v for v in verdicts if not v["passed"]]
    faithful = {v["condition"]: v["detail"] for v in verdicts if v["gate"] == "faithfulness"}
    assert faithful["packet-int8"].startswith("against 'dense-int8' (weights int8): ")
    assert faithful["dense-int8"].startswith("against 'dense-int8' (weights int8): ")
    assert not faithful["packet"].startswith("against")


def test_int8_episodes_are_exact_and_move_int8_rows(screen):
    _, episodes, _, _ = screen
    row = 64 + 4  # tiny: hidden 64 int8 values and a float32 scale
    for e in episodes:
        assert e["status"] == "ok" and e["tier"] == "exact", e.get("error")
        if e["condition"] in ("dense-int8", "packet-int8"):
            assert e["params"]["weights"] == "int8"
            assert all(w == k * row for c in e["calls"] for w, k in zip(c["h2d_weight_bytes"], c["rows_copied"]))
        if e["condition"] == "dense-int8":
            assert all(c["rows_copied"] == [256, 256] for c in e["calls"])


def test_the_screen_audits_agree(screen):
    *_, path = screen
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]
