"""protocols/int8-packets.yaml as a screen on the CPU: the worker runs every condition, each
int8 loader is judged bit for bit against the int8 dense-stream and passes, its ledger moves
hidden + 4 bytes a row, and the archive of the screen audits AGREE (the auditor checks int8
rows at their own size)."""

from pathlib import Path

import pytest
import yaml

from cpu_screen import archive_screen
from packbench.core.audit import audit_archive
from packbench.core.protocol import freeze

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def screen(tmp_path_factory, checkpoints):
    raw = yaml.safe_load((ROOT / "protocols" / "int8-packets.yaml").read_text())
    raw["model"] = {"path": str(checkpoints["float32"])}
    raw["prompts"] = {"generator": {"seed": 0, "count": 2}}
    path = tmp_path_factory.mktemp("int8-screen") / "screen.zip"
    body, episodes, verdicts = archive_screen(freeze(raw), checkpoints["float32"], path)
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
