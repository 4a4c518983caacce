"""packbench's Python API submits a protocol and runs it to its verdicts (a real local Ray)."""

from pathlib import Path

import pytest
import yaml

import packbench
from packbench.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


@pytest.fixture(autouse=True)
def ray_down_after():
    """db.run starts an embedded Ray in this process (as a notebook's would stay up): shut it down
    after the test, so later tests that start a cluster of their own find none."""
    yield
    import ray

    ray.shutdown()


def test_submit_then_run_from_python(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    protocol = tmp_path / "quickstart.yaml"
    protocol.write_text(yaml.safe_dump(body))
    db = packbench.connect(f"sqlite:///{tmp_path / 'p.db'}", upgrade=True)
    (screen_id,) = db.submit(protocol, name="from-python", tags={"via": "api"})
    assert db.screens(tags={"via": "api"})[0].status == "queued"
    (outcome,) = db.run(screen_id, settings=Settings(db_url=db.url), archive_dir=tmp_path / "archives")
    assert outcome.status == "done"
    assert db.wait(screen_id, timeout_s=0).status == "done"
    verdicts = db.verdicts(screen=screen_id)
    assert verdicts and all(v.passed for v in verdicts)
    archive = packbench.read_archive(db.attempts(screen=screen_id)[-1].archive_path)
    assert archive.problems == () and len(archive.episodes()) == len(db.episodes(screen=screen_id)) == 8
    assert archive.source["git_commit"] == db.attempts(screen=screen_id)[-1].source_freeze["git_commit"]
