"""`Store`: every read and write packbench makes to its database.

Contract
- Each public method is one transaction (`session_scope`) and returns plain data: ids or
  frozen dataclasses from `db.records`, never ORM objects.
- Database failures raise `DatabaseError` (one line: cause and fix). A missing screen,
  attempt or protocol raises `NotFound`; a request that would overwrite history raises
  `Conflict`.
- Data methods refuse a database whose schema is not at head (`SchemaNotAtHead`, naming
  `packbench db upgrade`); the check runs once per `Store`. The schema methods (`upgrade`,
  `current`, `history`, `head`, `check_head`) work on any database.
- Writes that workers may repeat (episodes, verdicts, protocols, machines) are idempotent
  upserts on their natural key, safe under concurrent writers on both backends.
- Queries for the CLI (`results`, `list_screens`, `screen_detail`, `compare`) live in
  `db.queries`; the methods here give each one transaction.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, func, select, text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from db import migrate, queries
from db.errors import Conflict, NotFound, SchemaNotAtHead
from db.models import (
    Attempt,
    Audit,
    Episode,
    Machine,
    Protocol,
    Screen,
    Verdict,
    json_text,
    utcnow,
)
from db.queries import Comparison, ResultFilter, ResultRow, ScreenDetail, ScreenSummary
from db.records import (
    AttemptRow,
    AuditRow,
    EpisodeRow,
    MachineRow,
    ProtocolRow,
    ScreenRow,
    VerdictRow,
)
from db.session import display_url, make_engine, session_scope, translate_errors

# finish_attempt: the screen status that each final attempt status leads to.
_SCREEN_STATUS_AFTER = {"done": "done", "failed": "failed", "interrupted": "failed"}


class Store:
    """The packbench database at `url` (default: `db.session.default_url()`).

    Creating a Store does not connect; the first method call does. Call `close()` (or use
    it as a context manager) to release pooled connections.
    """

    def __init__(self, url: str | None = None) -> None:
        self._engine: Engine = make_engine(url)
        self._schema_checked = False
        # The episode writer's own connection, held between records: checking a connection
        # out of the pool and resetting it on return cost more than the insert and its commit
        # (0.41 against 0.21 ms a record on SQLite). Dropped on any error, reopened on demand.
        # SQLite holds the bare driver connection (see `_put_episode_sqlite`), PostgreSQL a
        # SQLAlchemy one; only one of the two is ever set.
        self._writer: Connection | None = None
        self._sqlite_writer: PoolProxiedConnection | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The database URL with any password hidden (safe to print)."""
        return display_url(self._engine.url)

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self._engine.dialect.name

    def close(self) -> None:
        self._drop_writer()
        self._engine.dispose()

    def _drop_writer(self) -> None:
        """Release the episode writer's connection; the pool rolls back an open transaction."""
        writer, self._writer = self._writer, None
        sqlite_writer, self._sqlite_writer = self._sqlite_writer, None
        for connection in (writer, sqlite_writer):
            if connection is not None:
                try:
                    connection.close()
                except (SQLAlchemyError, self._engine.dialect.loaded_dbapi.Error):
                    pass  # it is being dropped because it failed

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- schema ------------------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> None:
        """Migrate the schema to `revision` (default: head) in one transaction."""
        with self._connection() as connection:
            current = migrate.current(connection)
            if current is not None and current not in migrate.known_revisions():
                raise SchemaNotAtHead(self._unknown_revision_message(current))
            migrate.upgrade(connection, revision)
        self._schema_checked = False

    def downgrade(self, revision: str) -> None:
        """Migrate the schema down to `revision` ('base' drops every table). For developers."""
        with self._connection() as connection:
            migrate.downgrade(connection, revision)
        self._schema_checked = False

    def current(self) -> str | None:
        """The revision the database is at, or None if it has no packbench schema."""
        with self._connection() as connection:
            return migrate.current(connection)

    @staticmethod
    def history() -> list[str]:
        """Shipped revisions, newest first, as 'revision: first docstring line'."""
        return migrate.history()

    @staticmethod
    def head() -> str:
        """The revision this packbench needs."""
        return migrate.head()

    def check_head(self) -> None:
        """Raise `SchemaNotAtHead` unless the database is at `head()`; an empty one is not."""
        current, head = self.current(), self.head()
        if current == head:
            self._schema_checked = True
            return
        if current is None:
            raise SchemaNotAtHead(
                f"database {self.url} has no packbench schema (revision none, need {head}); "
                f"run `packbench db upgrade`"
            )
        if current not in migrate.known_revisions():
            raise SchemaNotAtHead(self._unknown_revision_message(current))
        raise SchemaNotAtHead(
            f"database {self.url} is at revision {current} but this packbench needs {head}; "
            f"run `packbench db upgrade`"
        )

    def _unknown_revision_message(self, current: str) -> str:
        return (
            f"database {self.url} is at revision {current}, which this packbench does not know "
            f"(its newest is {self.head()}); a newer packbench wrote it: install that version"
        )

    # -- protocols and machines --------------------------------------------------------

    def put_protocol(self, *, sha256: str, name: str, canonical_json: str) -> int:
        """Store a frozen protocol; return its id. Idempotent on `sha256`.

        The model and dtype are copied from `canonical_json` into their own columns for the
        query filters (see `protocol_columns`; None where the JSON lacks them).
        """
        with self._session() as session:
            values = {"sha256": sha256, "name": name, "canonical_json": canonical_json,
                      **protocol_columns(canonical_json), "created_at": utcnow()}
            self._insert_ignore(session, Protocol, [values], ["sha256"])
            return session.scalars(select(Protocol.id).where(Protocol.sha256 == sha256)).one()

    def protocol(self, protocol_id: int) -> ProtocolRow:
        with self._session() as session:
            return self._get(session, Protocol, protocol_id, "protocol").to_record()

    def put_machine(
        self,
        *,
        host: str | None,
        gpu_name: str | None,
        driver: str | None,
        torch: str | None,
        cuda: str | None,
    ) -> int:
        """Store a machine fingerprint; return its id. Idempotent; None and '' are the same."""
        key = {"host": host or "", "gpu_name": gpu_name or "", "driver": driver or "",
               "torch": torch or "", "cuda": cuda or ""}
        with self._session() as session:
            self._insert_ignore(session, Machine, [key], list(key))
            query = select(Machine.id).filter_by(**key)
            return session.scalars(query).one()

    def machine(self, machine_id: int) -> MachineRow:
        with self._session() as session:
            return self._get(session, Machine, machine_id, "machine").to_record()

    # -- screens -----------------------------------------------------------------------

    def create_screen(
        self,
        *,
        protocol_id: int,
        submitter: str,
        repetitions: int = 1,
        model_dir: str | None = None,
        prompt_file: str | None = None,
    ) -> int:
        """Queue a new screen of a stored protocol; return its id.

        `model_dir` is the checkpoint directory resolved at submit time, kept so that every
        attempt loads the same one (None for a synthetic model, generated on the worker);
        `prompt_file` likewise for a token_file/text_file prompt source.
        """
        with self._session() as session:
            self._get(session, Protocol, protocol_id, "protocol")
            screen = Screen(
                protocol_id=protocol_id,
                submitter=submitter,
                repetitions=repetitions,
                model_dir=model_dir,
                prompt_file=prompt_file,
                status="queued",
                created_at=utcnow(),
            )
            session.add(screen)
            session.flush()
            return screen.id

    def queued_screens(self) -> list[ScreenRow]:
        """Screens waiting for a worker, oldest first."""
        with self._session() as session:
            query = select(Screen).where(Screen.status == "queued").order_by(Screen.id)
            return [screen.to_record() for screen in session.scalars(query)]

    def screen(self, ref: int | str) -> ScreenRow:
        """The screen with id `ref` (an int or a string of digits), or 'latest' (highest id)."""
        with self._session() as session:
            return queries.find_screen(session, ref).to_record()

    # -- attempts ----------------------------------------------------------------------

    def start_attempt(
        self,
        *,
        screen_id: int,
        worker: str,
        node: str,
        gpu_name: str,
        gpu_index: int,
        machine_id: int | None,
        source_freeze: dict[str, Any],
        archive_path: str,
    ) -> AttemptRow:
        """Record that a worker starts on a screen; return the new running attempt.

        Its number is 1 + the highest existing number for the screen (earlier attempts,
        failed ones included, are kept). The screen becomes 'running'; its started_at is
        set on the first attempt only.
        """
        with self._session() as session:
            # FOR UPDATE (PostgreSQL) serializes concurrent starts on one screen, so two
            # attempts cannot both compute the same number. SQLite's BEGIN IMMEDIATE already
            # serializes every write transaction.
            screen = self._get(session, Screen, screen_id, "screen", for_update=True)
            last = session.scalar(
                select(func.max(Attempt.number)).where(Attempt.screen_id == screen_id)
            )
            now = utcnow()
            attempt = Attempt(
                screen_id=screen_id,
                number=(last or 0) + 1,
                worker=worker,
                node=node,
                gpu_name=gpu_name,
                gpu_index=gpu_index,
                machine_id=machine_id,
                status="running",
                archive_path=archive_path,
                source_freeze=json_text(source_freeze),
                started_at=now,
            )
            session.add(attempt)
            screen.status = "running"
            if screen.started_at is None:
                screen.started_at = now
            session.flush()
            return attempt.to_record()

    def finish_attempt(
        self,
        attempt_id: int,
        *,
        status: str,
        error: str | None = None,
        archive_sha256: str | None = None,
    ) -> None:
        """Close a running attempt as 'done', 'failed' or 'interrupted'.

        The screen follows: 'done' for a done attempt, 'failed' otherwise; its finished_at
        is set. Finishing an attempt that is not running raises `Conflict`: a finished
        attempt is history and is never overwritten.
        """
        if status not in _SCREEN_STATUS_AFTER:
            raise ValueError(f"attempt status {status!r} is not one of {sorted(_SCREEN_STATUS_AFTER)}")
        with self._session() as session:
            attempt = self._get(session, Attempt, attempt_id, "attempt", for_update=True)
            if attempt.status != "running":
                raise Conflict(
                    f"attempt {attempt_id} is already {attempt.status}; finished attempts are "
                    f"kept as they are: start a new attempt instead"
                )
            now = utcnow()
            attempt.status = status
            attempt.error = error
            attempt.archive_sha256 = archive_sha256
            attempt.finished_at = now
            screen = session.get_one(Screen, attempt.screen_id, with_for_update=True)
            screen.status = _SCREEN_STATUS_AFTER[status]
            screen.finished_at = now

    def attempts(self, screen_id: int) -> list[AttemptRow]:
        """The screen's attempts, by number."""
        with self._session() as session:
            query = select(Attempt).where(Attempt.screen_id == screen_id).order_by(Attempt.number)
            return [attempt.to_record() for attempt in session.scalars(query)]

    def latest_attempt(self, screen_id: int) -> AttemptRow | None:
        """The screen's highest-numbered attempt, or None if it never started."""
        with self._session() as session:
            query = (
                select(Attempt)
                .where(Attempt.screen_id == screen_id)
                .order_by(Attempt.number.desc())
                .limit(1)
            )
            attempt = session.scalars(query).first()
            return attempt.to_record() if attempt is not None else None

    # -- episodes and verdicts ---------------------------------------------------------

    def put_episode(self, attempt_id: int, record: Mapping[str, Any]) -> bool:
        """Store one episode record as a worker sent it; True if new, False if already stored.

        Idempotent on (attempt_id, plan_index): a re-sent record changes nothing (the first
        copy wins). Required keys: plan_index, condition, role, prompt, status. Everything
        else may be missing (a failed episode): counters become 0, peaks None, tokens [].
        Keys not stored (e.g. 'calls') are ignored; the raw archive keeps them.
        """
        row = _episode_columns(attempt_id, record)
        if not self._schema_checked:
            self.check_head()
        with translate_errors(self._engine.url):
            try:
                if self._engine.dialect.name == "sqlite":
                    return self._put_episode_sqlite(row)
                if self._writer is None:
                    self._writer = self._engine.connect()
                statement = _insert_ignore_statement("postgresql", Episode, ("attempt_id", "plan_index"))
                with self._writer.begin():  # one transaction per record, committed here
                    return len(self._writer.execute(statement, row).all()) == 1
            except BaseException:
                self._drop_writer()  # a failed transaction is rolled back as the pool takes it
                raise

    def _put_episode_sqlite(self, row: dict[str, Any]) -> bool:
        """`put_episode` on SQLite, straight through the sqlite3 driver.

        Why: a worker acknowledges every record after its commit, so one transaction per
        record is the contract, and the target is 10,000 records in 2 s (0.2 ms each), of
        which the WAL fsync at each commit takes about 0.13 ms (synchronous FULL against
        NORMAL, 2-core dev box). With fsync taken out (synchronous=OFF), the SQLAlchemy path
        cost 0.093 ms a record (the begin event emitting BEGIN IMMEDIATE, statement cache
        lookup, parameter processing, result set-up, RETURNING); this one costs 0.036 ms,
        within 0.006 ms of the sqlite3 calls alone.

        Same statements and semantics as the PostgreSQL path and `put_episodes`: BEGIN
        IMMEDIATE, INSERT ... ON CONFLICT (attempt_id, plan_index) DO NOTHING, COMMIT (fsync
        under synchronous=FULL); the row count (0 or 1, exact on SQLite) says whether the
        record was new. The connection comes from the engine's pool, so it has the settings
        of `db.session._configure_sqlite`. On error the caller drops it, which rolls back.
        """
        if self._sqlite_writer is None:
            self._sqlite_writer = self._engine.raw_connection()
        connection = self._sqlite_writer.dbapi_connection  # a sqlite3.Connection
        sql = _sqlite_insert_ignore_sql(Episode, ("attempt_id", "plan_index"), tuple(row))
        try:
            connection.execute("BEGIN IMMEDIATE")
            inserted = connection.execute(sql, row).rowcount
            connection.execute("COMMIT")
        except self._engine.dialect.loaded_dbapi.Error as exc:
            # Wrapped as SQLAlchemy would (sqlite3.IntegrityError -> IntegrityError, ...) so
            # that translate_errors gives the same one-line message as on the generic path.
            raise DBAPIError.instance(
                sql, row, exc, self._engine.dialect.loaded_dbapi.Error,
                dialect=self._engine.dialect,
            ) from exc
        return inserted == 1

    def put_episodes(self, attempt_id: int, records: Iterable[Mapping[str, Any]]) -> int:
        """Store many episode records in ONE transaction; return how many were new.

        Same idempotence as `put_episode` (a stored or repeated plan_index is skipped). For
        bulk loads (imports, benchmarks): a worker streaming results calls `put_episode`, so
        each record is durable the moment it is acknowledged.
        """
        rows = [_episode_columns(attempt_id, record) for record in records]
        if not rows:
            return 0
        with self._session() as session:
            return self._insert_ignore(session, Episode, rows, ["attempt_id", "plan_index"])

    def episodes(self, attempt_id: int) -> list[EpisodeRow]:
        """The attempt's episodes, by plan_index."""
        with self._session() as session:
            query = select(Episode).where(Episode.attempt_id == attempt_id).order_by(Episode.plan_index)
            return [episode.to_record() for episode in session.scalars(query)]

    def put_verdicts(self, attempt_id: int, verdicts: list[Mapping[str, Any]]) -> int:
        """Store gate verdicts in one transaction; return how many were new.

        Idempotent on (attempt_id, gate, condition, phase): an existing verdict is kept.
        Each verdict: gate, condition, phase, passed, value, threshold, interval ([lo, hi] or
        None), episodes (plan indexes), detail.
        """
        rows = [_verdict_columns(attempt_id, verdict) for verdict in verdicts]
        if not rows:
            return 0
        with self._session() as session:
            return self._insert_ignore(
                session, Verdict, rows, ["attempt_id", "gate", "condition", "phase"]
            )

    def verdicts(self, attempt_id: int) -> list[VerdictRow]:
        """The attempt's verdicts, ordered by (gate, condition, phase)."""
        with self._session() as session:
            query = (
                select(Verdict)
                .where(Verdict.attempt_id == attempt_id)
                .order_by(Verdict.gate, Verdict.condition, Verdict.phase)
            )
            return [verdict.to_record() for verdict in session.scalars(query)]

    # -- audits ------------------------------------------------------------------------

    def put_audit(
        self,
        *,
        attempt_id: int,
        archive_sha256: str,
        digest: str,
        result: str,
        problems: list[str],
        machine: str,
        started_at: datetime,
        finished_at: datetime,
    ) -> int:
        """Append one audit run ('agree' or 'disagree'); return its id. Never deduplicated:
        repeat audits are evidence in their own right. Times must be timezone-aware."""
        for moment in (started_at, finished_at):
            if moment.tzinfo is None:
                raise ValueError(f"naive datetime {moment!r}: pass an aware one, e.g. datetime.now(UTC)")
        with self._session() as session:
            audit = Audit(
                attempt_id=attempt_id,
                archive_sha256=archive_sha256,
                digest=digest,
                result=result,
                problems_json=json_text(list(problems)),
                machine=machine,
                started_at=started_at,
                finished_at=finished_at,
            )
            session.add(audit)
            session.flush()
            return audit.id

    def audits(self, attempt_id: int) -> list[AuditRow]:
        """The attempt's audit runs, oldest first."""
        with self._session() as session:
            query = select(Audit).where(Audit.attempt_id == attempt_id).order_by(Audit.id)
            return [audit.to_record() for audit in session.scalars(query)]

    # -- queries (db.queries) ------------------------------------------------------------

    def results(self, filters: ResultFilter) -> list[ResultRow]:
        """Episodes matching `filters` (see `ResultFilter`), with screen, attempt, protocol."""
        with self._session() as session:
            return queries.results(session, filters)

    def list_screens(
        self, *, status: str | None = None, protocol: str | None = None, limit: int | None = None
    ) -> list[ScreenSummary]:
        """Screens, newest first, with attempt counts and their latest attempt's verdicts."""
        with self._session() as session:
            return queries.list_screens(session, status=status, protocol=protocol, limit=limit)

    def screen_detail(self, ref: int | str) -> ScreenDetail:
        """A screen (id or 'latest') with every attempt's verdicts, audits and episode counts."""
        with self._session() as session:
            return queries.screen_detail(session, ref)

    def compare(self, ref_a: int | str, ref_b: int | str) -> Comparison:
        """Per-condition scored totals and verdicts of two screens' latest attempts."""
        with self._session() as session:
            return queries.compare(session, ref_a, ref_b)

    def analyze(self) -> None:
        """Refresh the query planner's statistics (ANALYZE). Worth it after a bulk load;
        PostgreSQL's autovacuum does it on its own schedule otherwise."""
        with self._session() as session:
            session.execute(text("ANALYZE"))

    # -- internals ---------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """A connection in a transaction, for Alembic; errors translated."""
        with translate_errors(self._engine.url), self._engine.begin() as connection:
            yield connection

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """A session in a transaction, after making sure the schema is at head."""
        if not self._schema_checked:
            self.check_head()
        with session_scope(self._engine) as session:
            yield session

    @staticmethod
    def _get(session: Session, model: type, key: int, noun: str, *, for_update: bool = False) -> Any:
        obj = session.get(model, key, with_for_update=True if for_update else None)
        if obj is None:
            raise NotFound(f"no {noun} with id {key}; list screens with `packbench screens list`")
        return obj

    def _insert_ignore(
        self, session: Session, model: type, rows: list[dict[str, Any]], key: list[str]
    ) -> int:
        """INSERT ... ON CONFLICT (key) DO NOTHING; return the number of rows inserted.

        The database decides atomically whether the key exists, so concurrent writers of the
        same key cannot both insert or fail; a read-then-insert could do either.
        """
        statement = _insert_ignore_statement(self.dialect, model, tuple(key))
        # Rows go in as parameters, not `.values(rows)`: the compiled statement is then
        # cached (an uncached compile cost ~4 ms per episode), and a list runs as one
        # executemany that SQLAlchemy batches into multi-row INSERTs ("insertmanyvalues").
        parameters = rows[0] if len(rows) == 1 else rows
        return len(session.execute(statement, parameters).all())


@functools.lru_cache(maxsize=None)
def _insert_ignore_statement(dialect: str, model: type, key: tuple[str, ...]):
    """INSERT ... ON CONFLICT (key) DO NOTHING RETURNING id, built once per (dialect, table)."""
    # RETURNING yields only the rows actually inserted; rowcount is not reliable for this
    # statement across drivers (psycopg reports -1).
    return _on_conflict_do_nothing(dialect, model, key).returning(model.__table__.c.id)


@functools.lru_cache(maxsize=None)
def _sqlite_insert_ignore_sql(model: type, key: tuple[str, ...], columns: tuple[str, ...]) -> str:
    """The same INSERT as SQL for the bare sqlite3 driver: named parameters for `columns`, no
    RETURNING (sqlite3's rowcount is exact). Used by `Store._put_episode_sqlite`."""
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


def _episode_columns(attempt_id: int, record: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a worker's episode record into `episodes` columns."""
    tokens = list(record.get("tokens") or [])
    phases = record.get("phases") or {}
    prefill = phases.get("prefill") or {}
    decode = phases.get("decode") or {}
    memory = record.get("memory") or {}
    return {
        "attempt_id": attempt_id,
        "plan_index": record["plan_index"],
        "condition": record["condition"],
        "role": record["role"],
        "prompt": record["prompt"],
        "status": record["status"],
        "error": record.get("error"),
        "tokens_json": json_text(tokens),
        "n_tokens": len(tokens),
        "wall_s": record.get("wall_s") or 0.0,
        "call_s": record.get("call_s") or 0.0,
        "h2d_weight_bytes": record.get("h2d_weight_bytes") or 0,
        "h2d_index_bytes": record.get("h2d_index_bytes") or 0,
        "d2h_bytes": record.get("d2h_bytes") or 0,
        # A phase's h2d_bytes already counts weights + indices (the worker adds them).
        "prefill_h2d_bytes": prefill.get("h2d_bytes") or 0,
        "decode_h2d_bytes": decode.get("h2d_bytes") or 0,
        "prefill_call_s": prefill.get("call_s") or 0.0,
        "decode_call_s": decode.get("call_s") or 0.0,
        "peak_allocated_bytes": memory.get("peak_allocated_bytes"),
        "peak_sampled_bytes": memory.get("peak_sampled_bytes"),
    }


def _verdict_columns(attempt_id: int, verdict: Mapping[str, Any]) -> dict[str, Any]:
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
