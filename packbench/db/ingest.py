"""Writes of measured results: episodes, verdicts, episodes recovered from archives, and
screens audited elsewhere (`packbench ingest`), plus the idempotent upserts they share.

Every function runs inside a transaction its caller (`Store`) opened, except the episode
writers (`insert_episode_postgresql`, `insert_episode_sqlite`), which commit one record
each on a connection the Store holds. Writes that workers may repeat are
INSERT ... ON CONFLICT (natural key) DO NOTHING: the database decides atomically whether
the key exists, so concurrent writers of one key can neither both insert nor fail.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Dialect, bindparam, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from packbench.core.outcome import sealed_status
from packbench.core.record import stored_values
from packbench.db.errors import Conflict
from packbench.db.models import SqlAttempt, SqlDispatcher, SqlEpisode, SqlMachine, SqlProtocol, SqlScreen, SqlVerdict, json_text
from packbench.db.queries import get_row
from packbench.db.queue import new_attempt_key
from packbench.db.records import AttemptRow, ReconcileTarget

EPISODE_KEY = ("attempt_id", "plan_index")
VERDICT_KEY = ("attempt_id", "gate", "condition", "phase")
MACHINE_FIELDS = ("host", "gpu_name", "driver", "torch", "cuda")
# What a reconciled row's archive members were checked against, strongest first: the sealed
# archive's manifest (SHA-256), the live writer's member table (SHA-256, what the manifest will
# hold), or an unsealed archive's zip CRC-32s alone. An attempt records the weakest it used.
RECONCILE_CHECKS = ("manifest", "writer", "crc32")


def insert_ignore(session: Session, model: type, rows: list[dict[str, Any]], key: Sequence[str]) -> int:
    """INSERT ... ON CONFLICT (key) DO NOTHING; return the number of rows inserted."""
    statement = _insert_ignore_statement(session.get_bind().dialect.name, model, tuple(key))
    # Rows go in as parameters, not `.values(rows)`: the compiled statement is then
    # cached (an uncached compile cost ~4 ms per episode), and a list runs as one
    # executemany that SQLAlchemy batches into multi-row INSERTs ("insertmanyvalues").
    parameters = rows[0] if len(rows) == 1 else rows
    return len(session.execute(statement, parameters).all())


def upsert_protocol(session: Session, *, sha256: str, name: str, canonical_json: str, now: datetime) -> int:
    """Store a frozen protocol (idempotent on `sha256`, model and dtype copied into their
    columns by `protocol_columns`); return its id."""
    values = {"sha256": sha256, "name": name, "canonical_json": canonical_json,
              **protocol_columns(canonical_json), "created_at": now}
    insert_ignore(session, SqlProtocol, [values], ["sha256"])
    return session.scalars(select(SqlProtocol.id).where(SqlProtocol.sha256 == sha256)).one()


def upsert_machine(session: Session, key: Mapping[str, str]) -> int:
    """Store a machine fingerprint (`MACHINE_FIELDS`, '' for unknown); return its id."""
    insert_ignore(session, SqlMachine, [dict(key)], list(key))
    return session.scalars(select(SqlMachine.id).filter_by(**key)).one()


# -- episodes ------------------------------------------------------------------------------


def insert_episode_postgresql(connection: Connection, row: dict[str, Any]) -> bool:
    """One episode row in its own transaction, committed here; True if it was new."""
    statement = _insert_ignore_statement("postgresql", SqlEpisode, EPISODE_KEY)
    with connection.begin():
        return len(connection.execute(statement, row).all()) == 1


def insert_episode_sqlite(connection: sqlite3.Connection, row: dict[str, Any], dialect: Dialect) -> bool:
    """One episode row in its own transaction, straight through the sqlite3 driver; True if new.

    Why: a worker acknowledges every record after its commit, so one transaction per
    record is the contract, and the target is 10,000 records in 2 s (0.2 ms each), of
    which the WAL fsync at each commit takes about 0.13 ms (synchronous FULL against
    NORMAL, 2-core dev box). With fsync taken out (synchronous=OFF), the SQLAlchemy path
    cost 0.093 ms a record (the begin event emitting BEGIN IMMEDIATE, statement cache
    lookup, parameter processing, result set-up, RETURNING); this one costs 0.036 ms,
    within 0.006 ms of the sqlite3 calls alone.

    Same statements and semantics as the PostgreSQL path and `Store.put_episodes`: BEGIN
    IMMEDIATE, INSERT ... ON CONFLICT (attempt_id, plan_index) DO NOTHING, COMMIT (fsync
    under synchronous=FULL); the row count (0 or 1, exact on SQLite) says whether the
    record was new. `connection` comes from the engine's pool, so it has the settings of
    `db.session._configure_sqlite`. On error the caller drops it, which rolls back.
    """
    sql = _sqlite_insert_ignore_sql(SqlEpisode, EPISODE_KEY, tuple(row))
    try:
        connection.execute("BEGIN IMMEDIATE")
        inserted = connection.execute(sql, row).rowcount
        connection.execute("COMMIT")
    except dialect.loaded_dbapi.Error as exc:
        # Wrapped as SQLAlchemy would (sqlite3.IntegrityError -> IntegrityError, ...) so
        # that translate_errors gives the same one-line message as on the generic path.
        raise DBAPIError.instance(sql, row, exc, dialect.loaded_dbapi.Error, dialect=dialect) from exc
    return inserted == 1


def reconcile_targets(session: Session, *, attempt_ids: Collection[int] | None, finished_since: datetime | None,
                      host: str | None = None, alive: Callable[[int, datetime], bool] | None = None
                      ) -> list[ReconcileTarget]:
    """The attempts `Store.reconcile_targets` names, each with its stored plan indexes."""
    query = select(SqlAttempt).order_by(SqlAttempt.id)
    if attempt_ids is not None:
        query = query.where(SqlAttempt.id.in_(list(attempt_ids)))
    else:
        ended = SqlAttempt.status != "running"
        if finished_since is not None:
            ended = ended & (SqlAttempt.finished_at >= finished_since)
        query = query.where(ended)
    attempts = list(session.scalars(query).all())
    if attempt_ids is None and host is not None and alive is not None:
        # Running attempts whose dispatcher on this host is gone: nobody writes their archives
        # any more (a one-shot dispatch that stopped in a database outage, a killed driver).
        orphans = session.execute(
            select(SqlAttempt, SqlDispatcher.pid, SqlDispatcher.started_at)
            .join(SqlDispatcher, SqlDispatcher.id == SqlAttempt.dispatcher_id)
            .where(SqlAttempt.status == "running", SqlDispatcher.host == host, SqlDispatcher.pid.is_not(None))
        ).all()
        attempts += [a for a, pid, started_at in orphans if not alive(pid, started_at)]
        attempts.sort(key=lambda a: a.id)
    stored: dict[int, set[int]] = {a.id: set() for a in attempts}
    ids = list(stored)
    for chunk in range(0, len(ids), 500):  # bounded IN lists
        for attempt_id, plan_index in session.execute(
            select(SqlEpisode.attempt_id, SqlEpisode.plan_index).where(SqlEpisode.attempt_id.in_(ids[chunk:chunk + 500]))
        ):
            stored[attempt_id].add(plan_index)
    return [ReconcileTarget(a.to_record(), frozenset(stored[a.id])) for a in attempts]


def put_reconciled(session: Session, attempt_id: int, records: Sequence[Mapping[str, Any]], *, check: str,
                   clock: Callable[[], datetime]) -> int:
    """Insert recovered episode rows and note it on the attempt, keeping the weakest check."""
    rows = [episode_columns(attempt_id, record) for record in records]
    attempt = get_row(session, SqlAttempt, attempt_id, "attempt", for_update=True)
    inserted = insert_ignore(session, SqlEpisode, rows, EPISODE_KEY) if rows else 0
    if inserted:
        attempt.reconciled_at = clock()
        attempt.reconciled_episodes = (attempt.reconciled_episodes or 0) + inserted
        weakest = max(RECONCILE_CHECKS.index(attempt.reconciled_check or check), RECONCILE_CHECKS.index(check))
        attempt.reconciled_check = RECONCILE_CHECKS[weakest]
    return inserted


# -- ingest --------------------------------------------------------------------------------


def ingest_attempt(session: Session, *, clock: Callable[[], datetime], protocol_sha256: str, protocol_name: str,
                   protocol_json: str, machine: Mapping[str, str | None], attempt: Mapping[str, Any],
                   episodes: list[Mapping[str, Any]], verdicts: list[Mapping[str, Any]]) -> AttemptRow:
    """`Store.ingest_attempt`'s writes (its contract is there), in the caller's transaction.
    `Conflict` if an attempt with the same archive (by SHA-256) is in the database already."""
    if session.get_bind().dialect.name == "postgresql":
        # Ingests of one archive wait for each other (SQLite's BEGIN IMMEDIATE does that already):
        # before, ingests run at once all found no attempt with its SHA-256 and each recorded it.
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"),
                        {"key": f"packbench ingest {attempt['archive_sha256']}"})
    if session.scalar(select(SqlAttempt.id).where(SqlAttempt.archive_sha256 == attempt["archive_sha256"])):
        raise Conflict(f"an attempt with archive SHA-256 {attempt['archive_sha256'][:16]}... is already "
                       f"in this database; nothing was ingested")
    now = clock()
    protocol_id = upsert_protocol(session, sha256=protocol_sha256, name=protocol_name, canonical_json=protocol_json,
                                  now=now)
    key = {k: machine.get(k) or "" for k in MACHINE_FIELDS}
    machine_id = upsert_machine(session, key)
    screen = SqlScreen(protocol_id=protocol_id, submitter=str(attempt.get("submitter") or "ingest"),
                       repetitions=1, model_dir=None, status="done", created_at=now, started_at=now,
                       finished_at=now, priority=0, max_attempts=1, attempts_used=1)
    session.add(screen)
    session.flush()
    # The driver's rule (core/outcome.py): a sealed archive whose every episode failed is a failed attempt.
    status, error = sealed_status([dict(e) for e in episodes], screen_id=screen.id)
    screen.status = status
    row = SqlAttempt(attempt_key=new_attempt_key(), screen_id=screen.id, number=1,
                     worker=str(attempt.get("worker") or "ingested"), node=str(attempt.get("node") or ""),
                     gpu_name=key["gpu_name"], gpu_index=0, machine_id=machine_id, status=status, error=error,
                     archive_path=str(attempt["archive_path"]), archive_sha256=attempt["archive_sha256"],
                     source_freeze=json_text(attempt.get("source_freeze") or {}), started_at=now,
                     finished_at=now, model_sha256=attempt.get("model_sha256"),
                     signer_key_id=attempt.get("signer_key_id"), ingested_from=str(attempt["ingested_from"]))
    session.add(row)
    session.flush()
    rows = [episode_columns(row.id, e) for e in episodes]
    if rows:
        insert_ignore(session, SqlEpisode, rows, EPISODE_KEY)
    vrows = [verdict_columns(row.id, v) for v in verdicts]
    if vrows:
        insert_ignore(session, SqlVerdict, vrows, VERDICT_KEY)
    session.flush()
    return row.to_record()


# -- statements and columns ----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _insert_ignore_statement(dialect: str, model: type, key: tuple[str, ...]):
    """INSERT ... ON CONFLICT (key) DO NOTHING RETURNING id, built once per (dialect, table)."""
    # RETURNING yields only the rows actually inserted; rowcount is not reliable for this
    # statement across drivers (psycopg reports -1).
    return _on_conflict_do_nothing(dialect, model, key).returning(model.__table__.c.id)


@functools.lru_cache(maxsize=None)
def _sqlite_insert_ignore_sql(model: type, key: tuple[str, ...], columns: tuple[str, ...]) -> str:
    """The same INSERT as SQL for the bare sqlite3 driver: named parameters for `columns`, no
    RETURNING (sqlite3's rowcount is exact). Used by `insert_episode_sqlite`."""
    values = {column: bindparam(column) for column in columns}
    statement = _on_conflict_do_nothing("sqlite", model, key).values(values)
    return str(statement.compile(dialect=sqlite.dialect(paramstyle="named")))


def _on_conflict_do_nothing(dialect: str, model: type, key: tuple[str, ...]):
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return insert(model.__table__).on_conflict_do_nothing(index_elements=list(key))


def protocol_columns(canonical_json: str) -> dict[str, str | None]:
    """`model` and `dtype` from a protocol's canonical JSON.

    `model` is model.path for a checkpoint directory, 'synth:<shape>' for a synthetic model
    (e.g. 'synth:opt-125m'), so `results --model opt-125m` finds either kind.

    Tolerant: a body without them (or not a JSON object) gives None; the protocol itself was
    validated when it was frozen. Migration 0002 backfills with a copy of this function.
    """
    try:
        body = json.loads(canonical_json)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return {"model": None, "dtype": None}
    model = body.get("model")
    if isinstance(model, dict):
        # {"path": dir} for a checkpoint on disk, {"synth": {"shape": ...}} for a synthetic one.
        synth = model.get("synth")
        model = f"synth:{synth.get('shape')}" if isinstance(synth, dict) else model.get("path")
    dtype = body.get("dtype")
    return {"model": model if isinstance(model, str) else None,
            "dtype": dtype if isinstance(dtype, str) else None}


def episode_columns(attempt_id: int, record: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a worker's episode record into `episodes` columns (`core.record` says which)."""
    return {"attempt_id": attempt_id, **stored_values(record)}


def verdict_columns(attempt_id: int, verdict: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a gate verdict into `verdicts` columns."""
    interval = verdict.get("interval")
    lo, hi = (interval[0], interval[1]) if interval is not None else (None, None)
    return {
        "attempt_id": attempt_id,
        "gate": verdict["gate"],
        "condition": verdict["condition"],
        "phase": verdict["phase"],
        "passed": bool(verdict["passed"]),
        "value": verdict.get("value"),
        "threshold": verdict.get("threshold"),
        "interval_lo": lo,
        "interval_hi": hi,
        "episodes_json": json_text(list(verdict.get("episodes") or [])),
        "detail": verdict.get("detail") or "",
    }
