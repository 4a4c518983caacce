"""The Alembic revisions are the schema: one head, equal to the models, reversible."""

from __future__ import annotations

import inspect
from datetime import datetime, timezone

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect as inspect_db
from sqlalchemy import text

from packbench.db import migrate
from packbench.db.errors import SchemaNotAtHead
from packbench.db.models import Base
from packbench.db.session import make_engine
from packbench.db.store import Store

TABLES = {"protocols", "machines", "screens", "attempts", "episodes", "verdicts", "audits", "dispatchers", "signers"}


def revisions_oldest_first() -> list[str]:
    return [script.revision for script in reversed(list(migrate.script_directory().walk_revisions()))]


def schema_diff(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return set(inspect_db(connection).get_table_names())
    finally:
        engine.dispose()


def test_there_is_exactly_one_head():
    assert len(migrate.script_directory().get_heads()) == 1
    assert Store.head() == revisions_oldest_first()[-1]


def test_every_revision_documents_why_and_can_go_down():
    for script in migrate.script_directory().walk_revisions():
        assert script.longdoc.strip(), f"{script.revision} has no docstring"
        assert "Why:" in script.longdoc, f"{script.revision}'s docstring does not say why"
        assert "op." in inspect.getsource(script.module.downgrade), (
            f"{script.revision} has an empty downgrade()"
        )


def test_history_is_newest_first_with_first_docstring_line():
    history = Store.history()
    assert [line.split(":", 1)[0] for line in history] == revisions_oldest_first()[::-1]
    assert history[-1].startswith("0001_initial: Initial schema")
    assert all("\n" not in line for line in history)


def test_upgrade_head_equals_the_models(db_url):
    with Store(db_url) as store:
        assert store.current() is None
        store.upgrade()
        assert store.current() == store.head()
    assert schema_diff(db_url) == []
    assert TABLES <= table_names(db_url)


def test_every_revision_round_trips_down_and_up(db_url):
    with Store(db_url) as store:
        previous = "base"
        for revision in revisions_oldest_first():
            store.upgrade(revision)
            store.downgrade(previous)
            assert store.current() == (None if previous == "base" else previous)
            store.upgrade(revision)
            assert store.current() == revision
            previous = revision
        assert schema_diff(db_url) == []
        store.downgrade("base")
        assert store.current() is None
        # Alembic keeps its (now empty) version table; every packbench table is gone.
        assert table_names(db_url) & TABLES == set()
        store.upgrade()
        assert schema_diff(db_url) == []


def test_postgres_schema_holds_the_version_table(pg_url):
    """The search_path schema, not `public`, gets alembic_version: tests stay isolated."""
    with Store(pg_url) as store:
        store.upgrade()
    engine = make_engine(pg_url)
    try:
        with engine.connect() as connection:
            schema = connection.execute(text("SELECT current_schema()")).scalar_one()
            where = connection.execute(
                text("SELECT table_schema FROM information_schema.tables WHERE table_name = 'alembic_version'")
            ).scalars().all()
    finally:
        engine.dispose()
    assert schema.startswith("pb_")
    assert schema in where


def assert_refused(store: Store, *fragments: str) -> None:
    with pytest.raises(SchemaNotAtHead) as info:
        store.check_head()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_empty_database_is_not_at_head(db_url):
    with Store(db_url) as store:
        assert_refused(store, "`packbench db upgrade`", "none", store.head())
        # Data methods refuse too, before touching a missing table.
        with pytest.raises(SchemaNotAtHead, match="packbench db upgrade"):
            store.queued_screens()
        store.upgrade()
        store.check_head()
        assert store.queued_screens() == []


def test_old_database_is_not_at_head(db_url):
    """Every revision older than head (and base) is refused with the upgrade command."""
    with Store(db_url) as store:
        store.upgrade()
        for older in [*revisions_oldest_first()[-2::-1], "base"]:  # newest first
            store.downgrade(older)
            assert_refused(store, "`packbench db upgrade`", store.head())
        store.upgrade()
        store.check_head()


def test_database_from_a_newer_packbench_is_refused(db_url):
    with Store(db_url) as store:
        store.upgrade()
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    finally:
        engine.dispose()
    with Store(db_url) as store:
        assert_refused(store, "9999_future", "a newer packbench wrote it")
        with pytest.raises(SchemaNotAtHead, match="a newer packbench wrote it"):
            store.upgrade()


def _rows(url: str, sql: str) -> list[tuple]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(text(sql))]
    finally:
        engine.dispose()


def _run(url: str, *statements: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            for statement in statements:
                connection.execute(text(statement))
    finally:
        engine.dispose()


def test_job_queue_revision_keeps_stored_attempts(db_url):
    """0004 rebuilds attempts on SQLite (a new CHECK): rows, their children and foreign keys
    survive both ways; stored attempts get keys; lost/cancelled become interrupted going down."""
    with Store(db_url) as store:
        store.upgrade("0003_screen_prompt_file")
    when = "'2026-01-01 00:00:00'"
    _run(db_url,
         f"INSERT INTO protocols (id, sha256, name, canonical_json, created_at) VALUES (1, '{'a' * 64}', 'p', '{{}}', {when})",
         f"INSERT INTO screens (id, protocol_id, status, repetitions, submitter, created_at) VALUES (1, 1, 'done', 1, 'x', {when})",
         *(f"INSERT INTO attempts (id, screen_id, number, worker, node, gpu_name, gpu_index, status, archive_path, "
           f"source_freeze, started_at) VALUES ({i}, 1, {i}, 'w', 'n', 'g', 0, '{s}', 'a{i}.zip', '{{}}', {when})"
           for i, s in ((1, "failed"), (2, "done"))),
         "INSERT INTO episodes (attempt_id, plan_index, condition, role, prompt, status, tokens_json, n_tokens, "
         "wall_s, call_s, h2d_weight_bytes, h2d_index_bytes, d2h_bytes, prefill_h2d_bytes, decode_h2d_bytes, "
         "prefill_call_s, decode_call_s) VALUES (2, 0, 'c', 'scored', 0, 'ok', '[]', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)",
         f"INSERT INTO audits (attempt_id, archive_sha256, digest, result, problems_json, machine, started_at, "
         f"finished_at) VALUES (2, '{'d' * 64}', 'e', 'agree', '[]', 'm', {when}, {when})")
    with Store(db_url) as store:
        store.upgrade()
        attempts = store.attempts(1)
        assert [(a.number, a.status, a.archive_path) for a in attempts] == [(1, "failed", "a1.zip"), (2, "done", "a2.zip")]
        assert len({a.attempt_key for a in attempts}) == 2 and all(len(a.attempt_key) == 32 for a in attempts)
        assert len(store.episodes(2)) == 1 and len(store.audits(2)) == 1
        screen = store.screen(1)
        assert (screen.priority, screen.max_attempts, screen.attempts_used, screen.exclusive_node) == (0, 3, 0, False)
        _run(db_url, "UPDATE attempts SET status = 'lost' WHERE id = 1")
        store.downgrade("0003_screen_prompt_file")
    assert _rows(db_url, "SELECT id, status FROM attempts ORDER BY id") == [(1, "interrupted"), (2, "done")]
    assert _rows(db_url, "SELECT count(*) FROM episodes") == [(1,)]
    # The old CHECK is back: the old statuses only.
    with pytest.raises(Exception):
        _run(db_url, "UPDATE attempts SET status = 'lost' WHERE id = 1")
    if db_url.startswith("sqlite"):
        assert _rows(db_url, "PRAGMA foreign_key_check") == []
    with Store(db_url) as store:
        store.upgrade()
    assert schema_diff(db_url) == []
    if db_url.startswith("sqlite"):
        assert _rows(db_url, "PRAGMA foreign_key_check") == []
        # The episode still references its attempt through a working foreign key.
        with pytest.raises(Exception):
            _run(db_url, "DELETE FROM attempts WHERE id = 2")


def test_partial_audits_revision_widens_the_result_and_goes_down_as_disagree(db_url):
    """0011: an audit may say `partial`; going down it becomes the `disagree` the older revision
    wrote for it, and the old CHECK refuses `partial` again."""
    with Store(db_url) as store:
        store.upgrade()
    when = "'2026-01-01 00:00:00'"
    _run(db_url,
         f"INSERT INTO protocols (id, sha256, name, canonical_json, created_at) VALUES (1, '{'a' * 64}', 'p', '{{}}', {when})",
         f"INSERT INTO screens (id, protocol_id, status, repetitions, submitter, created_at) VALUES (1, 1, 'queued', 1, 'x', {when})",
         f"INSERT INTO attempts (id, screen_id, number, worker, node, gpu_name, gpu_index, status, archive_path, "
         f"source_freeze, started_at, attempt_key) VALUES (1, 1, 1, 'w', 'n', 'g', 0, 'interrupted', 'a1.zip', '{{}}', "
         f"{when}, '{'k' * 32}')",
         *(f"INSERT INTO audits (attempt_id, archive_sha256, digest, result, problems_json, machine, started_at, "
           f"finished_at) VALUES (1, '{'d' * 64}', 'e', '{r}', '[]', 'm', {when}, {when})" for r in ("partial", "agree")))
    with pytest.raises(Exception):
        _run(db_url, f"INSERT INTO audits (attempt_id, archive_sha256, digest, result, problems_json, machine, "
                     f"started_at, finished_at) VALUES (1, '{'d' * 64}', 'e', 'maybe', '[]', 'm', {when}, {when})")
    with Store(db_url) as store:
        assert [u.result for u in store.audits(1)] == ["partial", "agree"]
        store.downgrade("0010_screen_labels")
    assert _rows(db_url, "SELECT result FROM audits ORDER BY id") == [("disagree",), ("agree",)]
    with pytest.raises(Exception):
        _run(db_url, "UPDATE audits SET result = 'partial' WHERE id = 1")
    with Store(db_url) as store:
        store.upgrade()
    assert schema_diff(db_url) == []


def test_unhashed_audits_revision_stores_a_null_sha_and_refuses_to_go_down_over_one(db_url):
    """0012: an audit of an archive over the size bound is stored with a null SHA-256 (0011's NOT
    NULL lost it); going down refuses while such a row exists, keeps every row, and goes down once
    it is gone, with NOT NULL back."""
    with Store(db_url) as store:
        store.upgrade()
    when = "'2026-01-01 00:00:00'"
    _run(db_url,
         f"INSERT INTO protocols (id, sha256, name, canonical_json, created_at) VALUES (1, '{'a' * 64}', 'p', '{{}}', {when})",
         f"INSERT INTO screens (id, protocol_id, status, repetitions, submitter, created_at) VALUES (1, 1, 'queued', 1, 'x', {when})",
         f"INSERT INTO attempts (id, screen_id, number, worker, node, gpu_name, gpu_index, status, archive_path, "
         f"source_freeze, started_at, attempt_key) VALUES (1, 1, 1, 'w', 'n', 'g', 0, 'done', 'a1.zip', '{{}}', "
         f"{when}, '{'k' * 32}')")
    with Store(db_url) as store:  # through the store, as `packbench audit` records it
        now = datetime.now(timezone.utc)
        store.put_audit(attempt_id=1, archive_sha256=None, digest="e", result="disagree",
                        problems=["a1.zip is over the bound"], machine="m", started_at=now, finished_at=now)
        store.put_audit(attempt_id=1, archive_sha256="d" * 64, digest="e", result="agree", problems=[],
                        machine="m", started_at=now, finished_at=now)
        # Catches a model or AuditRow that lost the null or the order.
        assert [(u.archive_sha256, u.result, u.problems) for u in store.audits(1)] == [
            (None, "disagree", ("a1.zip is over the bound",)), ("d" * 64, "agree", ())]
        with pytest.raises(Exception, match="1 audit"):  # catches a downgrade that invents a hash or drops the row
            store.downgrade("0011_partial_audits")
    assert _rows(db_url, "SELECT archive_sha256 FROM audits ORDER BY id") == [(None,), ("d" * 64,)]
    with Store(db_url) as store:
        assert store.current() == store.head()  # the refused downgrade moved nothing
    _run(db_url, "DELETE FROM audits WHERE archive_sha256 IS NULL")
    with Store(db_url) as store:
        store.downgrade("0011_partial_audits")
    with pytest.raises(Exception):  # the old NOT NULL is back
        _run(db_url, f"INSERT INTO audits (attempt_id, archive_sha256, digest, result, problems_json, machine, "
                     f"started_at, finished_at) VALUES (1, NULL, 'e', 'agree', '[]', 'm', {when}, {when})")
    with Store(db_url) as store:
        store.upgrade()
    assert schema_diff(db_url) == []


def test_upgrade_returns_the_revision_it_found_under_the_lock(db_url):
    """What `db upgrade --json` reports as `from`: the revision the migration started at, not one
    read before another store migrated the schema."""
    with Store(db_url) as late, Store(db_url) as early:
        assert late.current() is None
        assert early.upgrade("0010_screen_labels") is None
        assert late.upgrade() == "0010_screen_labels"
        assert late.upgrade() == migrate.head()


def test_upgrades_run_at_once_all_succeed_and_migrate_once(db_url):
    """Bug caught (PostgreSQL): `packbench db upgrade` run by several processes at once on an empty
    schema: each created the tables in its own transaction, and the losers failed with a
    duplicate-key error that called itself a packbench bug (`refused a write that breaks a
    constraint ... this is a packbench bug`). They now wait for each other and all succeed.

    Bug caught too: each `--json` said `"from": null`, the revision it read before waiting for the
    others, though only one of them migrated; `from` is now read under the migration lock."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "PACKBENCH_DB_URL": db_url}
    procs = [subprocess.Popen([sys.executable, "-m", "packbench", "db", "upgrade", "--json"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    ran = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [r[0] for r in ran] == [0] * 4, ran
    assert all(err == "" for _, _, err in ran), ran
    said = [json.loads(out) for _, out, _ in ran]
    assert all(s["revision"] == s["head"] == migrate.head() for s in said), said
    assert sorted(s["from"] is None for s in said) == [False, False, False, True], said  # one migrated
    assert all(s["from"] in (None, migrate.head()) for s in said), said
    with Store(db_url) as store:
        store.check_head()
    assert schema_diff(db_url) == []


def test_revoked_signers_revision_keeps_every_key_and_refuses_to_go_down_over_a_revoked_one(db_url):
    """0013: keys registered at 0012 come up in force (revoked_at NULL), a revocation is stored,
    and going down refuses while a key is revoked (the older revision would trust it again
    without a word), keeping every row; once it is gone, down and up again."""
    with Store(db_url) as store:
        store.upgrade("0012_unhashed_audits")
    when = "'2026-01-01 00:00:00'"
    _run(db_url, *(f"INSERT INTO signers (id, key_id, public_key, name, local, created_at) VALUES "
                   f"({i}, '{c * 16}', '{c * 64}', 'lab {i}', false, {when})" for i, c in ((1, "a"), (2, "b"))))
    with Store(db_url) as store:
        store.upgrade()
        assert [(s.key_id, s.revoked_at) for s in store.signers()] == [("a" * 16, None), ("b" * 16, None)]
        row, revoking = store.revoke_signer("b" * 16)
        assert revoking and row.revoked_at is not None
        assert store.revoke_signer("b" * 16) == (row, False)  # the first revocation time is kept
        with pytest.raises(Exception, match="1 revoked signing key"):
            store.downgrade("0012_unhashed_audits")
    assert _rows(db_url, "SELECT key_id, revoked_at IS NOT NULL FROM signers ORDER BY id") == [
        ("a" * 16, False), ("b" * 16, True)]
    _run(db_url, "DELETE FROM signers WHERE revoked_at IS NOT NULL")
    with Store(db_url) as store:
        store.downgrade("0012_unhashed_audits")
        assert store.current() == "0012_unhashed_audits"
        store.upgrade()
    assert schema_diff(db_url) == []
