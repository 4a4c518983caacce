"""Queries behind `results`, `screens list|show` and `compare`, on both backends.

One seeded database per backend (module scope) serves the read-only tests:

    screen 1  protocol quickstart (tiny, float32)  attempt 1 failed on the laptop (2 episodes,
              one failed, no verdicts); attempt 2 done on the laptop (4 episodes, 3 verdicts
              all passed, 1 audit). Attempts started 2026-01-10.
    screen 2  protocol big (opt-1.3b, float16)     attempt 1 done on an H200 node (4 scored
              episodes, one failed; faithfulness of packet FAILED, runtime decode FAILED).
              Started 2026-02-20.
    screen 3  protocol quickstart                  queued, never ran.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import inspect as inspect_db
from sqlalchemy import text

from packbench.db.errors import InvalidFilter, NotFound
from packbench.db.compare import ratio
from packbench.core.dates import parse_when
from packbench.db.queries import GATES, ResultFilter
from packbench.db.session import make_engine
from packbench.db.store import Store

SHA_QUICK = "ab12" + "0" * 60
SHA_BIG = "cd34" + "1" * 60
JAN = datetime(2026, 1, 10, 12, 0, tzinfo=UTC)
FEB = datetime(2026, 2, 20, 8, 30, tzinfo=UTC)


def body(name: str, model: str, dtype: str) -> str:
    return json.dumps({"name": name, "model": {"path": model}, "dtype": dtype}, sort_keys=True)


def episode(plan_index: int, condition: str, role: str = "scored", prompt: int = 0, *, ok: bool = True,
            h2d: int = 1000, wall_s: float = 1.0, peak: int | None = 500) -> dict:
    if not ok:
        return {"plan_index": plan_index, "condition": condition, "role": role, "prompt": prompt,
                "status": "failed", "error": "CUDA out of memory"}
    return {"plan_index": plan_index, "condition": condition, "role": role, "prompt": prompt, "status": "ok",
            "tokens": [1, 2, 3], "wall_s": wall_s, "call_s": wall_s / 2, "h2d_weight_bytes": h2d,
            "h2d_index_bytes": h2d // 10, "d2h_bytes": 8,
            "phases": {"prefill": {"h2d_bytes": h2d // 2, "call_s": 0.1}, "decode": {"h2d_bytes": h2d // 2, "call_s": 0.2}},
            "memory": {"peak_allocated_bytes": peak, "peak_sampled_bytes": None}}


def verdict(gate: str, condition: str, passed: bool, *, phase: str = "all", value: float | None = 0.0) -> dict:
    return {"gate": gate, "condition": condition, "phase": phase, "passed": passed, "value": value,
            "threshold": 0.5, "interval": None, "episodes": [], "detail": ""}


def set_started(url: str, attempt_id: int, when: datetime) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            # Stored the way UtcDateTime stores it: on SQLite naive UTC text in SQLAlchemy's format, with
            # microseconds (sqlite3's own adapter drops ".000000", and text compares it below its instant).
            value = (when.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")
                     if connection.dialect.name == "sqlite" else when)
            connection.execute(text("UPDATE attempts SET started_at = :t WHERE id = :id"), {"t": value, "id": attempt_id})
    finally:
        engine.dispose()


def start(store: Store, screen_id: int, *, node: str, gpu_name: str, machine_id: int) -> int:
    return store.start_attempt(screen_id=screen_id, worker="w0", node=node, gpu_name=gpu_name, gpu_index=0,
                               machine_id=machine_id, source_freeze={}, archive_path=f"archives/{screen_id}.zip").id


def seed(store: Store, url: str) -> dict:
    quick = store.put_protocol(sha256=SHA_QUICK, name="quickstart", canonical_json=body("quickstart", "../models/tiny", "float32"))
    big = store.put_protocol(sha256=SHA_BIG, name="big", canonical_json=body("big", "/models/opt-1.3b", "float16"))
    laptop = store.put_machine(host="laptop", gpu_name=None, driver=None, torch="2.13", cuda=None)
    h200 = store.put_machine(host="box-a", gpu_name="NVIDIA H200", driver="570", torch="2.11", cuda="12.8")

    s1 = store.create_screen(protocol_id=quick, submitter="alice", model_dir="/home/alice/models/tiny")
    a11 = start(store, s1, node="laptop", gpu_name="cpu", machine_id=laptop)
    store.put_episodes(a11, [episode(0, "dense-stream", "warmup"), episode(1, "dense-stream", ok=False)])
    store.finish_attempt(a11, status="failed", error="worker died")
    a12 = start(store, s1, node="laptop", gpu_name="cpu", machine_id=laptop)
    store.put_episodes(a12, [episode(0, "dense-stream", "warmup"), episode(1, "dense-stream", h2d=1000),
                             episode(2, "packet", "warmup"), episode(3, "packet", h2d=300, peak=700)])
    store.put_verdicts(a12, [verdict("faithfulness", "dense-stream", True), verdict("faithfulness", "packet", True),
                             verdict("acquisition", "packet", True, value=0.3)])
    store.finish_attempt(a12, status="done", archive_sha256="e" * 64)
    store.put_audit(attempt_id=a12, archive_sha256="e" * 64, digest="f" * 64, result="agree", problems=[],
                    machine="laptop", started_at=JAN, finished_at=JAN + timedelta(seconds=1))

    s2 = store.create_screen(protocol_id=big, submitter="bob", model_dir="/models/opt-1.3b")
    a21 = start(store, s2, node="gpu-node-1", gpu_name="NVIDIA H200", machine_id=h200)
    store.put_episodes(a21, [episode(0, "dense-stream", prompt=0, h2d=4000, wall_s=2.0),
                             episode(1, "dense-stream", prompt=1, h2d=4000, wall_s=2.0),
                             episode(2, "packet", prompt=0, h2d=600, wall_s=1.0, peak=900),
                             episode(3, "packet", prompt=1, ok=False)])
    store.put_verdicts(a21, [verdict("faithfulness", "dense-stream", True), verdict("faithfulness", "packet", False),
                             verdict("acquisition", "packet", True, value=0.15),
                             verdict("runtime", "packet", False, phase="decode", value=1.4),
                             verdict("runtime", "packet", True, phase="prefill", value=0.8)])
    store.finish_attempt(a21, status="done", archive_sha256="d" * 64)

    s3 = store.create_screen(protocol_id=quick, submitter="carol")
    for attempt_id in (a11, a12):
        set_started(url, attempt_id, JAN)
    set_started(url, a21, FEB)
    return {"s1": s1, "s2": s2, "s3": s3, "a11": a11, "a12": a12, "a21": a21}


@pytest.fixture(scope="module")
def seeded(module_db_url):
    with Store(module_db_url) as store:
        store.upgrade()
        ids = seed(store, module_db_url)
        yield store, ids


def keys(rows) -> list[tuple]:
    return [(r.screen_id, r.attempt, r.plan_index) for r in rows]


# -- results -------------------------------------------------------------------------------


def test_results_without_filters_lists_every_episode_in_order(seeded):
    store, ids = seeded
    rows = store.results(ResultFilter())
    assert keys(rows) == [(ids["s1"], 1, 0), (ids["s1"], 1, 1), *[(ids["s1"], 2, i) for i in range(4)],
                          *[(ids["s2"], 1, i) for i in range(4)]]
    row = rows[5]  # screen 1, attempt 2, packet scored
    assert (row.protocol, row.protocol_sha256, row.model, row.dtype) == ("quickstart", SHA_QUICK, "../models/tiny", "float32")
    assert (row.attempt_status, row.node, row.gpu_name, row.host) == ("done", "laptop", "cpu", "laptop")
    assert (row.condition, row.role, row.status, row.h2d_bytes, row.decode_h2d_bytes) == ("packet", "scored", "ok", 330, 150)
    assert (row.peak_allocated_bytes, row.peak_sampled_bytes, row.n_tokens) == (700, None, 3)
    assert row.started_at == JAN and row.started_at.tzinfo is not None
    assert row.gate is None and row.passed is None


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (dict(protocol="big"), "s2"),
        (dict(protocol="cd3"), "s2"),  # SHA-256 prefix
        (dict(protocol="CD34"), "s2"),  # hex prefixes are case-insensitive
        (dict(protocol="quickstart"), "s1"),
        (dict(protocol="bi"), None),  # names match exactly
        (dict(model="tiny"), "s1"),
        (dict(model="OPT-1.3B"), "s2"),  # case-insensitive substring
        (dict(model="alice/models"), "s1"),  # the screen's resolved model_dir
        (dict(model="%"), None),  # LIKE wildcards are literal
        (dict(dtype="float16"), "s2"),
        (dict(machine="h200"), "s2"),
        (dict(machine="box-a"), "s2"),
        (dict(machine="LAPTOP"), "s1"),
        (dict(since=datetime(2026, 2, 1, tzinfo=UTC)), "s2"),
        (dict(until=parse_when("2026-01-10", option="--until", end=True)), "s1"),  # a bare date includes the day
        (dict(until=parse_when("2026-01-10", option="--until")), None),
        # since <= started_at < until: an attempt started at the --until instant is left out (catches
        # the planted bug "results: --until includes its instant"), one started at --since kept.
        (dict(until=FEB), "s1"),
        (dict(since=FEB), "s2"),
    ],
)
def test_results_filters_pick_screens(seeded, filters, expected):
    store, ids = seeded
    screens = {r.screen_id for r in store.results(ResultFilter(**filters))}
    assert screens == ({ids[expected]} if expected else set())


def test_results_condition_status_screen_and_limit(seeded):
    store, ids = seeded
    packet = store.results(ResultFilter(condition="packet"))
    assert {r.condition for r in packet} == {"packet"} and len(packet) == 4
    failed = store.results(ResultFilter(status="failed"))
    assert keys(failed) == [(ids["s1"], 1, 1), (ids["s2"], 1, 3)]
    assert failed[0].error == "CUDA out of memory" and failed[0].h2d_bytes == 0
    assert keys(store.results(ResultFilter(screen_id=ids["s2"], status="ok", condition="dense-stream"))) == [
        (ids["s2"], 1, 0), (ids["s2"], 1, 1)]
    assert len(store.results(ResultFilter(limit=3))) == 3
    assert store.results(ResultFilter(screen_id=ids["s3"])) == []


def test_results_with_a_gate_join_its_verdicts(seeded):
    store, ids = seeded
    rows = store.results(ResultFilter(gate="faithfulness"))
    # The failed first attempt has no verdicts, so its episodes are left out.
    assert {(r.screen_id, r.attempt) for r in rows} == {(ids["s1"], 2), (ids["s2"], 1)}
    assert all(r.gate == "faithfulness" and r.phase == "all" for r in rows)
    failed = store.results(ResultFilter(gate="faithfulness", passed=False))
    assert keys(failed) == [(ids["s2"], 1, 2), (ids["s2"], 1, 3)]
    assert {(r.condition, r.passed, r.threshold) for r in failed} == {("packet", False, 0.5)}
    runtime = store.results(ResultFilter(gate="runtime"))  # one row per episode, its phases folded
    assert [(r.plan_index, r.phase, r.passed, r.value) for r in runtime] == [
        (2, "prefill+decode", False, None), (3, "prefill+decode", False, None)]
    decode = store.results(ResultFilter(gate="runtime", phase="decode"))
    assert [(r.plan_index, r.phase, r.passed, r.value) for r in decode] == [(2, "decode", False, 1.4),
                                                                           (3, "decode", False, 1.4)]
    assert store.results(ResultFilter(gate="runtime", phase="prefill", passed=False)) == []
    assert store.results(ResultFilter(gate="capacity")) == []
    # The verdicts list no episodes: they cover the scored ones, so screen 1's packet warmup
    # (plan index 2) carries no acquisition verdict.
    acquisition = store.results(ResultFilter(gate="acquisition", passed=True, dtype="float32"))
    assert [(r.plan_index, r.role) for r in acquisition] == [(3, "scored")]
    assert len(store.results(ResultFilter(gate="acquisition", limit=2))) == 2
    with pytest.raises(InvalidFilter, match="give --gate too"):
        ResultFilter(phase="decode")


def test_results_passed_or_failed_without_a_gate(seeded):
    store, ids = seeded
    passed = store.results(ResultFilter(passed=True))
    # Every verdict of the condition passed: all of screen 1 attempt 2, dense-stream of screen 2.
    assert keys(passed) == [*[(ids["s1"], 2, i) for i in range(4)], (ids["s2"], 1, 0), (ids["s2"], 1, 1)]
    assert keys(store.results(ResultFilter(passed=False))) == [(ids["s2"], 1, 2), (ids["s2"], 1, 3)]


def test_unknown_gate_or_status_is_refused_before_any_query():
    with pytest.raises(InvalidFilter) as info:
        ResultFilter(gate="speed")
    message = str(info.value)
    assert "\n" not in message and "'speed'" in message
    issue_gates = ("faithfulness", "resources", "capacity", "acquisition", "runtime", "useful_latency", "fidelity")
    assert set(GATES) == set(issue_gates) and all(gate in message for gate in GATES)
    with pytest.raises(InvalidFilter, match="ok, failed"):
        ResultFilter(status="done")
    with pytest.raises(InvalidFilter, match="float32, float16, bfloat16"):
        ResultFilter(dtype="fp16")
    with pytest.raises(InvalidFilter, match="not before"):
        ResultFilter(since=FEB, until=JAN)
    with pytest.raises(InvalidFilter, match="naive"):
        ResultFilter(since=datetime(2026, 1, 1))
    assert isinstance(InvalidFilter("x"), ValueError)


# -- screens -------------------------------------------------------------------------------


def test_list_screens_newest_first_with_latest_attempt_verdicts(seeded):
    store, ids = seeded
    rows = store.list_screens()
    assert [(r.id, r.protocol, r.status, r.attempts, r.latest_status, r.passed, r.failed) for r in rows] == [
        (ids["s3"], "quickstart", "queued", 0, None, 0, 0),
        (ids["s2"], "big", "done", 1, "done", 3, 2),
        (ids["s1"], "quickstart", "done", 2, "done", 3, 0),
    ]
    assert rows[0].created_at.tzinfo is not None and rows[1].submitter == "bob"
    assert [r.id for r in store.list_screens(status="queued")] == [ids["s3"]]
    assert [r.id for r in store.list_screens(protocol="ab12")] == [ids["s3"], ids["s1"]]
    assert [r.id for r in store.list_screens(limit=1)] == [ids["s3"]]
    with pytest.raises(InvalidFilter, match="queued, running, done, failed, cancelled"):
        store.list_screens(status="ok")


def test_screen_detail_keeps_failed_attempts(seeded):
    store, ids = seeded
    detail = store.screen_detail(ids["s1"])
    assert (detail.screen.id, detail.protocol.name, detail.protocol.model, detail.protocol.dtype) == (
        ids["s1"], "quickstart", "../models/tiny", "float32")
    first, second = detail.attempts
    assert (first.attempt.number, first.attempt.status, first.attempt.error) == (1, "failed", "worker died")
    assert (first.episodes, first.failed_episodes, first.verdicts, first.audits) == (2, 1, (), ())
    assert first.machine is not None and first.machine.host == "laptop"
    assert (second.episodes, second.failed_episodes, second.attempt.archive_sha256) == (4, 0, "e" * 64)
    assert [(v.gate, v.condition) for v in second.verdicts] == [
        ("acquisition", "packet"), ("faithfulness", "dense-stream"), ("faithfulness", "packet")]
    assert [a.result for a in second.audits] == ["agree"]
    latest = store.screen_detail("latest")
    assert latest.screen.id == ids["s3"] and latest.attempts == ()
    with pytest.raises(NotFound, match="packbench screens list"):
        store.screen_detail(999)


# -- compare -------------------------------------------------------------------------------


def test_compare_totals_ratios_and_verdicts(seeded):
    store, ids = seeded
    c = store.compare(ids["s1"], ids["s2"])
    assert (c.a.screen_id, c.a.attempt, c.a.attempt_status, c.b.protocol) == (ids["s1"], 2, "done", "big")
    m = {(p.condition, p.metric): p for p in c.metrics}
    # Scored only: warmups are not in the totals. Failed episodes are counted, not summed.
    assert (m["dense-stream", "episodes"].a, m["dense-stream", "episodes"].b) == (1, 2)
    assert (m["packet", "failed"].a, m["packet", "failed"].b, m["packet", "failed"].ratio) == (0, 1, None)
    assert (m["dense-stream", "h2d_bytes"].a, m["dense-stream", "h2d_bytes"].b) == (1100, 8800)
    assert m["dense-stream", "h2d_bytes"].ratio == 8.0
    assert (m["packet", "h2d_bytes"].a, m["packet", "h2d_bytes"].b) == (330, 660)
    assert m["dense-stream", "wall_s"].ratio == pytest.approx(4.0)
    assert isinstance(m["dense-stream", "h2d_bytes"].a, int) and isinstance(m["packet", "wall_s"].b, float)
    assert (m["packet", "peak_allocated_bytes"].a, m["packet", "peak_allocated_bytes"].b) == (700, 900)
    assert m["packet", "peak_sampled_bytes"] .ratio is None  # never sampled
    v = {(p.gate, p.condition, p.phase): p for p in c.verdicts}
    assert (v["faithfulness", "packet", "all"].a_passed, v["faithfulness", "packet", "all"].b_passed) == (True, False)
    assert (v["runtime", "packet", "decode"].a_passed, v["runtime", "packet", "decode"].b_value) == (None, 1.4)
    assert list(v) == sorted(v)


def test_compare_needs_screens_that_ran(seeded):
    store, ids = seeded
    with pytest.raises(NotFound, match="has not run yet"):
        store.compare(ids["s1"], ids["s3"])
    with pytest.raises(NotFound):
        store.compare(ids["s1"], 999)


def test_ratio():
    assert ratio(2, 3) == 1.5
    assert ratio(0, 3) is None and ratio(None, 3) is None and ratio(3, None) is None


# -- writes the queries depend on ------------------------------------------------------------


def test_put_protocol_copies_model_and_dtype(store):
    pid = store.put_protocol(sha256="a" * 64, name="q", canonical_json=body("q", "/m/tiny", "bfloat16"))
    row = store.protocol(pid)
    assert (row.model, row.dtype) == ("/m/tiny", "bfloat16")
    bare = store.protocol(store.put_protocol(sha256="b" * 64, name="bare", canonical_json="{}"))
    assert (bare.model, bare.dtype) == (None, None)
    synth = {"name": "s", "dtype": "float16", "model": {"synth": {"shape": "opt-125m", "dtype": "float16",
                                                                  "sparsity": 0.94, "seed": 0}}}
    row = store.protocol(store.put_protocol(sha256="c" * 64, name="s", canonical_json=json.dumps(synth)))
    assert (row.model, row.dtype) == ("synth:opt-125m", "float16")


def test_put_episodes_is_one_idempotent_batch(store):
    pid = store.put_protocol(sha256="a" * 64, name="q", canonical_json="{}")
    attempt = start(store, store.create_screen(protocol_id=pid, submitter="x"), node="n", gpu_name="g",
                    machine_id=None)
    assert store.put_episode(attempt, episode(1, "packet")) is True
    batch = [episode(i, "packet") for i in range(5)] + [episode(3, "packet", h2d=7)]  # 1 stored, 3 repeated
    assert store.put_episodes(attempt, batch) == 4
    assert store.put_episodes(attempt, batch) == 0
    assert store.put_episodes(attempt, []) == 0
    rows = store.episodes(attempt)
    assert [e.plan_index for e in rows] == [0, 1, 2, 3, 4]
    assert rows[3].h2d_weight_bytes == 1000  # the first copy wins


# -- migration 0002 ---------------------------------------------------------------------------


def columns(url: str, table: str) -> set[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return {c["name"] for c in inspect_db(connection).get_columns(table)}
    finally:
        engine.dispose()


def test_0002_backfills_model_and_dtype_and_goes_down_with_data(db_url):
    with Store(db_url) as store:
        store.upgrade("0001_initial")
        engine = make_engine(db_url)
        try:
            with engine.begin() as connection:
                insert = text("INSERT INTO protocols (sha256, name, canonical_json, created_at) "
                              "VALUES (:sha, :name, :json, :created)")
                created = datetime(2026, 1, 1) if connection.dialect.name == "sqlite" else datetime(2026, 1, 1, tzinfo=UTC)
                connection.execute(insert, {"sha": "a" * 64, "name": "old", "json": body("old", "/m/opt-125m", "float16"),
                                            "created": created})
                connection.execute(insert, {"sha": "b" * 64, "name": "odd", "json": "[1]", "created": created})
                synth = json.dumps({"model": {"synth": {"shape": "tiny"}}, "dtype": "float32"})
                connection.execute(insert, {"sha": "c" * 64, "name": "synth", "json": synth, "created": created})
                connection.execute(text("INSERT INTO screens (protocol_id, status, repetitions, submitter, created_at) "
                                        "VALUES (1, 'queued', 1, 'x', :created)"), {"created": created})
        finally:
            engine.dispose()
        store.upgrade()
        assert (store.protocol(1).model, store.protocol(1).dtype) == ("/m/opt-125m", "float16")
        assert (store.protocol(2).model, store.protocol(2).dtype) == (None, None)
        assert (store.protocol(3).model, store.protocol(3).dtype) == ("synth:tiny", "float32")
        assert [r.screen_id for r in store.results(ResultFilter(model="opt-125m"))] == []  # no episodes, no rows
        assert [s.protocol for s in store.list_screens(protocol="old")] == ["old"]
        # Down with a screen referencing the protocol (a table rebuild would break the foreign key).
        store.downgrade("0001_initial")
        assert {"model", "dtype"}.isdisjoint(columns(db_url, "protocols"))
        store.upgrade()
        assert store.protocol(1).dtype == "float16" and store.screen(1).protocol_id == 1


def test_verdicts_and_tags_are_in_code_point_order_whatever_the_servers_collation(pg_url):
    """Bug: verdicts (gate, condition, phase) and a screen's tags were ordered by ORDER BY, which
    PostgreSQL applies under the database's collation: on a server made with en_US (or ICU 'en')
    'packet' came before 'Zeta' and 'a' before 'B', while SQLite and a C-collated server put them
    after, so `screens show`, `results`' verdict table and `screens list`'s tags differed between
    backends for the same screen. The columns here take ICU's 'en' collation, as such a server's
    would; the order must stay SQLite's."""
    with Store(pg_url) as store:
        store.upgrade()
        engine = make_engine(pg_url)
        with engine.begin() as connection:
            # ICU's 'en' where the server has ICU (Debian's PostgreSQL does), else a libc English one;
            # a server with neither cannot reorder these, and the order is still checked below
            names = {r[0] for r in connection.exec_driver_sql(
                "SELECT collname FROM pg_collation WHERE collname IN ('en-x-icu', 'und-x-icu', 'en_US.utf8')")}
            collation = next((c for c in ("en-x-icu", "und-x-icu", "en_US.utf8") if c in names), None)
            for table, column in (("verdicts", "condition"), ("screen_tags", "key")):
                if collation is not None:
                    connection.exec_driver_sql(
                        f'ALTER TABLE {table} ALTER COLUMN "{column}" TYPE varchar COLLATE "{collation}"')
        engine.dispose()
        quick = store.put_protocol(sha256=SHA_QUICK, name="quickstart", canonical_json=body("quickstart", "m", "float32"))
        machine = store.put_machine(host="laptop", gpu_name=None, driver=None, torch="2.13", cuda=None)
        screen = store.create_screen(protocol_id=quick, submitter="alice")
        attempt = start(store, screen, node="laptop", gpu_name="cpu", machine_id=machine)
        store.put_verdicts(attempt, [verdict("faithfulness", "packet", True), verdict("faithfulness", "Zeta", True),
                                     verdict("faithfulness", "dense_stream", True)])
        store.label_screen(screen, tags={"a": "1", "B": "2", "a-b": "3", "a_b": "4"})
        want = ["Zeta", "dense_stream", "packet"]
        assert [v.condition for v in store.verdicts(attempt)] == want
        (detail,) = store.screen_detail(screen).attempts
        assert [v.condition for v in detail.verdicts] == want
        assert list(store.screen_tags([screen])[screen]) == ["B", "a", "a-b", "a_b"]
