"""The packbench schema: SQLAlchemy 2.0 typed models, one module, one `MetaData`.

Conventions
- Every constraint and index gets a deterministic name from `NAMING_CONVENTION`, so Alembic
  can drop or alter it later on both SQLite and PostgreSQL.
- Enumerations are short strings guarded by a named CHECK constraint (`ck_<table>_<name>`)
  rather than database ENUM types: they migrate identically on both backends.
- JSON payloads are stored as canonical JSON text (`core.canonical.canonical_json`), which
  both backends store identically and `db/records.py` decodes.
- Timestamps are `UtcDateTime`: timezone-aware UTC in and out on both backends.
- Rows never leave `db/`: each model has `to_record()` returning a frozen dataclass.
- Names: an ORM class is `Sql<Thing>` (`SqlProtocol`, `SqlEpisode`, ...), the plain row it
  becomes `db.records.<Thing>Row`; `Protocol`, `Episode`, `Dispatcher` and `Signer` are the
  names of core's and cluster's own classes.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    false,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from packbench.core.canonical import canonical_json
from packbench.core.record import FIELDS_BY_NAME, STORED_FIELDS, Field
from packbench.db.errors import DatabaseError
from packbench.db.records import (
    AttemptRow,
    AuditRow,
    DispatcherRow,
    EpisodeRow,
    MachineRow,
    ProtocolRow,
    ScreenRow,
    SignerRow,
    StoredVerdict,
)


def json_cell(text: Any, table: str, row_id: Any, column: str) -> Any:
    """A JSON column's value. A cell that is not JSON (a hand edit, a damaged file) is one line
    naming the row and the fix: before, the commands reading the row (`screens show`, `results`,
    `compare`, `audit`) ended in a JSONDecodeError traceback, exit 70."""
    try:
        return json.loads(text)
    except (TypeError, ValueError) as e:
        raise DatabaseError(f"the database's {table} row {row_id}: its {column} is not JSON "
                            f"({type(e).__name__}: {str(e)[:80]}); it was edited or damaged: put that cell back, "
                            f"or restore the database from a backup") from None


NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SCREEN_STATUSES = ("queued", "running", "done", "failed", "cancelled")
# running -> done | failed | interrupted (released, or stopped by the user) | lost (its lease
# expired: the dispatcher vanished) | cancelled (the user cancelled its screen).
ATTEMPT_STATUSES = ("running", "done", "failed", "interrupted", "lost", "cancelled")
MODEL_STATES = ("cold", "warm")
AUDIT_KINDS = ("local", "ray", "reexecute")  # reexecute: 0006
EPISODE_ROLES = ("warmup", "scored")
EPISODE_STATUSES = ("ok", "failed")
VERDICT_PHASES = ("all", "prefill", "decode")
AUDIT_RESULTS = ("agree", "disagree", "partial")  # partial: 0011


def _one_of(column: str, values: tuple[str, ...], name: str) -> CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=name)


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that only accepts and always returns aware UTC datetimes.

    Why: SQLite has no time zone type; SQLAlchemy stores its datetimes as text and returns
    them naive. PostgreSQL returns them in the session's time zone. Normalising here means
    every timestamp that leaves `db/` is comparable, whatever the backend.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            # A naive time is ambiguous; refusing it is cheaper than a wrong "UTC" guess.
            raise ValueError(f"naive datetime {value!r}: pass an aware datetime (UTC)")
        value = value.astimezone(UTC)
        # SQLite's text format would silently drop the offset; store the UTC wall time.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class SqlProtocol(Base):
    """A frozen protocol: its canonical JSON and the SHA-256 that identifies it.

    `model` (the protocol's `model.path`, or 'synth:<shape>' for a synthetic model) and
    `dtype` are copies of canonical JSON fields,
    made at insert time, so `packbench results --model/--dtype` filter on indexed columns
    instead of parsing JSON in SQL (which SQLite and PostgreSQL spell differently). None when
    the JSON lacks the field.
    """

    __tablename__ = "protocols"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String, index=True)
    canonical_json: Mapped[str] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(String, index=True)
    dtype: Mapped[str | None] = mapped_column(String(16), index=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)

    def to_record(self) -> ProtocolRow:
        return ProtocolRow(
            id=self.id,
            sha256=self.sha256,
            name=self.name,
            canonical_json=self.canonical_json,
            model=self.model,
            dtype=self.dtype,
            created_at=self.created_at,
        )


class SqlMachine(Base):
    """A machine fingerprint (host, GPU and software versions) that attempts ran on.

    Unknown parts are stored as '' rather than NULL: SQL treats NULLs as distinct, so a
    unique constraint over nullable columns would let duplicates in (on both backends).
    """

    __tablename__ = "machines"
    __table_args__ = (UniqueConstraint("host", "gpu_name", "driver", "torch", "cuda"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String, server_default="")
    gpu_name: Mapped[str] = mapped_column(String, server_default="")
    driver: Mapped[str] = mapped_column(String, server_default="")
    torch: Mapped[str] = mapped_column(String, server_default="")
    cuda: Mapped[str] = mapped_column(String, server_default="")

    def to_record(self) -> MachineRow:
        return MachineRow(
            id=self.id,
            host=self.host or None,
            gpu_name=self.gpu_name or None,
            driver=self.driver or None,
            torch=self.torch or None,
            cuda=self.cuda or None,
        )


class SqlScreen(Base):
    """One requested execution of a protocol; its attempts do the work.

    Queue fields (revision 0004): a dispatcher claims the queued screen with the highest
    `priority`, then the oldest (lowest id). `attempts_used` counts the claims made since
    submit or the last retry, against `max_attempts`. `gpu_type`, `placement_node`,
    `exclusive_node` and `replica_group` are what the dispatcher needs to place it (copied
    from the protocol's `placement` and the submit options, so a claim filters on columns).
    """

    __tablename__ = "screens"
    __table_args__ = (_one_of("status", SCREEN_STATUSES, "status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    protocol_id: Mapped[int] = mapped_column(ForeignKey("protocols.id"), index=True)
    # Indexed: the dispatcher polls for queued screens.
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    repetitions: Mapped[int] = mapped_column(Integer, default=1)
    submitter: Mapped[str] = mapped_column(String)
    # The checkpoint directory resolved at submit time, so every attempt loads the same one.
    model_dir: Mapped[str | None] = mapped_column(String)
    # The token_file/text_file resolved at submit time (its SHA-256 is in the frozen protocol).
    prompt_file: Mapped[str | None] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_attempts: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    attempts_used: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    gpu_type: Mapped[str | None] = mapped_column(String)
    placement_node: Mapped[str | None] = mapped_column(String)
    exclusive_node: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Screens of one `submit --replicas N --spread` share it: placed on distinct nodes.
    replica_group: Mapped[str | None] = mapped_column(String(32), index=True)
    # Why no dispatcher can place it now (it stays queued); cleared when it is claimed.
    unplaceable_reason: Mapped[str | None] = mapped_column(Text)
    # Set by `screens cancel` on a running screen: its attempt stops after the episode in flight.
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Custom Ray resources its node must have free (the protocol's placement.resources), as
    # canonical JSON; NULL when none. Only claims for a node declaring them can take it.
    resources: Mapped[str | None] = mapped_column(Text)
    # Labels (0010): what a researcher calls it, and the sweep point it ran (db/labels.py).
    name: Mapped[str | None] = mapped_column(String(200), index=True)
    note: Mapped[str | None] = mapped_column(Text)
    sweep_id: Mapped[str | None] = mapped_column(String(32), index=True)
    sweep_point: Mapped[str | None] = mapped_column(Text)  # canonical JSON {field: value}

    def to_record(self) -> ScreenRow:
        return ScreenRow(
            id=self.id,
            protocol_id=self.protocol_id,
            status=self.status,
            repetitions=self.repetitions,
            submitter=self.submitter,
            model_dir=self.model_dir,
            prompt_file=self.prompt_file,
            created_at=self.created_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            priority=self.priority,
            max_attempts=self.max_attempts,
            attempts_used=self.attempts_used,
            gpu_type=self.gpu_type,
            placement_node=self.placement_node,
            exclusive_node=self.exclusive_node,
            replica_group=self.replica_group,
            unplaceable_reason=self.unplaceable_reason,
            cancel_requested_at=self.cancel_requested_at,
            resources=self.resources,
            name=self.name,
            note=self.note,
            sweep_id=self.sweep_id,
            sweep_point=self.sweep_point,
        )


class SqlDispatcher(Base):
    """A dispatcher process that claims screens; live while its heartbeat is recent.

    `workers_json` is its last heartbeat's view of its GPU workers (canonical JSON list of
    {name, node, gpu, gpu_index, state: idle|busy, screen_id}), replaced at each heartbeat.
    """

    __tablename__ = "dispatchers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String)
    host: Mapped[str] = mapped_column(String)
    pid: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    workers_json: Mapped[str] = mapped_column(Text, default="[]")

    def to_record(self) -> DispatcherRow:
        return DispatcherRow(
            id=self.id,
            name=self.name,
            host=self.host,
            pid=self.pid,
            started_at=self.started_at,
            heartbeat_at=self.heartbeat_at,
            stopped_at=self.stopped_at,
            workers=tuple(json_cell(self.workers_json, "dispatchers", self.id, "workers_json")),
        )


class SqlAttempt(Base):
    """One placement of a screen on a GPU worker. Failed attempts are kept, never reused."""

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("screen_id", "number"),
        _one_of("status", ATTEMPT_STATUSES, "status"),
        _one_of("model_state", MODEL_STATES, "model_state"),
        # A claim for a worker slot on a node looks for what runs there (exclusive screens,
        # replicas, shared_node): without it every such claim scanned all attempts.
        Index("ix_attempts_node_status", "node", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    screen_id: Mapped[int] = mapped_column(ForeignKey("screens.id"))
    number: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String)
    node: Mapped[str] = mapped_column(String)
    gpu_name: Mapped[str] = mapped_column(String)
    gpu_index: Mapped[int] = mapped_column(Integer)
    # Indexed: `results --machine` joins machines through it.
    machine_id: Mapped[int | None] = mapped_column(ForeignKey("machines.id"), index=True)
    status: Mapped[str] = mapped_column(String(16), default="running")
    error: Mapped[str | None] = mapped_column(Text)
    archive_path: Mapped[str] = mapped_column(String)
    archive_sha256: Mapped[str | None] = mapped_column(String(64))
    source_freeze: Mapped[str] = mapped_column(Text)  # canonical JSON object
    # Indexed: `results --since/--until` filter on when the attempt ran.
    started_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow, index=True)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Random hex, unique across databases and machines: archive file names carry it. Nullable
    # only because SQLite cannot add a NOT NULL column without a default; always set.
    attempt_key: Mapped[str | None] = mapped_column(String(32), unique=True)
    dispatcher_id: Mapped[int | None] = mapped_column(ForeignKey("dispatchers.id"))
    # Claimed attempts only; the dispatcher renews it. Indexed: the reaper looks for expired ones.
    lease_expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime, index=True)
    model_state: Mapped[str | None] = mapped_column(String(8))  # cold | warm; None: unknown
    # Another attempt ran on the same node at the same time (timings may interfere).
    shared_node: Mapped[bool | None] = mapped_column(Boolean)
    # 0005: what was measured and who vouches for the archive (docs/archive.md).
    model_sha256: Mapped[str | None] = mapped_column(String(64))
    signer_key_id: Mapped[str | None] = mapped_column(String(16))
    ingested_from: Mapped[str | None] = mapped_column(Text)
    # 0008: episode rows inserted from the attempt's archive after a database outage
    # (service/reconcile.py): when last, how many in all, and what each member was checked against.
    reconciled_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    reconciled_episodes: Mapped[int | None] = mapped_column(Integer)
    reconciled_check: Mapped[str | None] = mapped_column(String(16))  # manifest | writer | crc32

    def to_record(self) -> AttemptRow:
        return AttemptRow(
            id=self.id,
            screen_id=self.screen_id,
            number=self.number,
            worker=self.worker,
            node=self.node,
            gpu_name=self.gpu_name,
            gpu_index=self.gpu_index,
            machine_id=self.machine_id,
            status=self.status,
            error=self.error,
            archive_path=self.archive_path,
            archive_sha256=self.archive_sha256,
            source_freeze=json_cell(self.source_freeze, "attempts", self.id, "source_freeze"),
            started_at=self.started_at,
            finished_at=self.finished_at,
            attempt_key=self.attempt_key,
            dispatcher_id=self.dispatcher_id,
            lease_expires_at=self.lease_expires_at,
            model_state=self.model_state,
            shared_node=self.shared_node,
            model_sha256=self.model_sha256,
            signer_key_id=self.signer_key_id,
            ingested_from=self.ingested_from,
            reconciled_at=self.reconciled_at,
            reconciled_episodes=self.reconciled_episodes,
            reconciled_check=self.reconciled_check,
        )


# What an episode column's type is where its field's Python type does not say it (the
# default: int -> Integer, float -> Float, str -> String, a JSON list -> Text).
_EPISODE_TYPES: dict[str, Any] = {"role": String(16), "status": String(16), "error": Text()}
# Indexed: `results --condition` / `--status failed` filter on them (failed episodes are few).
_EPISODE_INDEXED = ("condition", "role", "status")


def _episode_column(field: Field) -> Column[Any]:
    """The `episodes` column of a stored `core.record` field: byte counters are BIGINT (an
    episode of dense-stream OPT-2.7B fp16 moves 1.7 GB a call), NOT NULL unless the field is nullable."""
    column = field.column
    assert column is not None, field.name
    if column in _EPISODE_TYPES:
        type_ = _EPISODE_TYPES[column]
    elif field.stored_as == "json":
        type_ = Text()
    elif field.type is int:
        type_ = BigInteger() if column.endswith("_bytes") else Integer()
    else:
        type_ = {float: Float(), str: String()}[field.type]
    return Column(column, type_, nullable=field.nullable, index=column in _EPISODE_INDEXED or None)


class SqlEpisode(Base):
    """One episode record as the worker reported it, flattened into columns.

    The columns are `core.record.STORED_FIELDS`, in their order, generated from that table
    (`_episode_column`): a field stored there has its column here, and the migrations test
    (`compare_metadata(...) == []`) says when a revision for it is missing.

    (attempt_id, plan_index) is the natural key: a re-sent record is a no-op.
    """

    __table__ = Table(
        "episodes",
        Base.metadata,
        Column("id", Integer, primary_key=True),
        Column("attempt_id", ForeignKey("attempts.id"), nullable=False),
        *(_episode_column(f) for f in STORED_FIELDS),
        UniqueConstraint("attempt_id", "plan_index"),
        _one_of("role", EPISODE_ROLES, "role"),
        _one_of("status", EPISODE_STATUSES, "status"),
    )

    def to_record(self) -> EpisodeRow:
        values = {f.name: getattr(self, f.column) for f in STORED_FIELDS}  # type: ignore[arg-type]
        for f in STORED_FIELDS:
            if f.stored_as == "json":
                values[f.name] = tuple(json_cell(values[f.name], "episodes", self.id, f.column))
        return EpisodeRow(id=self.id, attempt_id=self.attempt_id, **values)


def episode_column(name: str) -> Any:
    """The `SqlEpisode` column (ORM attribute) of the `core.record` field `name`."""
    return getattr(SqlEpisode, FIELDS_BY_NAME[name].column)  # type: ignore[arg-type]


class SqlVerdict(Base):
    """One gate verdict for one condition and phase of an attempt."""

    __tablename__ = "verdicts"
    __table_args__ = (
        UniqueConstraint("attempt_id", "gate", "condition", "phase"),
        _one_of("phase", VERDICT_PHASES, "phase"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"))
    # Indexed: `results --gate` across attempts (the unique key starts with attempt_id).
    gate: Mapped[str] = mapped_column(String, index=True)
    condition: Mapped[str] = mapped_column(String)
    phase: Mapped[str] = mapped_column(String(16))
    value: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    interval_lo: Mapped[float | None] = mapped_column(Float)
    interval_hi: Mapped[float | None] = mapped_column(Float)
    passed: Mapped[bool] = mapped_column(Boolean)
    episodes_json: Mapped[str] = mapped_column(Text)  # canonical JSON list of plan indexes
    detail: Mapped[str] = mapped_column(Text)

    def to_record(self) -> StoredVerdict:
        interval = None
        if self.interval_lo is not None and self.interval_hi is not None:
            interval = (self.interval_lo, self.interval_hi)
        return StoredVerdict(
            id=self.id,
            attempt_id=self.attempt_id,
            gate=self.gate,
            condition=self.condition,
            phase=self.phase,
            passed=self.passed,
            value=self.value,
            threshold=self.threshold,
            interval=interval,
            episodes=tuple(json_cell(self.episodes_json, "verdicts", self.id, "episodes_json")),
            detail=self.detail,
        )


class SqlAudit(Base):
    """One audit run over an attempt's archive. Append-only: every run is a new row."""

    __tablename__ = "audits"
    __table_args__ = (
        _one_of("result", AUDIT_RESULTS, "result"),
        _one_of("kind", AUDIT_KINDS, "kind"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"), index=True)
    # None: the archive was over the reader's size bound and never hashed (0012).
    archive_sha256: Mapped[str | None] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String)
    result: Mapped[str] = mapped_column(String(16))
    problems_json: Mapped[str] = mapped_column(Text)  # canonical JSON list of strings
    machine: Mapped[str] = mapped_column(String)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime] = mapped_column(UtcDateTime)
    # Where the audit ran: the Ray node for a Ray task, else the machine; None before 0004.
    node: Mapped[str | None] = mapped_column(String)
    kind: Mapped[str | None] = mapped_column(String(16))  # local (in the CLI) | ray (a Ray task) | reexecute

    def to_record(self) -> AuditRow:
        return AuditRow(
            id=self.id,
            attempt_id=self.attempt_id,
            archive_sha256=self.archive_sha256,
            digest=self.digest,
            result=self.result,
            problems=tuple(json_cell(self.problems_json, "audits", self.id, "problems_json")),
            machine=self.machine,
            started_at=self.started_at,
            finished_at=self.finished_at,
            node=self.node,
            kind=self.kind,
        )


def json_text(obj: Any) -> str:
    """Canonical JSON as text: the one form JSON columns are written in."""
    return canonical_json(obj).decode("utf-8")


class SqlSigner(Base):
    """An Ed25519 public key that signs sealed archives (0005): this deployment's own
    (`local`, from `packbench keys init`) or another lab's, trusted for `packbench ingest`.
    The private half never enters the database."""

    __tablename__ = "signers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_id: Mapped[str] = mapped_column(String(16), unique=True)
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String)
    local: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    # When `packbench keys revoke` revoked it (0013); NULL: in force. A revoked key is kept, never
    # deleted: the screens it signed still name it.
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    def to_record(self) -> SignerRow:
        return SignerRow(id=self.id, key_id=self.key_id, public_key=self.public_key, name=self.name,
                         local=self.local, created_at=self.created_at, revoked_at=self.revoked_at)


class SqlScreenTag(Base):
    """A key/value label of a screen (0010): one value per key and screen."""

    __tablename__ = "screen_tags"
    __table_args__ = (UniqueConstraint("screen_id", "key"), Index("ix_screen_tags_key_value", "key", "value"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    screen_id: Mapped[int] = mapped_column(ForeignKey("screens.id"))
    key: Mapped[str] = mapped_column(String(100))
    value: Mapped[str] = mapped_column(String(200))
