"""Store behaviour on a real database (SQLite file and PostgreSQL), no mocks."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from packbench.db.errors import Conflict, DatabaseError, NotFound
from packbench.db.records import EpisodeRow
from packbench.db.store import Store

SHA = "a" * 64


def full_record(plan_index: int, **changes) -> dict:
    """An episode record exactly as a worker sends it."""
    record = {
        "plan_index": plan_index,
        "condition": "packet",
        "role": "scored",
        "prompt": 1,
        "status": "ok",
        "error": None,
        "tokens": [12, 40, 7],
        "wall_s": 0.12,
        "call_s": 0.11,
        "h2d_weight_bytes": 123,
        "h2d_index_bytes": 4,
        "d2h_bytes": 8,
        "phases": {
            "prefill": {"calls": 1, "h2d_bytes": 100, "call_s": 0.05},
            "decode": {"calls": 8, "h2d_bytes": 27, "call_s": 0.06},
        },
        "memory": {"peak_allocated_bytes": 5_000_000_000, "peak_sampled_bytes": None},
        "calls": [{"layer": 0, "rows": 3}],
    }
    record.update(changes)
    return record


def verdict(gate: str, condition: str = "packet", phase: str = "all", **changes) -> dict:
    v = {
        "gate": gate,
        "condition": condition,
        "phase": phase,
        "passed": True,
        "value": 0.5,
        "threshold": 1.0,
        "interval": [0.4, 0.6],
        "episodes": [2, 3],
        "detail": "ok",
    }
    v.update(changes)
    return v


def new_attempt(store: Store, **changes):
    protocol_id = store.put_protocol(sha256=SHA, name="quickstart", canonical_json="{}")
    screen_id = store.create_screen(protocol_id=protocol_id, submitter="alice")
    arguments = {
        "screen_id": screen_id,
        "worker": "worker-0",
        "node": "node-a",
        "gpu_name": "NVIDIA H200",
        "gpu_index": 0,
        "machine_id": None,
        "source_freeze": {"git": "abc", "dirty": False},
        "archive_path": "archives/1.zip",
    }
    arguments.update(changes)
    return store.start_attempt(**arguments)


def assert_one_line(error: BaseException) -> None:
    assert "\n" not in str(error) and str(error).strip()


# -- protocols, machines ------------------------------------------------------------------


def test_put_protocol_is_idempotent(store):
    first = store.put_protocol(sha256=SHA, name="quickstart", canonical_json='{"a":1}')
    again = store.put_protocol(sha256=SHA, name="quickstart", canonical_json='{"a":1}')
    other = store.put_protocol(sha256="b" * 64, name="other", canonical_json="{}")
    assert first == again != other
    row = store.protocol(first)
    assert (row.sha256, row.name, row.canonical_json) == (SHA, "quickstart", '{"a":1}')
    assert row.created_at.tzinfo is not None and row.created_at.utcoffset() == timedelta(0)


def test_put_machine_is_idempotent_and_none_equals_empty(store):
    first = store.put_machine(host="h1", gpu_name="H200", driver=None, torch="2.11", cuda=None)
    again = store.put_machine(host="h1", gpu_name="H200", driver="", torch="2.11", cuda=None)
    other = store.put_machine(host="h1", gpu_name="H200", driver="570", torch="2.11", cuda=None)
    assert first == again != other
    row = store.machine(first)
    assert (row.host, row.driver, row.cuda) == ("h1", None, None)


# -- screens ------------------------------------------------------------------------------


def test_screens_queue_and_lookup(store):
    with pytest.raises(NotFound) as info:
        store.screen("latest")
    assert_one_line(info.value)
    protocol_id = store.put_protocol(sha256=SHA, name="q", canonical_json="{}")
    first = store.create_screen(protocol_id=protocol_id, submitter="alice")
    second = store.create_screen(protocol_id=protocol_id, submitter="bob", repetitions=3,
                                 model_dir="/models/opt-125m")
    assert [s.id for s in store.queued_screens()] == [first, second]
    latest = store.screen("latest")
    assert (latest.id, latest.status, latest.repetitions, latest.submitter) == (second, "queued", 3, "bob")
    assert latest.model_dir == "/models/opt-125m"
    assert (store.screen(first).repetitions, store.screen(first).model_dir) == (1, None)
    assert store.screen(str(first)).id == first
    for missing in (999, "999", "nope"):
        with pytest.raises(NotFound) as info:
            store.screen(missing)
        assert_one_line(info.value)


def test_create_screen_needs_a_stored_protocol(store):
    with pytest.raises(NotFound):
        store.create_screen(protocol_id=42, submitter="alice")


# -- attempts -----------------------------------------------------------------------------


def test_attempts_are_numbered_per_screen_and_kept(store):
    machine_id = store.put_machine(host="h", gpu_name="g", driver="d", torch="t", cuda="c")
    first = new_attempt(store, machine_id=machine_id)
    assert (first.number, first.status, first.machine_id) == (1, "running", machine_id)
    assert first.source_freeze == {"git": "abc", "dirty": False}
    screen = store.screen(first.screen_id)
    assert screen.status == "running" and screen.started_at == first.started_at
    assert store.queued_screens() == []

    store.finish_attempt(first.id, status="interrupted", error="worker died")
    second = store.start_attempt(
        screen_id=first.screen_id, worker="worker-1", node="node-b", gpu_name="H200",
        gpu_index=1, machine_id=None, source_freeze={}, archive_path="archives/2.zip",
    )
    assert second.number == 2
    # started_at records when the screen first started, not when it was retried.
    assert store.screen(first.screen_id).started_at == first.started_at
    assert store.screen(first.screen_id).status == "running"
    attempts = store.attempts(first.screen_id)
    assert [(a.number, a.status, a.error) for a in attempts] == [
        (1, "interrupted", "worker died"),
        (2, "running", None),
    ]
    assert store.latest_attempt(first.screen_id) == attempts[-1]
    other_screen = store.create_screen(protocol_id=store.screen(first.screen_id).protocol_id, submitter="x")
    assert store.latest_attempt(other_screen) is None
    assert new_attempt(store).number == 1  # numbering is per screen


def test_start_attempt_on_a_missing_screen(store):
    with pytest.raises(NotFound):
        new_attempt(store, screen_id=999)


@pytest.mark.parametrize(
    ("attempt_status", "screen_status"),
    [("done", "done"), ("failed", "failed"), ("interrupted", "failed")],
)
def test_finish_attempt_moves_the_screen(store, attempt_status, screen_status):
    attempt = new_attempt(store)
    store.finish_attempt(attempt.id, status=attempt_status, error="boom", archive_sha256="c" * 64)
    finished = store.latest_attempt(attempt.screen_id)
    assert (finished.status, finished.error, finished.archive_sha256) == (attempt_status, "boom", "c" * 64)
    assert finished.finished_at >= finished.started_at
    screen = store.screen(attempt.screen_id)
    assert screen.status == screen_status
    assert screen.finished_at == finished.finished_at

    # History is never overwritten: a finished attempt cannot be finished again.
    with pytest.raises(Conflict) as info:
        store.finish_attempt(attempt.id, status="done")
    assert_one_line(info.value)
    assert store.latest_attempt(attempt.screen_id) == finished


def test_finish_attempt_rejects_unknown_status_and_attempt(store):
    attempt = new_attempt(store)
    with pytest.raises(ValueError):
        store.finish_attempt(attempt.id, status="running")
    with pytest.raises(NotFound):
        store.finish_attempt(999, status="done")


# -- episodes -----------------------------------------------------------------------------


def test_put_episode_extracts_columns_and_is_idempotent(store):
    attempt = new_attempt(store)
    assert store.put_episode(attempt.id, full_record(3)) is True
    # A re-sent record (even a different one) changes nothing: the first copy wins.
    assert store.put_episode(attempt.id, full_record(3)) is False
    assert store.put_episode(attempt.id, full_record(3, wall_s=9.0)) is False
    [row] = store.episodes(attempt.id)
    assert row == EpisodeRow(
        id=row.id, attempt_id=attempt.id, plan_index=3, condition="packet", role="scored",
        prompt=1, status="ok", error=None, tokens=(12, 40, 7), n_tokens=3, wall_s=0.12,
        call_s=0.11, h2d_weight_bytes=123, h2d_index_bytes=4, d2h_bytes=8,
        prefill_h2d_bytes=100, decode_h2d_bytes=27, prefill_call_s=0.05, decode_call_s=0.06,
        peak_allocated_bytes=5_000_000_000, peak_sampled_bytes=None, energy_j=None, fidelity_mean_kl=None,
        fidelity_p99_kl=None, fidelity_top1=None, fidelity_max_abs_logit=None, fidelity_divergence_step=None,
    )


def test_failed_episode_without_measurements_is_stored(store):
    attempt = new_attempt(store)
    record = {"plan_index": 0, "condition": "dense-stream", "role": "warmup", "prompt": 0,
              "status": "failed", "error": "CUDA out of memory"}
    assert store.put_episode(attempt.id, record) is True
    [row] = store.episodes(attempt.id)
    assert (row.status, row.error, row.tokens, row.n_tokens) == ("failed", "CUDA out of memory", (), 0)
    assert row.h2d_weight_bytes == row.prefill_h2d_bytes == row.decode_h2d_bytes == 0
    assert row.wall_s == row.prefill_call_s == 0.0
    assert row.peak_allocated_bytes is None and row.peak_sampled_bytes is None
    partial = dict(record, plan_index=1, phases={"prefill": {"h2d_bytes": 5}}, memory=None, tokens=None)
    assert store.put_episode(attempt.id, partial) is True
    assert store.episodes(attempt.id)[1].prefill_h2d_bytes == 5


def test_episodes_come_back_in_plan_order(store):
    attempt = new_attempt(store)
    for plan_index in (5, 0, 3, 1):
        store.put_episode(attempt.id, full_record(plan_index))
    assert [e.plan_index for e in store.episodes(attempt.id)] == [0, 1, 3, 5]


def test_episode_for_a_missing_attempt_is_refused(store):
    """Foreign keys are enforced on both backends (SQLite needs a pragma for it)."""
    with pytest.raises(DatabaseError) as info:
        store.put_episode(999, full_record(0))
    assert_one_line(info.value)
    assert "constraint" in str(info.value)


def distinct_record(plan_index: int) -> dict:
    """A record whose every stored value differs from the others: a value written into the
    wrong column cannot go unnoticed."""
    return {
        "plan_index": plan_index, "condition": "row-retention", "role": "warmup", "prompt": 18,
        "status": "ok", "error": "slow", "tokens": [19, 20], "wall_s": 0.25, "call_s": 0.5,
        "h2d_weight_bytes": 11, "h2d_index_bytes": 12, "d2h_bytes": 13,
        "phases": {"prefill": {"h2d_bytes": 14, "call_s": 0.125},
                   "decode": {"h2d_bytes": 15, "call_s": 0.0625}},
        "memory": {"peak_allocated_bytes": 16, "peak_sampled_bytes": 17}, "energy_j": 18.5,
        "fidelity": {"mean_kl": 0.375, "p99_kl": 0.4375, "top1": 0.875, "max_abs_logit": 1.5, "divergence_step": 21},
    }


def test_put_episode_stores_what_put_episodes_stores(store):
    """put_episode (on SQLite: its own SQL, positional parameters) and put_episodes
    (SQLAlchemy's insert, named parameters) write every value into the same column."""
    single, batch = new_attempt(store), new_attempt(store)
    failed = {"plan_index": 2, "condition": "packet", "role": "scored", "prompt": 0,
              "status": "failed", "error": "CUDA out of memory"}
    partial = dict(failed, plan_index=3, phases={"decode": {"h2d_bytes": 5}}, memory=None, tokens=None)
    records = [distinct_record(0), full_record(1), failed, partial]
    assert [store.put_episode(single.id, record) for record in records] == [True] * 4
    assert store.put_episodes(batch.id, records) == 4

    def stored(attempt_id: int) -> list[EpisodeRow]:
        return [replace(e, id=0, attempt_id=0) for e in store.episodes(attempt_id)]

    assert stored(single.id) == stored(batch.id)
    assert stored(single.id)[0] == EpisodeRow(
        id=0, attempt_id=0, plan_index=0, condition="row-retention", role="warmup", prompt=18,
        status="ok", error="slow", tokens=(19, 20), n_tokens=2, wall_s=0.25, call_s=0.5,
        h2d_weight_bytes=11, h2d_index_bytes=12, d2h_bytes=13, prefill_h2d_bytes=14,
        decode_h2d_bytes=15, prefill_call_s=0.125, decode_call_s=0.0625,
        peak_allocated_bytes=16, peak_sampled_bytes=17, energy_j=18.5, fidelity_mean_kl=0.375, fidelity_p99_kl=0.4375,
        fidelity_top1=0.875, fidelity_max_abs_logit=1.5, fidelity_divergence_step=21,
    )


def test_put_episode_and_put_episodes_share_one_key(store):
    attempt = new_attempt(store)
    assert store.put_episodes(attempt.id, [full_record(0), full_record(1)]) == 2
    assert store.put_episode(attempt.id, full_record(1, wall_s=9.0)) is False
    assert store.put_episode(attempt.id, full_record(2)) is True
    assert store.put_episodes(attempt.id, [full_record(2, wall_s=9.0), full_record(3), full_record(3)]) == 1
    assert [(e.plan_index, e.wall_s) for e in store.episodes(attempt.id)] == [
        (0, 0.12), (1, 0.12), (2, 0.12), (3, 0.12)
    ]


def test_put_episode_commits_each_record_and_recovers_from_an_error(store, db_url):
    attempt = new_attempt(store)
    assert store.put_episode(attempt.id, full_record(0)) is True
    with Store(db_url) as other:
        # Committed when acknowledged: another connection sees it at once.
        assert [e.plan_index for e in other.episodes(attempt.id)] == [0]
        with pytest.raises(DatabaseError, match="constraint"):
            store.put_episode(999, full_record(1))
        # The refused record's transaction is gone with its write lock: on SQLite a
        # transaction left open would keep this writer waiting, then fail as locked.
        assert other.put_episode(attempt.id, full_record(2)) is True
        assert [e.plan_index for e in other.episodes(attempt.id)] == [0, 2]
    # The store writes on after the error (with a fresh connection).
    assert store.put_episode(attempt.id, full_record(1)) is True
    assert store.put_episode(attempt.id, full_record(2)) is False
    assert [e.plan_index for e in store.episodes(attempt.id)] == [0, 1, 2]


# -- verdicts -----------------------------------------------------------------------------


def test_put_verdicts_is_idempotent_and_ordered(store):
    attempt = new_attempt(store)
    batch = [
        verdict("runtime", phase="decode"),
        verdict("faithfulness", interval=None, value=None, threshold=None),
        verdict("runtime", phase="all", passed=False),
        verdict("faithfulness", condition="dense-stream"),
    ]
    assert store.put_verdicts(attempt.id, batch) == 4
    assert store.put_verdicts(attempt.id, batch + [verdict("runtime", phase="prefill")]) == 1
    assert store.put_verdicts(attempt.id, []) == 0
    rows = store.verdicts(attempt.id)
    assert [(v.gate, v.condition, v.phase) for v in rows] == [
        ("faithfulness", "dense-stream", "all"),
        ("faithfulness", "packet", "all"),
        ("runtime", "packet", "all"),
        ("runtime", "packet", "decode"),
        ("runtime", "packet", "prefill"),
    ]
    packet = rows[1]
    assert (packet.passed, packet.value, packet.interval, packet.episodes) == (True, None, None, (2, 3))
    assert rows[2].passed is False
    assert rows[3].interval == (0.4, 0.6) and rows[3].threshold == 1.0 and rows[3].detail == "ok"


# -- audits -------------------------------------------------------------------------------


def test_audits_are_append_only(store):
    attempt = new_attempt(store)
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    arguments = dict(attempt_id=attempt.id, archive_sha256="d" * 64, digest="e" * 64,
                     result="agree", problems=[], machine="laptop",
                     started_at=started, finished_at=started + timedelta(seconds=2))
    first = store.put_audit(**arguments)
    second = store.put_audit(**dict(arguments, result="disagree", problems=["hash mismatch: x"]))
    assert first != second
    audits = store.audits(attempt.id)
    assert [(a.result, a.problems) for a in audits] == [("agree", ()), ("disagree", ("hash mismatch: x",))]
    assert audits[0].started_at == started and audits[0].started_at.tzinfo is not None
    with pytest.raises(ValueError):
        store.put_audit(**dict(arguments, started_at=datetime(2026, 1, 2)))


def test_timestamps_come_back_in_utc_whatever_zone_went_in(store):
    attempt = new_attempt(store)
    tokyo = datetime(2026, 1, 2, 12, 0, tzinfo=UTC).astimezone(timezone_plus(9))
    store.put_audit(attempt_id=attempt.id, archive_sha256="d" * 64, digest="e", result="agree",
                    problems=[], machine="m", started_at=tokyo, finished_at=tokyo)
    [audit] = store.audits(attempt.id)
    assert audit.started_at == tokyo
    assert audit.started_at.utcoffset() == timedelta(0) and audit.started_at.hour == 12


def timezone_plus(hours: int):
    from datetime import timezone

    return timezone(timedelta(hours=hours))


def test_condition_tiers_come_from_the_stored_bodies(store):
    body = '{"conditions":[{"name":"dense-stream","policy":"dense-stream"},{"name":"int8","policy":"quantized"}]}'
    store.put_protocol(sha256="c" * 64, name="q", canonical_json=body)
    store.put_protocol(sha256="d" * 64, name="odd", canonical_json='{"conditions": 3}')
    assert store.condition_tiers(["c" * 64, "d" * 64, "e" * 64]) == {
        "c" * 64: {"dense-stream": "exact", "int8": "approximate"}, "d" * 64: {}}
