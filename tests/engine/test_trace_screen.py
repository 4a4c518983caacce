"""A protocol's `trace: true`: every episode of a CPU screen archives its trace of active sets
(`active/NNNNN.trace`), the auditor checks it against the record and agrees, and `simulate` on
an archived trace equals that episode's ledger, call by call. Protocols without the field keep
their hashes; a trace the screen could not record (mode graph, recording off) is refused."""

import io
import zipfile

import pytest

from cpu_screen import archive_screen, resealed
from packbench.core import simulate as sim
from packbench.core.archive import ArchiveReader, episode_members
from packbench.core.audit import audit_archive
from packbench.core.errors import ProtocolError
from packbench.core.protocol import freeze
from packbench.core.trace import parse_trace

CONDITIONS = [{"policy": "dense-stream"}, {"policy": "packet", "params": {"gather": "host"}},
              {"name": "rr", "policy": "row-retention", "params": {"rows_per_layer": 16}},
              {"policy": "early-forecast", "params": {"gather": "device"}}]


def raw(tiny, **extra) -> dict:
    return {"name": "traced", "model": {"path": str(tiny)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 12, "continuation_tokens": 4,
            "conditions": CONDITIONS, "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
            "gates": {"faithfulness": {}}, **extra}


def test_trace_false_or_absent_keeps_the_hash_and_true_changes_it(tiny):
    plain = freeze(raw(tiny))
    # Catches a field written into every body (every frozen protocol's hash would move).
    assert freeze(raw(tiny, trace=False)).sha256 == plain.sha256
    traced = freeze(raw(tiny, trace=True))
    assert traced.sha256 != plain.sha256 and traced.body["trace"] is True and "trace" not in plain.body
    assert traced.body["schema"] == plain.body["schema"]  # no schema needed to say it


def test_a_trace_the_screen_cannot_record_is_refused(tiny):
    with pytest.raises(ProtocolError, match="engine mode eager"):
        freeze(raw(tiny, trace=True, engine={"mode": "graph"}))
    with pytest.raises(ProtocolError, match="recording: true"):
        freeze(raw(tiny, trace=True, recording=False))
    with pytest.raises(ProtocolError, match="trace"):
        freeze(raw(tiny, trace="yes"))
    # 4 x 20,000 + 4 warmups: a plan an untraced screen may hold, but 4 members an episode would
    # pass the archive's member bound.
    freeze(raw(tiny, repetitions=20_000))
    with pytest.raises(ProtocolError, match="at most 75000"):
        freeze(raw(tiny, trace=True, repetitions=20_000))


@pytest.fixture(scope="module")
def screen(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("traced") / "screen.zip"
    _, episodes, verdicts = archive_screen(freeze(raw(tiny, trace=True)), tiny, path)
    return path, episodes, verdicts


def test_every_episode_archives_its_trace_and_simulate_equals_its_ledger(screen):
    path, episodes, verdicts = screen
    assert all(v["passed"] for v in verdicts)
    with ArchiveReader(path) as reader:
        for e in episodes:
            data = reader.read_bytes(episode_members(e["plan_index"]).active)
            t = parse_trace(zipfile.ZipFile(io.BytesIO(data)))
            assert t.source["episode"] == e["plan_index"] and t.source["condition"] == e["condition"]
            simulated = sim.ledger(t, e["policy"], e["params"])
            # Catches an archived trace that is not the episode's own activity, or a simulation
            # that differs from the worker's ledger in any call or layer.
            for call, s in zip(e["calls"], simulated, strict=True):
                for key in ("phase", "tokens", *sim.LEDGER_KEYS):
                    assert call[key] == s[key], (e["condition"], call["index"], key)


def test_the_audit_agrees_and_catches_a_trace_that_is_not_the_episodes(screen, tmp_path):
    path, episodes, _ = screen
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]
    # A forged archive, every digest valid: the packet episode's trace with one unit dropped from
    # a set, so one set's size is no longer the ledger's active_rows.
    packet = next(e for e in episodes if e["policy"] == "packet")
    name = episode_members(packet["plan_index"]).active
    forged = resealed(path, tmp_path / "forged.zip", lambda m: m.update({name: _shrunk(m[name])}))
    bad = audit_archive(forged)
    assert not bad.agrees
    assert any("active sets differ" in p for p in bad.record["problems"]), bad.record["problems"]


def _shrunk(data: bytes) -> bytes:
    """The trace with one unit dropped from its first non-empty set."""
    from packbench.core.trace import trace_bytes

    t = parse_trace(zipfile.ZipFile(io.BytesIO(data)))
    for row in t.sets:
        for layer, s in enumerate(row):
            if s.size:
                row[layer] = s[1:]
                return trace_bytes(t)
    raise AssertionError("an empty trace")
