"""The database failing under a dispatcher: transient failures are retried with backoff,
a database that stays down gives one line saying how to recover. PostgreSQL only: SQLite
has no server to lose (its lock waits are the busy timeout's job)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from packbench.db.errors import DatabaseUnavailable
from packbench.db.session import is_transient
from packbench.db.store import Store

FREEZE = {"git": "abc"}


def named(url: str) -> tuple[str, str]:
    """`url` with a unique application_name, so that only this test's connections are killed
    (the server is shared)."""
    name = f"pb_fault_{uuid.uuid4().hex[:12]}"
    return make_url(url).update_query_dict({"application_name": name}).render_as_string(hide_password=False), name


def terminate(base: str, application_name: str) -> int:
    admin = create_engine(base, poolclass=NullPool)
    try:
        with admin.begin() as connection:
            return len(connection.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"),
                {"n": application_name}).all())
    finally:
        admin.dispose()


def test_a_killed_connection_is_retried(pg_url, pg_server_url):
    url, name = named(pg_url)
    with Store(url, retry_delays=(0.05, 0.1, 0.2)) as store:
        store.upgrade()
        protocol = store.put_protocol(sha256="a" * 64, name="p", canonical_json="{}")
        screen = store.create_screen(protocol_id=protocol, submitter="a")
        dispatcher = store.register_dispatcher("d", "h")
        claim = store.claim_screen(dispatcher, lease_s=60, archive_dir="a", source_freeze=FREEZE)
        record = {"plan_index": 0, "condition": "c", "role": "scored", "prompt": 0, "status": "ok"}
        assert store.put_episode(claim.attempt.id, record) is True
        # The server drops every connection of this store (as a restart would), including
        # the episode writer's held one: the next writes fail mid-transaction, then retry.
        assert terminate(pg_server_url, name) >= 1
        assert store.put_episode(claim.attempt.id, dict(record, plan_index=1)) is True
        assert terminate(pg_server_url, name) >= 1
        assert store.renew_lease(claim.attempt.id, 60) is True
        assert [e.plan_index for e in store.episodes(claim.attempt.id)] == [0, 1]
        assert store.screen(screen).status == "running"


def test_transient_failures_inside_a_claim_are_retried_once_committed(pg_url):
    """Two claim transactions fail on the wire; the third commits. Exactly one attempt exists."""
    with Store(pg_url, retry_delays=(0.01, 0.01, 0.01)) as store:
        store.upgrade()
        protocol = store.put_protocol(sha256="a" * 64, name="p", canonical_json="{}")
        screen = store.create_screen(protocol_id=protocol, submitter="a")
        dispatcher = store.register_dispatcher("d", "h")
        import psycopg

        failures = {"left": 2}

        @event.listens_for(store._engine, "before_cursor_execute")
        def fail(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
            if "INSERT INTO attempts" in statement and failures["left"]:
                failures["left"] -= 1
                raise psycopg.OperationalError("server closed the connection unexpectedly")

        claim = store.claim_screen(dispatcher, lease_s=60, archive_dir="a", source_freeze=FREEZE)
        assert failures["left"] == 0 and claim.screen.id == screen
        assert [(a.number, a.status) for a in store.attempts(screen)] == [(1, "running")]
        assert store.screen(screen).attempts_used == 1  # the failed tries rolled back


def test_a_database_that_stays_down_names_the_recovery():
    store = Store("postgresql+psycopg://postgres@127.0.0.1:1/test", retry_delays=(0.01, 0.02))
    with pytest.raises(DatabaseUnavailable) as info:
        store.claim_screen(1, lease_s=60, archive_dir="a", source_freeze=FREEZE)
    message = str(info.value)
    assert "\n" not in message
    assert "connection refused" in message and "gave up on claim_screen after 3 tries" in message
    assert "run the command again" in message and "requeued" in message


def test_what_is_transient():
    import sqlite3

    import psycopg
    from psycopg import errors

    assert is_transient(psycopg.OperationalError("connection failed: Connection refused"))
    assert is_transient(errors.AdminShutdown("terminating connection due to administrator command"))
    assert is_transient(errors.SerializationFailure("could not serialize access"))
    assert not is_transient(errors.UndefinedTable("relation does not exist"))
    assert not is_transient(errors.UniqueViolation("duplicate key"))
    assert not is_transient(psycopg.OperationalError('connection failed: FATAL:  role "x" does not exist'))
    assert not is_transient(sqlite3.OperationalError("database is locked"))
