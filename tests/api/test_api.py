"""packbench.connect: screens, episodes, verdicts, audits and labels as records and DataFrames."""

import dataclasses

import pandas as pd
import pytest

import packbench
from screens import QUICKSTART, archived, ingest_archive
from packbench.core.errors import PackbenchError
from packbench.core.record import STORED_FIELDS
from packbench.db.store import Store


@pytest.fixture
def db(db_url):
    url = db_url
    with Store(url) as store:
        store.upgrade()
        ingest_archive(store, QUICKSTART, commit="a" * 40, key="1")
        ingest_archive(store, QUICKSTART, commit="b" * 40, key="2",
                       edit=lambda r: {**r, "wall_s": r["wall_s"] * 2})
    client = packbench.connect(url)
    yield client
    client.close()


def test_screens_are_records_and_a_frame(db):
    rows = db.screens()
    assert [s.id for s in rows] == [2, 1]  # newest first
    assert all(s.status == "done" for s in rows)
    frame = rows.frame()
    assert isinstance(frame, pd.DataFrame)
    assert list(frame["id"]) == [2, 1] and set(frame["protocol"]) == {"quickstart-v1"}


def test_episodes_carry_core_record_fields_and_their_screen(db):
    rows = db.episodes(screen=1)
    _, records, _, _ = archived()
    assert len(rows) == len(records) == 8
    names = {f.name for f in STORED_FIELDS}
    assert names <= {f.name for f in dataclasses.fields(rows[0])}
    frame = db.episodes(protocol="quickstart-v1").frame()
    assert len(frame) == 16
    assert list(frame.columns[:4]) == ["screen_id", "attempt", "protocol", "name"]
    walls = frame.groupby("screen_id")["wall_s"].sum()
    assert walls[2] == pytest.approx(2 * walls[1])  # the edit made screen 2 twice as slow
    scored = db.episodes(screen=1, role="scored", condition="packet")
    assert len(scored) == 3 and {e.condition for e in scored} == {"packet"}
    assert sum(e.h2d_weight_bytes + e.h2d_index_bytes for e in scored) == 506880  # the archive's verdict detail


def test_verdicts_and_audits(db):
    verdicts = db.verdicts(screen=1)
    assert {(v.gate, v.condition, v.passed) for v in verdicts} == {
        ("faithfulness", "dense-stream", True), ("faithfulness", "packet", True), ("acquisition", "packet", True)}
    assert len(db.verdicts(protocol="quickstart-v1", gate="acquisition")) == 2
    assert list(db.audits(screen=1)) == []  # ingested: audited elsewhere, no audit run here
    assert db.audits(screen=1).frame().empty
    commits = [a.source_freeze["git_commit"] for a in db.attempts(protocol="quickstart-v1")]
    assert commits == ["b" * 40, "a" * 40]
    h = db.history("quickstart-v1", condition="packet", metric="wall_ms")
    assert [p.commit for p in h.points] == ["a" * 40, "b" * 40]
    (series,) = h.series
    assert series.values[1] == pytest.approx(2 * series.values[0])  # too few runs for a step: none claimed
    assert series.steps == [] and h.regressions(50.0) == []
    # Printed in a notebook: one line, not the 5 KB dataclass of every figure; the figures as a frame.
    assert repr(h) == ("History('quickstart-v1': 2 screens over 2 commits, 1 series, 0 steps, 0 changes; .rows() or "
                       ".frame() for the figures)")
    frame = h.frame()
    assert list(frame["screen_id"]) == [1, 2] and set(frame["metric"]) == {"wall_ms"}
    assert frame["value"].iloc[1] == pytest.approx(2 * frame["value"].iloc[0]) and not frame["step"].any()


def test_labels_filter_every_listing(db):
    db.label(1, name="base", note="first run", tags={"team": "infra", "box": "ci"})
    db.label(2, tags={"team": "research"})
    assert [s.id for s in db.screens(tags={"team": "infra"})] == [1]
    assert [s.id for s in db.screens(tags={"team": "*"})] == [2, 1]
    assert [s.id for s in db.screens(tags={"team": "infra", "box": "ci"})] == [1]
    assert db.screens(tags={"team": "infra", "box": "gpu"}) == []
    assert [s.id for s in db.screens(name="base")] == [1]
    assert {e.attempt_id for e in db.episodes(tags={"team": "research"})} == {2}
    frame = db.screens(screen=1).frame()
    assert frame.loc[0, "tags"] == {"box": "ci", "team": "infra"} and frame.loc[0, "note"] == "first run"
    db.label(1, tags={"team": "platform"}, untag=("box",))  # a key takes its new value; untag drops one
    assert db.store.screen_tags([1]) == {1: {"team": "platform"}}


def test_bad_input_is_one_line_with_its_fix(db):
    with pytest.raises(PackbenchError, match="tag key 'bad key'"):
        db.label(1, tags={"bad key": "x"})
    with pytest.raises(PackbenchError, match="either screen= or the filters"):
        db.episodes(screen=1, protocol="quickstart-v1")
    with pytest.raises(PackbenchError, match="no screen with id 99"):
        db.screens(screen=99)
    with pytest.raises(PackbenchError, match="screen status"):
        db.screens(status="finished")


def test_an_old_database_is_refused_with_the_command_that_fixes_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    with Store(url) as store:
        store.upgrade("0009_episode_fidelity")
    with pytest.raises(PackbenchError, match="packbench db upgrade"):
        packbench.connect(url)
    packbench.connect(url, upgrade=True).close()


def test_a_missing_sqlite_file_is_refused_without_creating_it(tmp_path):
    """Bug caught: `packbench.connect("sqlite:///typo.db")` created an empty typo.db, then refused
    it for having no schema; the CLI refuses a missing file without creating one, so should this."""
    url = f"sqlite:///{tmp_path / 'typo.db'}"
    with pytest.raises(PackbenchError, match=r"no database at .*typo\.db \(no such file here\)"):
        packbench.connect(url)
    assert list(tmp_path.iterdir()) == []
    packbench.connect(url, upgrade=True).close()  # upgrade=True creates it, as `packbench db upgrade` does
    assert (tmp_path / "typo.db").is_file()


def test_an_archive_reads_without_a_database():
    archive = packbench.read_archive(QUICKSTART)
    assert archive.problems == () and archive.protocol.name == "quickstart-v1"
    assert archive.source["package_version"] == "0.1.0"
    rows = archive.episodes()
    assert [r["plan_index"] for r in rows] == list(range(8))
    frame = rows.frame()
    assert {"wall_s", "h2d_weight_bytes", "rows_copied", "policy", "repetition"} <= set(frame.columns)
    assert {v["gate"] for v in archive.verdicts()} == {"faithfulness", "acquisition"}


def test_wait_returns_once_the_screen_has_ended(db):
    queued = db.store.create_screen(protocol_id=1, submitter="t")
    naps = []

    def sleep(s):  # stands for a dispatcher elsewhere: the screen is cancelled on the second poll
        naps.append(s)
        if len(naps) == 2:
            db.store.cancel_screen(queued)

    assert db.wait(queued, poll_s=0.01, sleep=sleep).status == "cancelled"
    with pytest.raises(TimeoutError, match="still queued"):
        db.wait(db.store.create_screen(protocol_id=1, submitter="t"), timeout_s=0.0)


def test_an_archive_gives_the_serving_figures_results_and_the_report_show():
    """Issue 43: the API's serving figures are the report's and `results`' (one function), per
    condition and per episode, with the runtime readings and the position check."""
    from packbench.core.report import read_screen, serving_rows

    archive = packbench.read_archive(QUICKSTART)
    rows = archive.serving()
    assert rows.dicts() == serving_rows(read_screen(QUICKSTART))
    assert [r["condition"] for r in rows] == ["dense-stream", "packet"] and rows[0]["tier"] == "exact"
    per = archive.episode_serving()
    assert len(per) == 8 and per[0]["previous"] is None and per[1]["previous"] == per[0]["condition"]
    for r in per:
        assert r["tpot_s"] == (r["wall_s"] - r["ttft_s"]) / len(r["itl_s"])
    assert {"ttft_s", "tpot_s", "itl_p99_s", "decode_tokens_per_s", "outside_s"} <= set(rows.frame().columns)
    assert [r["condition"] for r in archive.runtime_ratios()] == ["packet"]
    # quickstart-v1's own walls: its first scored episode took 64 ms and plan index 5 47 ms where
    # the others took 18-21 ms: both flagged, as the report and `results` flag them
    assert archive.positions()["flagged"] == [2, 5]


def test_episode_and_verdict_frames_label_each_rows_tier(tmp_path):
    """Bug: `db.episodes().frame()` and `db.verdicts().frame()` had no tier, so a frame sorted by
    wall_s ranked an int8 (approximate) condition among exact packets unlabelled, which every
    `packbench results` row prevents with its tier column. Here the quickstart's packet episodes
    stand for a `quantized` condition of an edited protocol."""
    import hashlib

    from packbench.core.archive import file_sha256
    from packbench.core.canonical import canonical_json

    url = f"sqlite:///{tmp_path / 'p.db'}"
    body, records, verdicts, _ = archived()
    mixed = {**body, "conditions": [*body["conditions"], {"name": "int8", "policy": "quantized",
                                                          "params": {"method": "int8-weight-only"}}]}
    text = canonical_json(mixed).decode()
    rename = lambda x: {**x, "condition": "int8"} if x.get("condition") == "packet" else x  # noqa: E731
    with Store(url) as store:
        store.upgrade()
        store.ingest_attempt(
            protocol_sha256=hashlib.sha256(text.encode()).hexdigest(), protocol_name="mixed", protocol_json=text,
            machine={"host": "ci-box", "gpu_name": "cpu"},
            attempt={"archive_path": str(QUICKSTART), "archive_sha256": file_sha256(QUICKSTART),
                     "source_freeze": {}, "ingested_from": "tests/api", "node": "ci-box"},
            episodes=[rename(r) for r in records], verdicts=[rename(v) for v in verdicts])
    with packbench.connect(url) as db:
        frame = db.episodes(role="scored").frame().sort_values("wall_s")
        assert list(frame.columns[:5]) == ["screen_id", "attempt", "protocol", "name", "tier"]
        assert dict(zip(frame["condition"], frame["tier"])) == {"dense-stream": "exact", "int8": "approximate"}
        tiers = db.verdicts().frame().set_index(["gate", "condition"])["tier"].to_dict()
        assert tiers == {("faithfulness", "dense-stream"): "exact", ("faithfulness", "int8"): "approximate",
                         ("acquisition", "int8"): "approximate"}
        assert "tier" not in db.audits().frame().columns and "tier" not in db.attempts().frame().columns
