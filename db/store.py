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
- Queries for the CLI (`results`, `list_screens`, `screen_detail`, `compare`,
  `queue_status`) live in `db.queries`; the methods here give each one transaction.

The job queue (issue 12)
- Screens: queued -> running -> done | failed | cancelled. Attempts: running -> done |
  failed | interrupted | lost | cancelled. Failed and lost attempts are kept, never reused.
- `claim_screen` atomically moves the best queued screen (highest priority, then oldest)
  that the caller can place to running and creates its attempt with a random attempt_key
  and a lease: PostgreSQL `UPDATE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1)
  RETURNING`, SQLite the same statement under `BEGIN IMMEDIATE` (every write transaction
  takes the write lock at BEGIN, see `db.session`). The dispatcher renews the lease
  (`renew_lease`) while the screen runs; `reap_expired` turns expired leases into `lost`
  attempts and requeues their screens up to `max_attempts`.
- Time is the Store's clock (`clock`, default the caller's UTC clock), used for every lease,
  heartbeat and timestamp: dispatchers on several machines need synchronised clocks (NTP),
  and a lease should be much longer than their skew (leases of tens of seconds).
- The dispatcher's writes (`_retried`) survive a brief database outage: a transient failure
  (`db.session.is_transient`) re-runs the whole transaction with backoff; if the database
  stays down, `DatabaseUnavailable` says for how long it tried and how to recover. A
  retried write whose first commit did land is harmless: the upserts are idempotent, and a
  claim the caller never saw expires and is requeued. `dispatch --follow` then waits with
  `ping` (one try each) and, once it answers, inserts the rows its archives hold
  (`reconcile_targets`, `put_reconciled`: service/reconcile.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    String,
    Text,
    bindparam,
    cast,
    exists,
    func,
    insert,
    null,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core.protocol import resources_fit
from core.record import stored_values
from db import history, labels, migrate, queries
from db.history import HistoryRun
from db.errors import Conflict, DatabaseLocked, DatabaseUnavailable, NotFound, SchemaNotAtHead
from db.models import (
    AUDIT_KINDS,
    MODEL_STATES,
    Attempt,
    Audit,
    Dispatcher,
    Episode,
    Machine,
    Protocol,
    Screen,
    Signer,
    UtcDateTime,
    Verdict,
    json_text,
    utcnow,
)
from db.queries import (
    Comparison,
    QueueStatus,
    ResultFilter,
    ResultRow,
    ScreenDetail,
    ScreenSummary,
)
from db.records import (
    AttemptRow,
    AuditRow,
    Claim,
    DispatcherRow,
    Reaped,
    ReconcileTarget,
    EpisodeRow,
    MachineRow,
    ProtocolRow,
    ScreenRow,
    SignerRow,
    VerdictRow,
)
from db.session import display_url, make_engine, session_scope, translate_errors

# finish_attempt: the screen status that each final attempt status leads to. (`release`
# ends an attempt as interrupted and requeues its screen; `reap_expired` makes it lost.)
_SCREEN_STATUS_AFTER = {"done": "done", "failed": "failed", "interrupted": "failed",
                        "cancelled": "cancelled"}
WORKER_STATES = ("idle", "busy")
# What a reconciled row's archive members were checked against, strongest first: the sealed
# archive's manifest (SHA-256), the live writer's member table (SHA-256, what the manifest will
# hold), or an unsealed archive's zip CRC-32s alone. An attempt records the weakest it used.
RECONCILE_CHECKS = ("manifest", "writer", "crc32")
# Backoff between tries of a dispatcher write while the database is unavailable: 8 tries
# over about 12.7 s, long enough for a PostgreSQL restart or a pooled connection to be
# replaced, short against a lease of a minute.
RETRY_DELAYS_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)

_T = TypeVar("_T")


def _retried(method: Callable[..., _T]) -> Callable[..., _T]:
    """Re-run a one-transaction Store method while the database is unavailable.

    Only `DatabaseUnavailable` (a broken or refused connection, a server restart, a
    serialization failure) is retried; the rolled-back transaction runs again from the start.
    """

    @functools.wraps(method)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> _T:
        started = time.monotonic()
        delays = self._retry_delays
        for tries, delay in enumerate((*delays, None), start=1):
            try:
                return method(self, *args, **kwargs)
            except DatabaseLocked:
                raise  # SQLite's busy handler has waited its timeout already
            except DatabaseUnavailable as exc:
                if delay is None:
                    failing = time.monotonic() - started
                    raise DatabaseUnavailable(
                        f"{exc}; gave up on {method.__name__} after {tries} tries over "
                        f"{failing:.1f} s. Once the database is back, run the "
                        f"command again: committed records are kept, a screen whose lease "
                        f"expired meanwhile is requeued (see `packbench status`), and "
                        f"`packbench db reconcile` inserts any archived episode that has no row",
                        cause=exc.cause, failing_s=failing,
                    ) from exc
                time.sleep(delay)
        raise AssertionError("unreachable")

    return wrapper


def archive_file_name(screen_id: int, number: int, attempt_key: str) -> str:
    """The raw archive's file name for an attempt: unique across databases and machines
    through the attempt's random key, and still sorted by screen and attempt number."""
    return f"screen-{screen_id:05d}-attempt-{number}-{attempt_key}.zip"


def new_attempt_key() -> str:
    """128 random bits as hex: no two attempts anywhere share one."""
    return secrets.token_hex(16)


class Store:
    """The packbench database at `url` (default: `db.session.default_url()`).

    Creating a Store does not connect; the first method call does. Call `close()` (or use
    it as a context manager) to release pooled connections.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        clock: Callable[[], datetime] = utcnow,
        retry_delays: Sequence[float] = RETRY_DELAYS_S,
    ) -> None:
        self._engine: Engine = make_engine(url)
        self._schema_checked = False
        # The one time source for leases, heartbeats and timestamps (tests pass a fake one).
        self._clock = clock
        self._retry_delays = tuple(retry_delays)
        self._protocols: dict[int, ProtocolRow] = {}
        # The episode writer's own connection, held between records: checking a connection
        # out of the pool and resetting it on return cost more than the insert and its commit
        # (0.41 against 0.21 ms a record on SQLite). Dropped on any error, reopened on demand.
        # SQLite holds the bare driver connection (see `_put_episode_sqlite`), PostgreSQL a
        # SQLAlchemy one; only one of the two is ever set.
        self._writer: Connection | None = None
        self._sqlite_writer: PoolProxiedConnection | None = None
        # claim_screen's autocommit connection on PostgreSQL, held likewise.
        self._claimer: Connection | None = None

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
        claimer, self._claimer = self._claimer, None
        for connection in (writer, sqlite_writer, claimer):
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

    @_retried
    def put_protocol(self, *, sha256: str, name: str, canonical_json: str) -> int:
        """Store a frozen protocol; return its id. Idempotent on `sha256`.

        The model and dtype are copied from `canonical_json` into their own columns for the
        query filters (see `protocol_columns`; None where the JSON lacks them).
        """
        with self._session() as session:
            values = {"sha256": sha256, "name": name, "canonical_json": canonical_json,
                      **protocol_columns(canonical_json), "created_at": self._clock()}
            self._insert_ignore(session, Protocol, [values], ["sha256"])
            return session.scalars(select(Protocol.id).where(Protocol.sha256 == sha256)).one()

    def protocol(self, protocol_id: int) -> ProtocolRow:
        with self._session() as session:
            return self._get(session, Protocol, protocol_id, "protocol").to_record()

    @_retried
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

    @_retried
    def create_screen(
        self,
        *,
        protocol_id: int,
        submitter: str,
        repetitions: int = 1,
        model_dir: str | None = None,
        prompt_file: str | None = None,
        priority: int = 0,
        max_attempts: int = 3,
        gpu_type: str | None = None,
        placement_node: str | None = None,
        exclusive_node: bool = False,
        replica_group: str | None = None,
        resources: Mapping[str, float] | None = None,
    ) -> int:
        """Queue a new screen of a stored protocol; return its id.

        `model_dir` is the checkpoint directory resolved at submit time, kept so that every
        attempt loads the same one (None for a synthetic model, generated on the worker);
        `prompt_file` likewise for a token_file/text_file prompt source.
        Queue options: `priority` (higher is claimed first; FIFO within one), `max_attempts`
        (claims allowed before a screen whose leases keep expiring is failed, >= 1),
        `gpu_type` (only a worker of that GPU type may claim it), `placement_node` (only a
        worker on that node), `exclusive_node` (no other screen runs on its node meanwhile),
        `replica_group` (screens sharing one, e.g. from `create_replicas`, run on distinct nodes),
        `resources` (custom Ray resources its node must have free: only a claim whose
        `node_resources` cover them, beside what runs there already, can take it).
        """
        if max_attempts < 1:
            raise ValueError(f"max_attempts {max_attempts} must be >= 1")
        with self._session() as session:
            self._get(session, Protocol, protocol_id, "protocol")
            screen = Screen(
                protocol_id=protocol_id,
                submitter=submitter,
                repetitions=repetitions,
                model_dir=model_dir,
                prompt_file=prompt_file,
                status="queued",
                created_at=self._clock(),
                priority=priority,
                max_attempts=max_attempts,
                attempts_used=0,
                gpu_type=gpu_type,
                placement_node=placement_node,
                exclusive_node=exclusive_node,
                replica_group=replica_group,
                resources=resources_json(resources),
            )
            session.add(screen)
            session.flush()
            return screen.id

    def create_replicas(self, replicas: int, **screen: Any) -> list[int]:
        """Queue `replicas` screens of one protocol (`create_screen`'s arguments) in one
        transaction, sharing a new random replica_group so that they run on distinct nodes
        (`submit --replicas N --spread`); return their ids."""
        if replicas < 1:
            raise ValueError(f"replicas {replicas} must be >= 1")
        group = new_attempt_key()
        ids = []
        with self._session() as session:
            self._get(session, Protocol, screen["protocol_id"], "protocol")
            screen = {**screen, "resources": resources_json(screen.get("resources"))}
            for _ in range(replicas):
                row = Screen(**{"status": "queued", "created_at": self._clock(), "attempts_used": 0,
                                "repetitions": 1, "priority": 0, "max_attempts": 3,
                                "exclusive_node": False, **screen, "replica_group": group})
                session.add(row)
                session.flush()
                ids.append(row.id)
        return ids

    def queued_screens(self) -> list[ScreenRow]:
        """Screens waiting for a worker in claim order: highest priority, then oldest."""
        with self._session() as session:
            query = select(Screen).where(Screen.status == "queued").order_by(Screen.priority.desc(), Screen.id)
            return [screen.to_record() for screen in session.scalars(query)]

    def screen(self, ref: int | str) -> ScreenRow:
        """The screen with id `ref` (an int or a string of digits), or 'latest' (highest id)."""
        with self._session() as session:
            return queries.find_screen(session, ref).to_record()

    # -- attempts ----------------------------------------------------------------------

    @_retried
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
            now = self._clock()
            attempt = Attempt(
                attempt_key=new_attempt_key(),
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

    @_retried
    def finish_attempt(
        self,
        attempt_id: int,
        *,
        status: str,
        error: str | None = None,
        archive_sha256: str | None = None,
        requeue: bool = False,
    ) -> str:
        """Close a running attempt as 'done', 'failed', 'interrupted' or 'cancelled'; return the
        screen's status after it ('queued' when requeued).

        `requeue` (a failed attempt whose cause was not the screen's, e.g. its worker died):
        the screen goes back to the queue while attempts_used < max_attempts (and is failed
        after that, or cancelled if a cancel was requested) instead of following the attempt.

        The screen follows: 'done' for a done attempt, 'cancelled' for a cancelled one (the
        dispatcher stopped after a `cancel_screen`), 'failed' otherwise; its finished_at is
        set. Finishing an attempt that is not running raises `Conflict`: a finished attempt
        is history and is never overwritten (a `lost` one was reaped: its dispatcher lost the
        lease and must stop).
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
            now = self._clock()
            attempt.status = status
            attempt.error = error
            attempt.archive_sha256 = archive_sha256
            attempt.finished_at = now
            screen = session.get_one(Screen, attempt.screen_id, with_for_update=True)
            if requeue and status == "failed" and screen.cancel_requested_at is None \
                    and screen.attempts_used < screen.max_attempts:
                screen.status, screen.finished_at = "queued", None
                return screen.status
            if requeue and screen.cancel_requested_at is not None:
                status = "cancelled"
            screen.status = _SCREEN_STATUS_AFTER[status]
            screen.finished_at = now
            return screen.status

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

    # -- the job queue -----------------------------------------------------------------

    @_retried
    def register_dispatcher(self, name: str, host: str, *, pid: int | None = None) -> int:
        """Record a dispatcher starting; return its id (heartbeat it, stop it with `stop_dispatcher`)."""
        with self._session() as session:
            now = self._clock()
            dispatcher = Dispatcher(name=name, host=host, pid=pid, started_at=now, heartbeat_at=now,
                                    workers_json="[]")
            session.add(dispatcher)
            session.flush()
            return dispatcher.id

    @_retried
    def heartbeat(self, dispatcher_id: int, workers: Sequence[Mapping[str, Any]]) -> None:
        """The dispatcher is alive; `workers` replaces its workers as `packbench status` shows
        them: each {name, node, gpu, gpu_index, state: idle|busy, screen_id (busy only)}."""
        listed = []
        for worker in workers:
            if worker.get("state") not in WORKER_STATES:
                raise ValueError(f"worker state {worker.get('state')!r} is not one of {', '.join(WORKER_STATES)}")
            listed.append(dict(worker))
        with self._session() as session:
            dispatcher = self._get(session, Dispatcher, dispatcher_id, "dispatcher", for_update=True)
            dispatcher.heartbeat_at = self._clock()
            dispatcher.workers_json = json_text(listed)

    @_retried
    def stop_dispatcher(self, dispatcher_id: int) -> None:
        """The dispatcher shut down cleanly (release its attempts first): no longer listed as live."""
        with self._session() as session:
            dispatcher = self._get(session, Dispatcher, dispatcher_id, "dispatcher", for_update=True)
            dispatcher.stopped_at = self._clock()
            dispatcher.workers_json = "[]"

    def dispatchers(self) -> list[DispatcherRow]:
        """Every dispatcher ever registered, by id."""
        with self._session() as session:
            return [d.to_record() for d in session.scalars(select(Dispatcher).order_by(Dispatcher.id))]

    @_retried
    def claim_screen(
        self,
        dispatcher_id: int,
        *,
        lease_s: float,
        archive_dir: str,
        source_freeze: Mapping[str, Any],
        worker: str = "",
        node: str = "",
        gpu_name: str = "",
        gpu_index: int = -1,
        machine_id: int | None = None,
        gpu_types: Collection[str] | None = None,
        exclude_screens: Collection[int] = (),
        screen_id: int | None = None,
        model_state: str | None = None,
        node_resources: Mapping[str, float] | None = None,
        follows_attempt: int | None = None,
    ) -> Claim | None:
        """Atomically claim the best queued screen this worker slot can run; None if there is none.

        Best: highest priority, then oldest. Placeable: `gpu_types` given -> the screen's
        gpu_type is None or one of them; `node` given -> its placement_node is None or
        `node`, no other screen of its replica_group runs or ran (done) on `node`, and
        neither it nor a screen running on `node` wants the node exclusively.
        A screen that needs custom Ray resources (`resources`) is placeable only with `node`
        given and `node_resources` (the node's declared totals) covering its needs plus those
        of every screen running on `node`. `follows_attempt`: the slot's own running attempt,
        whose worker runs the claimed screen after it (a look-ahead claim): it counts as
        neither another screen on the node (exclusive_node, shared_node) nor a user of its
        resources, but still as a replica on it.
        `exclude_screens` skips screens the caller already knows it cannot place;
        `screen_id` claims that screen only (None if it is no longer queued or placeable).

        In one transaction: the screen becomes running (attempts_used + 1, started_at set on
        its first claim, unplaceable_reason cleared) and gets a running attempt numbered
        after its earlier ones, with a new random attempt_key, archive_path
        `archive_dir/archive_file_name(...)`, dispatcher_id, the slot's worker/node/GPU
        (empty until `place_attempt` when unknown) and a lease until now + `lease_s`.
        Concurrent claimers never get the same screen: PostgreSQL skips rows another claim
        has locked (FOR UPDATE SKIP LOCKED), SQLite serializes claims (BEGIN IMMEDIATE).
        Claims for one node are serialized too, so that the node checks (exclusive_node,
        shared_node, resources) see every claim committed before them: on PostgreSQL a
        transaction-scoped advisory lock on the node is taken before the claim's snapshot.
        Without it, two dispatchers claiming for one node at once each saw the node free and
        both started a screen there, one of them exclusive_node.
        """
        if lease_s <= 0:
            raise ValueError(f"lease_s {lease_s} must be > 0")
        if model_state is not None and model_state not in MODEL_STATES:
            raise ValueError(f"model_state {model_state!r} is not one of {', '.join(MODEL_STATES)}")
        # Not named like a column: DML takes such execution parameters as SET / VALUES.
        parameters: dict[str, Any] = {"want_screen": screen_id, "exclude_ids": list(exclude_screens),
                                      "gpu_type_list": list(gpu_types or ()), "slot_node": node,
                                      "follows_id": follows_attempt, "fit_list": []}
        shape = dict(one=screen_id is not None, exclude=bool(exclude_screens), gpu_types=gpu_types is not None,
                     node=bool(node), follows=bool(node) and follows_attempt is not None)
        capacity = {k: float(v) for k, v in (node_resources or {}).items()} if node else {}
        # A claim is the dispatcher's hot path. Built per call through the ORM (aliases
        # adapted, the statement compiled again) it cost 65 ms of CPU on the 2-core box, and
        # the ORM session added a pooled checkout with its pre-ping and separate SELECTs for
        # the attempt number and the protocol. Now one cached statement per filter shape:
        # on PostgreSQL a single autocommitted statement (one round trip, no BEGIN/COMMIT),
        # on SQLite UPDATE ... RETURNING then INSERT inside BEGIN IMMEDIATE.
        key, now = new_attempt_key(), self._clock()
        attempt_values = dict(
            attempt_key=key, worker=worker, node=node, gpu_name=gpu_name, gpu_index=gpu_index,
            machine_id=machine_id, status="running", error=None, archive_sha256=None,
            source_freeze=json_text(dict(source_freeze)), started_at=now, finished_at=None,
            dispatcher_id=dispatcher_id, lease_expires_at=now + timedelta(seconds=lease_s),
            model_state=model_state,
        )
        if self.dialect == "postgresql":
            with self._claimer_connection() as connection:
                try:
                    if node:
                        # BEGIN and the node's lock in one round trip (no parameters: the key is an int).
                        connection.exec_driver_sql(f"BEGIN; SELECT pg_advisory_xact_lock({_node_lock_key(node)})")
                        if capacity:
                            parameters["fit_list"] = _fitting(connection, node, capacity, follows_attempt)
                    statement = _pg_claim_statement(**shape, fits=bool(parameters["fit_list"]))
                    row = connection.execute(statement, {
                        **parameters, **{f"new_{k}": v for k, v in attempt_values.items()}, "now": now,
                        "archive_dir": archive_dir.rstrip("/")}).first()
                    if node:
                        connection.exec_driver_sql("COMMIT")
                except BaseException:
                    if node:
                        # The explicit transaction (and the node's lock) must not go back to the
                        # pool open: an autocommit connection's reset does not roll it back.
                        try:
                            connection.exec_driver_sql("ROLLBACK")
                        except SQLAlchemyError:
                            pass  # a broken connection: the server ends its session, and the lock
                    raise
            if row is None:
                return None
            values = row._asdict()
            attempt = AttemptRow(**{name[2:]: values.pop(name) for name in list(values) if name.startswith("a_")})
            attempt = dataclasses.replace(attempt, source_freeze=dict(source_freeze))
            screen = ScreenRow(**values)
            assert attempt.archive_path.endswith(archive_file_name(screen.id, attempt.number, key))
            return Claim(screen=screen, attempt=attempt, protocol=self._protocol_row(screen.protocol_id))
        attempts = Attempt.__table__
        if not self._schema_checked:
            self.check_head()
        # A pooled connection (SQLite has no pre-ping): its BEGIN IMMEDIATE serializes claims.
        with translate_errors(self._engine.url), self._engine.begin() as connection:
            if capacity:
                parameters["fit_list"] = _fitting(connection, node, capacity, follows_attempt)
            statement = _claim_statement(self.dialect, **shape, fits=bool(parameters["fit_list"]))
            row = connection.execute(statement, {**parameters, "now": now}).first()
            if row is None:
                return None
            values = row._asdict()
            values.pop("number")
            screen = ScreenRow(**values)
            # Not from RETURNING: SQLite renders the subquery's `screens.id` unqualified there, so
            # it bound to attempts.id and numbered attempts across every screen.
            number = connection.execute(
                select(func.coalesce(func.max(attempts.c.number), 0) + 1).where(attempts.c.screen_id == screen.id)
            ).scalar_one()
            attempt_values.update(
                screen_id=screen.id, number=number,
                shared_node=self._mark_shared(connection, follows_attempt, node) if node else None,
                archive_path=f"{archive_dir.rstrip('/')}/{archive_file_name(screen.id, number, key)}")
            attempt_id = connection.execute(
                insert(attempts).values(attempt_values).returning(attempts.c.id)
            ).scalar_one()
            attempt = AttemptRow(id=attempt_id, **{**attempt_values, "source_freeze": dict(source_freeze)})
        return Claim(screen=screen, attempt=attempt, protocol=self._protocol_row(screen.protocol_id))

    @contextmanager
    def _claimer_connection(self) -> Iterator[Connection]:
        """The Store's held autocommit connection for single-statement claims (PostgreSQL);
        after the schema check, errors translated, a failed connection dropped."""
        if not self._schema_checked:
            self.check_head()
        with translate_errors(self._engine.url):
            if self._claimer is None:
                self._claimer = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                yield self._claimer
            except SQLAlchemyError:
                self._drop_writer()
                raise

    def _protocol_row(self, protocol_id: int) -> ProtocolRow:
        """A protocol, cached: frozen protocols never change."""
        row = self._protocols.get(protocol_id)
        if row is None:
            row = self._protocols[protocol_id] = self.protocol(protocol_id)
        return row

    @staticmethod
    def _mark_shared(connection: Connection | Session, attempt_id: int | None, node: str) -> bool:
        """Whether attempts other than `attempt_id` run on `node` now; if so they are marked
        shared_node too (only those not marked yet: a busy node's attempts are not rewritten
        at every claim)."""
        attempts = Attempt.__table__
        here = [attempts.c.node == node, attempts.c.status == "running"]
        if attempt_id is not None:
            here.append(attempts.c.id != attempt_id)
        if not connection.execute(select(exists().where(*here))).scalar():
            return False
        connection.execute(
            update(attempts).where(*here, or_(attempts.c.shared_node.is_(None), attempts.c.shared_node.is_(False)))
            .values(shared_node=True)
        )
        return True

    @_retried
    def place_attempt(
        self,
        attempt_id: int,
        *,
        worker: str | None = None,
        node: str | None = None,
        gpu_name: str | None = None,
        gpu_index: int | None = None,
        machine_id: int | None = None,
        model_state: str | None = None,
    ) -> AttemptRow:
        """Record where a claimed attempt runs, once the dispatcher knows (arguments left None
        are kept). A node given marks it and the other attempts running there shared_node.
        `Conflict` if the attempt is no longer running."""
        if model_state is not None and model_state not in MODEL_STATES:
            raise ValueError(f"model_state {model_state!r} is not one of {', '.join(MODEL_STATES)}")
        with self._session() as session:
            attempt = self._get(session, Attempt, attempt_id, "attempt", for_update=True)
            if attempt.status != "running":
                raise Conflict(f"attempt {attempt_id} is {attempt.status}, not running; stop working on it")
            for name, value in (("worker", worker), ("node", node), ("gpu_name", gpu_name),
                                ("gpu_index", gpu_index), ("machine_id", machine_id),
                                ("model_state", model_state)):
                if value is not None:
                    setattr(attempt, name, value)
            if node:
                attempt.shared_node = self._mark_shared(session, attempt.id, node)
            session.flush()
            return attempt.to_record()

    @_retried
    def renew_lease(self, attempt_id: int, lease_s: float) -> bool:
        """Extend a running attempt's lease to now + `lease_s`. False means stop after the
        episode in flight: the attempt is no longer running (reaped as lost, released) or
        its screen was cancelled (the lease is still extended, so that the episode can
        finish; then `finish_attempt(status='cancelled')`)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s {lease_s} must be > 0")
        with self._session() as session:
            attempt = self._get(session, Attempt, attempt_id, "attempt", for_update=True)
            if attempt.status != "running":
                return False
            attempt.lease_expires_at = self._clock() + timedelta(seconds=lease_s)
            screen = session.get_one(Screen, attempt.screen_id)
            return screen.cancel_requested_at is None

    @_retried
    def reap_expired(self, now: datetime | None = None) -> list[Reaped]:
        """Turn running attempts whose lease expired before `now` (default: the clock) into
        `lost` ones (their partial archives stay, auditable as incomplete). Each screen is
        requeued while attempts_used < max_attempts, else failed; a screen with a cancel
        request becomes cancelled. Safe to call from every dispatcher at once: an attempt is
        reaped once (PostgreSQL skips rows another reaper or a renewal holds)."""
        with self._session() as session:
            now = now or self._clock()
            query = (
                select(Attempt)
                .where(Attempt.status == "running", Attempt.lease_expires_at < now)
                .order_by(Attempt.id)
            )
            if self.dialect == "postgresql":
                query = query.with_for_update(skip_locked=True)
            reaped = []
            for attempt in session.scalars(query).all():
                attempt.status = "lost"
                attempt.finished_at = now
                attempt.error = (f"lease expired at {attempt.lease_expires_at.isoformat(timespec='seconds')}: "
                                 f"dispatcher {attempt.dispatcher_id} stopped renewing it")
                screen = session.get_one(Screen, attempt.screen_id, with_for_update=True)
                if screen.cancel_requested_at is not None:
                    screen.status, screen.finished_at = "cancelled", now
                elif screen.attempts_used < screen.max_attempts:
                    screen.status, screen.finished_at = "queued", None
                else:
                    screen.status, screen.finished_at = "failed", now
                reaped.append(Reaped(attempt_id=attempt.id, screen_id=screen.id, screen_status=screen.status))
            return reaped

    @_retried
    def release(self, attempt_id: int, reason: str) -> str:
        """A dispatcher shutting down cleanly gives a running attempt back: it becomes
        `interrupted` (error = `reason`, its partial archive kept) and its screen is requeued
        (cancelled if a cancel was requested); the claim does not count against max_attempts.
        Return the screen's new status. `Conflict` if the attempt is not running."""
        with self._session() as session:
            attempt = self._get(session, Attempt, attempt_id, "attempt", for_update=True)
            if attempt.status != "running":
                raise Conflict(f"attempt {attempt_id} is already {attempt.status}; nothing to release")
            now = self._clock()
            attempt.status, attempt.error, attempt.finished_at = "interrupted", reason, now
            screen = session.get_one(Screen, attempt.screen_id, with_for_update=True)
            screen.attempts_used = max(screen.attempts_used - 1, 0)
            if screen.cancel_requested_at is not None:
                screen.status, screen.finished_at = "cancelled", now
            else:
                screen.status, screen.finished_at = "queued", None
            return screen.status

    @_retried
    def cancel_screen(self, ref: int | str) -> ScreenRow:
        """Cancel a screen (id or 'latest'). Queued: it becomes cancelled and never runs.
        Running: a cancel is requested; its dispatcher learns it at the next `renew_lease`,
        stops after the episode in flight and finishes the attempt as cancelled (partial
        archive kept), or the reaper cancels it if the lease expires. `Conflict` for a
        finished screen. Returns the screen as it now is."""
        with self._session() as session:
            screen = queries.find_screen(session, ref, for_update=True)
            if screen.status == "queued":
                screen.status, screen.finished_at = "cancelled", self._clock()
            elif screen.status == "running":
                if screen.cancel_requested_at is None:
                    screen.cancel_requested_at = self._clock()
            else:
                raise Conflict(f"screen {screen.id} is already {screen.status}; only a queued or running "
                               f"screen can be cancelled")
            session.flush()
            return screen.to_record()

    @_retried
    def retry_screen(self, ref: int | str) -> ScreenRow:
        """Queue a failed or cancelled screen (id or 'latest') again with a fresh attempt
        budget (attempts_used 0). Its earlier attempts stay as they are; the next claim adds
        one. `Conflict` for a queued, running or done screen (submit the protocol again
        to re-run a done one)."""
        with self._session() as session:
            screen = queries.find_screen(session, ref, for_update=True)
            if screen.status not in ("failed", "cancelled"):
                raise Conflict(f"screen {screen.id} is {screen.status}; only a failed or cancelled screen "
                               f"can be retried")
            screen.status, screen.finished_at, screen.attempts_used = "queued", None, 0
            screen.cancel_requested_at, screen.unplaceable_reason = None, None
            session.flush()
            return screen.to_record()

    @_retried
    def set_unplaceable(self, screen_id: int, reason: str | None) -> bool:
        """Say why no dispatcher can place a queued screen now (None clears it); it stays
        queued and `packbench status` shows the reason. False if it is no longer queued."""
        with self._session() as session:
            done = session.execute(
                update(Screen)
                .where(Screen.id == screen_id, Screen.status == "queued")
                .values(unplaceable_reason=reason)
                .returning(Screen.id)
                .execution_options(synchronize_session=False)
            ).all()
            return bool(done)

    def replica_nodes(self, replica_group: str) -> set[str]:
        """Nodes where screens of `replica_group` run or ran to completion."""
        with self._session() as session:
            query = (
                select(Attempt.node).distinct().join(Screen, Screen.id == Attempt.screen_id)
                .where(Screen.replica_group == replica_group, Attempt.status.in_(("running", "done")))
            )
            return set(session.scalars(query))

    def queue_status(self, *, live_within_s: float = 30.0) -> QueueStatus:
        """`packbench status`: screens per state, running screens with progress and placement,
        the queue in claim order with unplaceable reasons, dispatchers (live: a heartbeat
        within `live_within_s`) and their workers."""
        with self._session() as session:
            return queries.queue_status(session, now=self._clock(), live_within_s=live_within_s)

    # -- episodes and verdicts ---------------------------------------------------------

    @_retried
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

    @_retried
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

    def ping(self) -> None:
        """One round trip (`SELECT 1`), tried once: raises `DatabaseUnavailable` while the
        database is down (what `dispatch --follow` probes with while it waits)."""
        with self._session() as session:
            session.execute(select(1))

    @_retried
    def reconcile_targets(self, *, attempt_ids: Collection[int] | None = None,
                          finished_since: datetime | None = None) -> list[ReconcileTarget]:
        """Attempts whose archive may hold episodes without a row, with the plan indexes
        stored for each: `attempt_ids` (running ones included), or every attempt that is not
        running (its dispatcher writes it, and reconciles its own when the database is back),
        only those finished at or after `finished_since` when given."""
        with self._session() as session:
            query = select(Attempt).order_by(Attempt.id)
            if attempt_ids is not None:
                query = query.where(Attempt.id.in_(list(attempt_ids)))
            else:
                query = query.where(Attempt.status != "running")
                if finished_since is not None:
                    query = query.where(Attempt.finished_at >= finished_since)
            attempts = session.scalars(query).all()
            stored: dict[int, set[int]] = {a.id: set() for a in attempts}
            ids = list(stored)
            for chunk in range(0, len(ids), 500):  # bounded IN lists
                for attempt_id, plan_index in session.execute(
                    select(Episode.attempt_id, Episode.plan_index).where(Episode.attempt_id.in_(ids[chunk:chunk + 500]))
                ):
                    stored[attempt_id].add(plan_index)
            return [ReconcileTarget(a.to_record(), frozenset(stored[a.id])) for a in attempts]

    @_retried
    def put_reconciled(self, attempt_id: int, records: Sequence[Mapping[str, Any]], *, check: str) -> int:
        """Insert episode rows recovered from the attempt's archive, in one transaction, and
        note it on the attempt (`reconciled_at`, `reconciled_episodes`, `reconciled_check`);
        return how many were new. Idempotent: INSERT ... ON CONFLICT (attempt_id, plan_index)
        DO NOTHING, so a row that arrived meanwhile (or a second reconciler) inserts nothing."""
        if check not in RECONCILE_CHECKS:
            raise ValueError(f"check {check!r} is not one of {', '.join(RECONCILE_CHECKS)}")
        rows = [_episode_columns(attempt_id, record) for record in records]
        with self._session() as session:
            attempt = self._get(session, Attempt, attempt_id, "attempt", for_update=True)
            inserted = self._insert_ignore(session, Episode, rows, ["attempt_id", "plan_index"]) if rows else 0
            if inserted:
                attempt.reconciled_at = self._clock()
                attempt.reconciled_episodes = (attempt.reconciled_episodes or 0) + inserted
                weakest = max(RECONCILE_CHECKS.index(attempt.reconciled_check or check), RECONCILE_CHECKS.index(check))
                attempt.reconciled_check = RECONCILE_CHECKS[weakest]
            return inserted

    def episodes(self, attempt_id: int) -> list[EpisodeRow]:
        """The attempt's episodes, by plan_index."""
        with self._session() as session:
            query = select(Episode).where(Episode.attempt_id == attempt_id).order_by(Episode.plan_index)
            return [episode.to_record() for episode in session.scalars(query)]

    @_retried
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

    @_retried
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
        node: str | None = None,
        kind: str | None = None,
    ) -> int:
        """Append one audit run ('agree' or 'disagree'); return its id. Never deduplicated:
        repeat audits are evidence in their own right. Times must be timezone-aware.
        `machine` is the host that asked for the audit, `node` the one it ran on (a Ray
        node for kind 'ray', the same host for 'local')."""
        if kind is not None and kind not in AUDIT_KINDS:
            raise ValueError(f"audit kind {kind!r} is not one of {', '.join(AUDIT_KINDS)}")
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
                node=node,
                kind=kind,
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

    def condition_tiers(self, protocol_sha256s: Iterable[str]) -> dict[str, dict[str, str]]:
        """protocol SHA-256 -> condition name -> tier (`exact` or `approximate`), from each
        stored protocol's frozen body (its conditions' policies): what `results` and `compare`
        label every row with. A condition whose policy cannot be read has no entry."""
        from core.registry import tier_of

        wanted = sorted(set(protocol_sha256s))
        out: dict[str, dict[str, str]] = {}
        with self._session() as session:
            for start in range(0, len(wanted), 500):
                rows = session.execute(select(Protocol.sha256, Protocol.canonical_json)
                                       .where(Protocol.sha256.in_(wanted[start:start + 500])))
                for sha, body in rows:
                    conditions = json.loads(body).get("conditions")
                    out[sha] = {c["name"]: tier_of(c["policy"]) for c in conditions if isinstance(c, dict)
                                and isinstance(c.get("name"), str) and isinstance(c.get("policy"), str)} \
                        if isinstance(conditions, list) else {}
        return out

    def condition_names(self) -> list[str]:
        """Every condition name of a stored episode, sorted (what `results --condition` can match)."""
        with self._session() as session:
            return queries.condition_names(session)

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

    # -- evidence (issue 10): signers, what an attempt measured, ingested attempts ----------

    @_retried
    def put_signer(self, *, key_id: str, public_key: str, name: str, local: bool = False) -> SignerRow:
        """Register an Ed25519 public key (64 hex); idempotent on the key. Returns the stored row
        (an already registered key keeps its first name and locality)."""
        with self._session() as session:
            values = {"key_id": key_id, "public_key": public_key, "name": name, "local": local,
                      "created_at": self._clock()}
            self._insert_ignore(session, Signer, [values], ["key_id"])
            return session.scalars(select(Signer).where(Signer.key_id == key_id)).one().to_record()

    def signers(self) -> list[SignerRow]:
        with self._session() as session:
            return [row.to_record() for row in session.scalars(select(Signer).order_by(Signer.id))]

    @_retried
    def set_attempt_evidence(self, attempt_id: int, *, model_sha256: str | None = None,
                             signer_key_id: str | None = None) -> None:
        """Record the checkpoint digest an attempt measured and/or the key that signed its archive."""
        with self._session() as session:
            attempt = self._get(session, Attempt, attempt_id, "attempt")
            if model_sha256 is not None:
                attempt.model_sha256 = model_sha256
            if signer_key_id is not None:
                attempt.signer_key_id = signer_key_id

    @_retried
    def ingest_attempt(self, *, protocol_sha256: str, protocol_name: str, protocol_json: str,
                       machine: Mapping[str, str | None], attempt: Mapping[str, Any],
                       episodes: list[Mapping[str, Any]], verdicts: list[Mapping[str, Any]]) -> AttemptRow:
        """Record a screen audited elsewhere (`packbench ingest`) in ONE transaction: its
        protocol (idempotent), machine (idempotent), a done screen, one done attempt marked
        with `ingested_from`, its episodes and verdicts. Nothing is written if any part fails.
        The same archive (by SHA-256) is never ingested twice."""
        with self._session() as session:
            if session.scalar(select(Attempt.id).where(Attempt.archive_sha256 == attempt["archive_sha256"])):
                raise Conflict(f"an attempt with archive SHA-256 {attempt['archive_sha256'][:16]}... is already "
                               f"in this database; nothing was ingested")
            now = self._clock()
            self._insert_ignore(session, Protocol, [{
                "sha256": protocol_sha256, "name": protocol_name, "canonical_json": protocol_json,
                **protocol_columns(protocol_json), "created_at": now}], ["sha256"])
            protocol_id = session.scalars(select(Protocol.id).where(Protocol.sha256 == protocol_sha256)).one()
            key = {k: machine.get(k) or "" for k in ("host", "gpu_name", "driver", "torch", "cuda")}
            self._insert_ignore(session, Machine, [key], list(key))
            machine_id = session.scalars(select(Machine.id).filter_by(**key)).one()
            screen = Screen(protocol_id=protocol_id, submitter=str(attempt.get("submitter") or "ingest"),
                            repetitions=1, model_dir=None, status="done", created_at=now, started_at=now,
                            finished_at=now, priority=0, max_attempts=1, attempts_used=1)
            session.add(screen)
            session.flush()
            row = Attempt(attempt_key=new_attempt_key(), screen_id=screen.id, number=1,
                          worker=str(attempt.get("worker") or "ingested"), node=str(attempt.get("node") or ""),
                          gpu_name=key["gpu_name"], gpu_index=0, machine_id=machine_id, status="done",
                          archive_path=str(attempt["archive_path"]), archive_sha256=attempt["archive_sha256"],
                          source_freeze=json_text(attempt.get("source_freeze") or {}), started_at=now,
                          finished_at=now, model_sha256=attempt.get("model_sha256"),
                          signer_key_id=attempt.get("signer_key_id"), ingested_from=str(attempt["ingested_from"]))
            session.add(row)
            session.flush()
            rows = [_episode_columns(row.id, e) for e in episodes]
            if rows:
                self._insert_ignore(session, Episode, rows, ["attempt_id", "plan_index"])
            vrows = [_verdict_columns(row.id, v) for v in verdicts]
            if vrows:
                self._insert_ignore(session, Verdict, vrows, ["attempt_id", "gate", "condition", "phase"])
            session.flush()
            return row.to_record()


    # -- labels, sweeps and history (db.labels, db.history) -----------------------------

    @staticmethod
    def check_labels(*, name: str | None = None, tags: Mapping[str, str] | None = None) -> None:
        """Refuse (InvalidFilter, one line) a name or tags that `label_screen` would refuse."""
        labels.check_name(name)
        labels.check_tags(tags or {})

    def label_screen(self, ref: int | str, *, name: str | None = None, note: str | None = None,
                     tags: Mapping[str, str] | None = None, untag: Iterable[str] = ()) -> int:
        """Set a screen's name, note and tags (`db.labels.label`); return its id."""
        with self._session() as session:
            return labels.label(session, ref, name=name, note=note, tags=tags, untag=untag)

    def set_sweep(self, screen_id: int, *, sweep_id: str, point: Mapping[str, Any]) -> None:
        """Record the sweep a screen belongs to and the values its protocol took."""
        with self._session() as session:
            labels.set_sweep(session, screen_id, sweep_id=sweep_id, point=point)

    def screen_tags(self, screen_ids: Iterable[int]) -> dict[int, dict[str, str]]:
        """Each screen's tags."""
        with self._session() as session:
            return labels.tags_of(session, screen_ids)

    def tagged_screens(self, tags: Mapping[str, str]) -> set[int]:
        """The ids of the screens carrying every one of `tags` (a value '*' matches any)."""
        with self._session() as session:
            return labels.tagged_ids(session, tags)

    def find_screens(self, **filters: Any) -> list[ScreenRow]:
        """Screens, newest first, by protocol, status, name, tags, sweep id, ids (`db.labels.screens`)."""
        with self._session() as session:
            return labels.screens(session, **filters)

    def history_runs(self, protocol: str) -> list[HistoryRun]:
        """A protocol's done screens with their recorded source commits (`db.history.runs`)."""
        with self._session() as session:
            return history.runs(session, protocol)

def resources_json(resources: Mapping[str, float] | None) -> str | None:
    """A screen's `resources` column: canonical JSON of its needs (sorted keys), None for none.
    Canonical so that equal needs are equal strings (the claim matches them with IN)."""
    if not resources:
        return None
    return json.dumps({k: resources[k] for k in sorted(resources)}, separators=(",", ":"))


def _node_lock_key(node: str) -> int:
    """The PostgreSQL advisory-lock key of a node: 64 bits of its id's SHA-256 (signed bigint)."""
    return int.from_bytes(hashlib.sha256(node.encode()).digest()[:8], "big", signed=True)


def _fitting(connection: Connection, node: str, capacity: Mapping[str, float], follows: int | None) -> list[str]:
    """The distinct `resources` values of queued screens that fit on `node` now: its declared
    `capacity` less the needs of the screens running there (the slot's own `follows` attempt
    excepted: it ends before the claimed screen starts). Run inside the claim's transaction,
    after the node's lock, so no other claim for the node changes the answer meanwhile."""
    screens, attempts = Screen.__table__, Attempt.__table__
    queued = connection.execute(select(screens.c.resources).distinct().where(
        screens.c.status == "queued", screens.c.resources.is_not(None))).scalars().all()
    if not queued:
        return []
    here = [attempts.c.node == node, attempts.c.status == "running", screens.c.resources.is_not(None)]
    if follows is not None:
        here.append(attempts.c.id != follows)
    free = dict(capacity)
    for used in connection.execute(select(screens.c.resources).join(attempts, attempts.c.screen_id == screens.c.id)
                                   .where(*here)).scalars():
        for name, amount in json.loads(used).items():
            free[name] = free.get(name, 0.0) - amount
    return [needs for needs in queued if resources_fit(json.loads(needs), free)]


def _claim_candidate(dialect: str, *, one: bool, exclude: bool, gpu_types: bool, node: bool, follows: bool = False,
                     fits: bool = False) -> Any:
    """SELECT the best placeable queued screen's id ... LIMIT 1 [FOR UPDATE OF candidate SKIP
    LOCKED]. Parameters: want_screen, exclude_ids (a list), gpu_type_list (a list),
    slot_node, follows_id (the slot's own attempt, not counted as running on the node),
    fit_list (the `resources` values that fit; without `fits` only screens needing none):
    those of the filters given."""
    screens, attempts = Screen.__table__, Attempt.__table__
    candidate = screens.alias("candidate")
    query = select(candidate.c.id).where(candidate.c.status == "queued")
    if one:
        query = query.where(candidate.c.id == bindparam("want_screen"))
    if exclude:
        query = query.where(candidate.c.id.not_in(bindparam("exclude_ids", expanding=True)))
    if gpu_types:
        query = query.where(or_(candidate.c.gpu_type.is_(None),
                                candidate.c.gpu_type.in_(bindparam("gpu_type_list", expanding=True))))
    if node:
        other, its = screens.alias("other"), attempts.alias("its")
        here = bindparam("slot_node")
        on_node = select(its.c.id).join(other, other.c.id == its.c.screen_id).where(its.c.node == here)
        running_here = on_node.where(its.c.status == "running")
        if follows:
            running_here = running_here.where(its.c.id != bindparam("follows_id"))
        query = query.where(
            or_(candidate.c.placement_node.is_(None), candidate.c.placement_node == here),
            ~exists(running_here.where(other.c.exclusive_node.is_(True))),
            or_(candidate.c.exclusive_node.is_(False), ~exists(running_here)),
            or_(candidate.c.replica_group.is_(None), ~exists(on_node.where(
                other.c.replica_group == candidate.c.replica_group, other.c.id != candidate.c.id,
                its.c.status.in_(("running", "done"))))),
        )
    if fits:
        query = query.where(or_(candidate.c.resources.is_(None),
                                candidate.c.resources.in_(bindparam("fit_list", expanding=True))))
    else:
        query = query.where(candidate.c.resources.is_(None))
    query = query.order_by(candidate.c.priority.desc(), candidate.c.id).limit(1)
    if dialect == "postgresql":
        query = query.with_for_update(skip_locked=True, of=candidate)
    return query


def _claim_update(dialect: str, **filters: bool) -> Any:
    """UPDATE screens SET status = 'running', ... WHERE status = 'queued' AND id = (the
    candidate) RETURNING screens.*, the screen's next attempt number ("number")."""
    screens, attempts = Screen.__table__, Attempt.__table__
    following = (
        select(func.coalesce(func.max(attempts.c.number), 0) + 1)
        .where(attempts.c.screen_id == screens.c.id)
        .scalar_subquery()
    )
    return (
        update(screens)
        .where(screens.c.id == _claim_candidate(dialect, **filters).scalar_subquery(),
               screens.c.status == "queued")
        .values(status="running", attempts_used=screens.c.attempts_used + 1,
                started_at=func.coalesce(screens.c.started_at, bindparam("now", type_=UtcDateTime())),
                finished_at=None, unplaceable_reason=None)
        .returning(*screens.c, following.label("number"))
    )


@functools.lru_cache(maxsize=None)
def _claim_statement(dialect: str, **shape: bool) -> Any:
    """`claim_screen`'s UPDATE on SQLite (the attempt is inserted next, in the same
    transaction), built and compiled once per filter shape."""
    return _claim_update(dialect, **shape)


@functools.lru_cache(maxsize=None)
def _pg_claim_statement(*, one: bool, exclude: bool, gpu_types: bool, node: bool, follows: bool = False,
                        fits: bool = False) -> Any:
    """`claim_screen` on PostgreSQL as ONE statement, run in autocommit (one round trip):

        WITH claimed AS (UPDATE screens ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED)
                         RETURNING screens.*, next attempt number),
             attempt AS (INSERT INTO attempts SELECT ... FROM claimed RETURNING attempts.*),
             shared  AS (UPDATE attempts SET shared_node = true WHERE running on :node, if a
                         screen was claimed and a node given)
        SELECT claimed.*, attempt.* (as a_<column>) FROM claimed, attempt

    The archive path is formatted in SQL exactly as `archive_file_name` does. The new
    attempt is shared_node when another attempt runs on the node (the statement's snapshot
    does not see the new row, so `shared` leaves it alone).
    """
    screens, attempts = Screen.__table__, Attempt.__table__
    claimed = _claim_update("postgresql", one=one, exclude=exclude, gpu_types=gpu_types, node=node, follows=follows,
                            fits=fits).cte("claimed")
    here = bindparam("slot_node", type_=String())
    # The slot's own attempt (a look-ahead claim) is neither sharing the node nor shared with.
    others = (attempts.c.id != bindparam("follows_id"),) if follows else ()
    running_here = exists().where(attempts.c.node == here, attempts.c.status == "running", *others)
    id_text = cast(claimed.c.id, Text)
    path = func.format("%s/screen-%s-attempt-%s-%s.zip", bindparam("archive_dir", type_=String()),
                       func.lpad(id_text, func.greatest(5, func.length(id_text)), "0"), claimed.c.number,
                       bindparam("new_attempt_key", type_=String()))
    given = ("attempt_key", "worker", "node", "gpu_name", "gpu_index", "machine_id", "status", "error",
             "archive_sha256", "source_freeze", "started_at", "finished_at", "dispatcher_id",
             "lease_expires_at", "model_state")
    # Named new_<column>: an execution parameter named like a column would become part of
    # the DML statements' SET / VALUES clauses.
    columns = {name: bindparam(f"new_{name}", type_=attempts.c[name].type) for name in given}
    columns.update(screen_id=claimed.c.id, number=claimed.c.number, archive_path=path,
                   shared_node=running_here if node else null())
    attempt = (
        insert(attempts)
        .from_select(list(columns), select(*columns.values()))
        .returning(*attempts.c)
        .cte("attempt")
    )
    final = select(*(c for c in claimed.c if c.name != "number"),
                   *(c.label(f"a_{c.name}") for c in attempt.c)).select_from(claimed.join(attempt, true()))
    if node:
        shared = (
            update(attempts)
            .where(attempts.c.node == here, attempts.c.status == "running", *others,
                   or_(attempts.c.shared_node.is_(None), attempts.c.shared_node.is_(False)),
                   exists(select(claimed.c.id)))
            .values(shared_node=True)
            .cte("shared")
        )
        final = final.add_cte(shared)
    return final


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
    """Flatten a worker's episode record into `episodes` columns (`core.record` says which)."""
    return {"attempt_id": attempt_id, **stored_values(record)}


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
