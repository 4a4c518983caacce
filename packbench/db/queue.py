"""The job queue: screens and attempts move through their states here, in rows and transactions.

- Screens: queued -> running -> done | failed | cancelled. Attempts: running -> done |
  failed | interrupted | lost | cancelled. Failed and lost attempts are kept, never reused.
- A claim (`claim_request`, then `claim_postgresql` or `claim_sqlite`) atomically moves the
  best queued screen (highest priority, then oldest) that the caller can place to running
  and creates its attempt with a random attempt_key and a lease: PostgreSQL `UPDATE ...
  WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING`, SQLite the same
  statement under `BEGIN IMMEDIATE` (every write transaction takes the write lock at BEGIN,
  see `db.session`). The dispatcher renews the lease (`renew_lease`) while the screen runs;
  `reap_expired` turns expired leases into `lost` attempts and requeues their screens up to
  `max_attempts`. Dispatchers register, heartbeat their workers and stop here too.
- Time is the caller's `clock` (the Store's), read where each transition happens.

Every function runs inside a transaction its caller opened (`Store`: one per method, with
the schema check, error translation and retries) and returns plain data from `db.records`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
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
    true,
    update,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from packbench.core.protocol import resources_fit
from packbench.db.errors import Conflict
from packbench.db.models import MODEL_STATES, SqlAttempt, SqlDispatcher, SqlProtocol, SqlScreen, UtcDateTime, json_text
from packbench.db.queries import find_screen, get_row
from packbench.db.records import AttemptRow, DispatcherRow, Reaped, ScreenRow

Clock = Callable[[], datetime]

# finish_attempt: the screen status that each final attempt status leads to. (`release`
# ends an attempt as interrupted and requeues its screen; `reap_expired` makes it lost.)
_SCREEN_STATUS_AFTER = {"done": "done", "failed": "failed", "interrupted": "failed",
                        "cancelled": "cancelled"}
WORKER_STATES = ("idle", "busy")


def archive_file_name(screen_id: int, number: int, attempt_key: str) -> str:
    """The raw archive's file name for an attempt: unique across databases and machines
    through the attempt's random key, and still sorted by screen and attempt number."""
    return f"screen-{screen_id:05d}-attempt-{number}-{attempt_key}.zip"


def new_attempt_key() -> str:
    """128 random bits as hex: no two attempts anywhere share one."""
    return secrets.token_hex(16)


def resources_json(resources: Mapping[str, float] | None) -> str | None:
    """A screen's `resources` column: canonical JSON of its needs (sorted keys), None for none.
    Canonical so that equal needs are equal strings (the claim matches them with IN)."""
    if not resources:
        return None
    for name, amount in resources.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < math.inf:
            raise ValueError(f"resource {name!r} needs {amount!r}; a need is a finite number > 0 "
                             f"(as a protocol's placement.resources says it)")
    return json.dumps({k: resources[k] for k in sorted(resources)}, separators=(",", ":"))


# -- arguments, checked before any transaction ---------------------------------------------


def check_lease(lease_s: float) -> None:
    if lease_s <= 0:
        raise ValueError(f"lease_s {lease_s} must be > 0")


def check_model_state(model_state: str | None) -> None:
    if model_state is not None and model_state not in MODEL_STATES:
        raise ValueError(f"model_state {model_state!r} is not one of {', '.join(MODEL_STATES)}")


def check_final_status(status: str) -> None:
    if status not in _SCREEN_STATUS_AFTER:
        raise ValueError(f"attempt status {status!r} is not one of {sorted(_SCREEN_STATUS_AFTER)}")


def worker_list(workers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A heartbeat's workers as stored, each state checked (one of `WORKER_STATES`)."""
    listed = []
    for worker in workers:
        if worker.get("state") not in WORKER_STATES:
            raise ValueError(f"worker state {worker.get('state')!r} is not one of {', '.join(WORKER_STATES)}")
        listed.append(dict(worker))
    return listed


# -- screens and attempts ------------------------------------------------------------------


def enqueue(session: Session, *, clock: Clock, protocol_id: int, count: int = 1, **screen: Any) -> list[int]:
    """Queue `count` screens of the stored protocol `protocol_id`, with the columns `screen`
    gives (submitter, and any of `Store.create_screen`'s options); return their ids."""
    get_row(session, SqlProtocol, protocol_id, "protocol")
    screen = {"repetitions": 1, "priority": 0, "max_attempts": 3, "exclusive_node": False, **screen,
              "resources": resources_json(screen.get("resources"))}
    ids = []
    for _ in range(count):
        row = SqlScreen(protocol_id=protocol_id, status="queued", created_at=clock(), attempts_used=0, **screen)
        session.add(row)
        session.flush()
        ids.append(row.id)
    return ids


def queued_screens(session: Session) -> list[ScreenRow]:
    """Screens waiting for a worker in claim order: highest priority, then oldest."""
    query = select(SqlScreen).where(SqlScreen.status == "queued").order_by(SqlScreen.priority.desc(), SqlScreen.id)
    return [screen.to_record() for screen in session.scalars(query)]


def start_attempt(session: Session, *, clock: Clock, screen_id: int, **placement: Any) -> AttemptRow:
    """A running attempt numbered after the screen's earlier ones (failed ones included);
    the screen becomes 'running', its started_at set on the first attempt only. `placement`:
    worker, node, gpu_name, gpu_index, machine_id, source_freeze, archive_path."""
    # FOR UPDATE (PostgreSQL) serializes concurrent starts on one screen, so two
    # attempts cannot both compute the same number. SQLite's BEGIN IMMEDIATE already
    # serializes every write transaction.
    screen = get_row(session, SqlScreen, screen_id, "screen", for_update=True)
    last = session.scalar(select(func.max(SqlAttempt.number)).where(SqlAttempt.screen_id == screen_id))
    now = clock()
    attempt = SqlAttempt(attempt_key=new_attempt_key(), screen_id=screen_id, number=(last or 0) + 1,
                         status="running", started_at=now,
                         **{**placement, "source_freeze": json_text(placement["source_freeze"])})
    session.add(attempt)
    screen.status = "running"
    if screen.started_at is None:
        screen.started_at = now
    session.flush()
    return attempt.to_record()


def finish_attempt(session: Session, attempt_id: int, *, clock: Clock, status: str, error: str | None,
                   archive_sha256: str | None, requeue: bool) -> str:
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
    attempt = get_row(session, SqlAttempt, attempt_id, "attempt", for_update=True)
    if attempt.status != "running":
        raise Conflict(
            f"attempt {attempt_id} is already {attempt.status}; finished attempts are "
            f"kept as they are: start a new attempt instead"
        )
    now = clock()
    attempt.status = status
    attempt.error = error
    attempt.archive_sha256 = archive_sha256
    attempt.finished_at = now
    screen = session.get_one(SqlScreen, attempt.screen_id, with_for_update=True)
    if requeue and status == "failed" and screen.cancel_requested_at is None \
            and screen.attempts_used < screen.max_attempts:
        screen.status, screen.finished_at = "queued", None
        return screen.status
    if requeue and screen.cancel_requested_at is not None:
        status = "cancelled"
    screen.status = _SCREEN_STATUS_AFTER[status]
    screen.finished_at = now
    return screen.status


# -- dispatchers ---------------------------------------------------------------------------


def register_dispatcher(session: Session, name: str, host: str, *, pid: int | None, clock: Clock) -> int:
    now = clock()
    dispatcher = SqlDispatcher(name=name, host=host, pid=pid, started_at=now, heartbeat_at=now, workers_json="[]")
    session.add(dispatcher)
    session.flush()
    return dispatcher.id


def heartbeat(session: Session, dispatcher_id: int, workers: list[dict[str, Any]], *, clock: Clock) -> None:
    """`workers` (from `worker_list`) replaces the dispatcher's, its heartbeat is now."""
    dispatcher = get_row(session, SqlDispatcher, dispatcher_id, "dispatcher", for_update=True)
    dispatcher.heartbeat_at = clock()
    dispatcher.workers_json = json_text(workers)


def stop_dispatcher(session: Session, dispatcher_id: int, *, clock: Clock) -> None:
    dispatcher = get_row(session, SqlDispatcher, dispatcher_id, "dispatcher", for_update=True)
    dispatcher.stopped_at = clock()
    dispatcher.workers_json = "[]"


def dispatchers(session: Session) -> list[DispatcherRow]:
    """Every dispatcher ever registered, by id."""
    return [d.to_record() for d in session.scalars(select(SqlDispatcher).order_by(SqlDispatcher.id))]


# -- claims --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRequest:
    """One claim's statement shape and parameters, for either backend (`claim_request`)."""

    node: str
    capacity: dict[str, float]  # the node's declared resources; {} without a node
    follows_attempt: int | None
    shape: dict[str, bool]  # which filters the statement has (one statement cached per shape)
    # Named unlike any column: DML takes such execution parameters as SET / VALUES.
    parameters: dict[str, Any]
    attempt_values: dict[str, Any]  # the new attempt's columns known before the claim
    key: str  # its attempt_key
    archive_dir: str  # without a trailing '/'
    source_freeze: dict[str, Any]
    now: datetime


def claim_request(dispatcher_id: int, *, clock: Clock, lease_s: float, archive_dir: str,
                  source_freeze: Mapping[str, Any], worker: str, node: str, gpu_name: str, gpu_index: int,
                  machine_id: int | None, gpu_types: Collection[str] | None, exclude_screens: Collection[int],
                  screen_id: int | None, model_state: str | None, node_resources: Mapping[str, float] | None,
                  follows_attempt: int | None) -> ClaimRequest:
    """`Store.claim_screen`'s arguments, checked, as one claim of the best queued screen this
    worker slot can run.

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
    Claims for one node are serialized too (`claim_postgresql`).
    """
    check_lease(lease_s)
    check_model_state(model_state)
    parameters: dict[str, Any] = {"want_screen": screen_id, "exclude_ids": list(exclude_screens),
                                  "gpu_type_list": list(gpu_types or ()), "slot_node": node,
                                  "follows_id": follows_attempt}
    shape = dict(one=screen_id is not None, exclude=bool(exclude_screens), gpu_types=gpu_types is not None,
                 node=bool(node), follows=bool(node) and follows_attempt is not None)
    capacity = {k: float(v) for k, v in (node_resources or {}).items()} if node else {}
    key, now = new_attempt_key(), clock()
    attempt_values = dict(
        attempt_key=key, worker=worker, node=node, gpu_name=gpu_name, gpu_index=gpu_index,
        machine_id=machine_id, status="running", error=None, archive_sha256=None,
        source_freeze=json_text(dict(source_freeze)), started_at=now, finished_at=None,
        dispatcher_id=dispatcher_id, lease_expires_at=now + timedelta(seconds=lease_s),
        model_state=model_state,
    )
    return ClaimRequest(node=node, capacity=capacity, follows_attempt=follows_attempt, shape=shape,
                        parameters=parameters, attempt_values=attempt_values, key=key,
                        archive_dir=archive_dir.rstrip("/"), source_freeze=dict(source_freeze), now=now)


# A claim is the dispatcher's hot path. Built per call through the ORM (aliases adapted, the
# statement compiled again) it cost 65 ms of CPU on the 2-core box, and the ORM session added
# a pooled checkout with its pre-ping and separate SELECTs for the attempt number and the
# protocol. So: one cached statement per filter shape; on PostgreSQL a single autocommitted
# statement (one round trip, no BEGIN/COMMIT), on SQLite UPDATE ... RETURNING then INSERT
# inside BEGIN IMMEDIATE.


def claim_postgresql(connection: Connection, request: ClaimRequest) -> tuple[ScreenRow, AttemptRow] | None:
    """The claim on PostgreSQL, on an autocommit `connection`: one statement
    (`_pg_claim_statement`). Claims for one node are serialized, so that the node checks
    (exclusive_node, shared_node, resources) see every claim committed before them: a
    transaction-scoped advisory lock on the node is taken before the claim's snapshot.
    Without it, two dispatchers claiming for one node at once each saw the node free and
    both started a screen there, one of them exclusive_node."""
    fits: list[str] = []
    try:
        if request.node:
            # BEGIN and the node's lock in one round trip (no parameters: the key is an int).
            connection.exec_driver_sql(f"BEGIN; SELECT pg_advisory_xact_lock({_node_lock_key(request.node)})")
            if request.capacity:
                fits = _fitting(connection, request.node, request.capacity, request.follows_attempt)
        statement = _pg_claim_statement(**request.shape, fits=bool(fits))
        row = connection.execute(statement, {
            **request.parameters, "fit_list": fits, **{f"new_{k}": v for k, v in request.attempt_values.items()},
            "now": request.now, "archive_dir": request.archive_dir}).first()
        if request.node:
            connection.exec_driver_sql("COMMIT")
    except BaseException:
        if request.node:
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
    attempt = dataclasses.replace(attempt, source_freeze=request.source_freeze)
    screen = ScreenRow(**values)
    assert attempt.archive_path.endswith(archive_file_name(screen.id, attempt.number, request.key))
    return screen, attempt


def claim_sqlite(connection: Connection, request: ClaimRequest) -> tuple[ScreenRow, AttemptRow] | None:
    """The claim on SQLite, inside the caller's BEGIN IMMEDIATE transaction (which
    serializes claims): UPDATE ... RETURNING the screen, then INSERT its attempt."""
    attempts = SqlAttempt.__table__
    fits = _fitting(connection, request.node, request.capacity, request.follows_attempt) if request.capacity else []
    statement = _claim_statement("sqlite", **request.shape, fits=bool(fits))
    row = connection.execute(statement, {**request.parameters, "fit_list": fits, "now": request.now}).first()
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
    attempt_values = dict(
        request.attempt_values, screen_id=screen.id, number=number,
        shared_node=mark_shared(connection, request.follows_attempt, request.node) if request.node else None,
        archive_path=f"{request.archive_dir}/{archive_file_name(screen.id, number, request.key)}")
    attempt_id = connection.execute(insert(attempts).values(attempt_values).returning(attempts.c.id)).scalar_one()
    return screen, AttemptRow(id=attempt_id, **{**attempt_values, "source_freeze": request.source_freeze})


def mark_shared(connection: Connection | Session, attempt_id: int | None, node: str) -> bool:
    """Whether attempts other than `attempt_id` run on `node` now; if so they are marked
    shared_node too (only those not marked yet: a busy node's attempts are not rewritten
    at every claim)."""
    attempts = SqlAttempt.__table__
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


def place_attempt(session: Session, attempt_id: int, placement: Mapping[str, Any]) -> AttemptRow:
    """Set the claimed attempt's `placement` values that are not None (worker, node,
    gpu_name, gpu_index, machine_id, model_state); a node marks it and the attempts running
    there shared_node. `Conflict` if the attempt is no longer running."""
    attempt = get_row(session, SqlAttempt, attempt_id, "attempt", for_update=True)
    if attempt.status != "running":
        raise Conflict(f"attempt {attempt_id} is {attempt.status}, not running; stop working on it")
    for name, value in placement.items():
        if value is not None:
            setattr(attempt, name, value)
    if placement.get("node"):
        attempt.shared_node = mark_shared(session, attempt.id, placement["node"])
    session.flush()
    return attempt.to_record()


# -- leases, reaping, release, cancellation ------------------------------------------------


def renew_lease(session: Session, attempt_id: int, lease_s: float, *, clock: Clock) -> bool:
    """Extend a running attempt's lease to now + `lease_s`. False means stop after the
    episode in flight: the attempt is no longer running (reaped as lost, released) or
    its screen was cancelled (the lease is still extended, so that the episode can
    finish; then `finish_attempt(status='cancelled')`)."""
    attempt = get_row(session, SqlAttempt, attempt_id, "attempt", for_update=True)
    if attempt.status != "running":
        return False
    attempt.lease_expires_at = clock() + timedelta(seconds=lease_s)
    screen = session.get_one(SqlScreen, attempt.screen_id)
    return screen.cancel_requested_at is None


def _reapable(now: datetime, dialect: str, host: str | None) -> Any:
    """SELECT the running attempts whose lease expired before `now`, and (with `host`) every
    running attempt of a dispatcher on `host`, each with its dispatcher; on PostgreSQL skipping
    rows another reaper or a renewal holds, so every dispatcher may reap at once."""
    expired = SqlAttempt.lease_expires_at < now
    query = (
        select(SqlAttempt, SqlDispatcher)
        .outerjoin(SqlDispatcher, SqlDispatcher.id == SqlAttempt.dispatcher_id)
        .where(SqlAttempt.status == "running", expired if host is None else or_(expired, SqlDispatcher.host == host))
        .order_by(SqlAttempt.id)
    )
    return query.with_for_update(skip_locked=True, of=SqlAttempt) if dialect == "postgresql" else query


def reap_expired(session: Session, now: datetime | None, *, clock: Clock, host: str | None = None,
                 alive: Callable[[int, datetime], bool] | None = None) -> list[Reaped]:
    """Turn running attempts whose lease expired before `now` (default: the clock) into
    `lost` ones (their partial archives stay, auditable as incomplete). Each screen is
    requeued while attempts_used < max_attempts, else failed; a screen with a cancel
    request becomes cancelled. Safe to call from every dispatcher at once: an attempt is
    reaped once (PostgreSQL skips rows another reaper or a renewal holds).

    `host` and `alive(pid, started_at)` (the reaper's host, and whether the process `pid`
    started by `started_at` still runs there): an attempt whose dispatcher is on this host is
    judged by its process, not its lease: never reaped while it lives (a live `dispatch
    --follow` renews its leases once a database outage ends, however long it was), reaped at
    once when it is gone (a killed driver holds nothing for the rest of its lease)."""
    if (host is None) != (alive is None):
        raise ValueError("reap_expired judges a host's attempts by their process: give host and alive together, "
                         "or neither (leases only)")
    now = now or clock()
    reaped = []
    for attempt, dispatcher in session.execute(_reapable(now, session.get_bind().dialect.name, host)).all():
        here = host is not None and dispatcher is not None and dispatcher.host == host and dispatcher.pid is not None
        if here and alive(dispatcher.pid, dispatcher.started_at):
            continue  # its holder lives on this host: it renews the lease once it can
        if here:
            why = f"its dispatcher (pid {dispatcher.pid} on {host}) is gone"
            attempt.error = f"dispatcher {attempt.dispatcher_id} is gone: its process (pid {dispatcher.pid} on {host}) ended"
        else:
            why = "lease expired"
            attempt.error = (f"lease expired at {attempt.lease_expires_at.isoformat(timespec='seconds')}: "
                             f"dispatcher {attempt.dispatcher_id} stopped renewing it")
        attempt.status = "lost"
        attempt.finished_at = now
        screen = session.get_one(SqlScreen, attempt.screen_id, with_for_update=True)
        if screen.cancel_requested_at is not None:
            screen.status, screen.finished_at = "cancelled", now
        elif screen.attempts_used < screen.max_attempts:
            screen.status, screen.finished_at = "queued", None
        else:
            screen.status, screen.finished_at = "failed", now
        reaped.append(Reaped(attempt_id=attempt.id, screen_id=screen.id, screen_status=screen.status, why=why,
                             attempt_number=attempt.number))
    return reaped


def release(session: Session, attempt_id: int, reason: str, *, clock: Clock) -> str:
    """A dispatcher shutting down cleanly gives a running attempt back: it becomes
    `interrupted` (error = `reason`, its partial archive kept) and its screen is requeued
    (cancelled if a cancel was requested); the claim does not count against max_attempts.
    Return the screen's new status. `Conflict` if the attempt is not running."""
    attempt = get_row(session, SqlAttempt, attempt_id, "attempt", for_update=True)
    if attempt.status != "running":
        raise Conflict(f"attempt {attempt_id} is already {attempt.status}; nothing to release")
    now = clock()
    attempt.status, attempt.error, attempt.finished_at = "interrupted", reason, now
    screen = session.get_one(SqlScreen, attempt.screen_id, with_for_update=True)
    screen.attempts_used = max(screen.attempts_used - 1, 0)
    if screen.cancel_requested_at is not None:
        screen.status, screen.finished_at = "cancelled", now
    else:
        screen.status, screen.finished_at = "queued", None
    return screen.status


def cancel_screen(session: Session, ref: int | str, *, clock: Clock) -> ScreenRow:
    """Cancel a screen (id or 'latest'). Queued: it becomes cancelled and never runs.
    Running: a cancel is requested; its dispatcher learns it at the next `renew_lease`,
    stops after the episode in flight and finishes the attempt as cancelled (partial
    archive kept), or the reaper cancels it if the lease expires. `Conflict` for a
    finished screen. Returns the screen as it now is."""
    screen = find_screen(session, ref, for_update=True)
    if screen.status == "queued":
        screen.status, screen.finished_at = "cancelled", clock()
    elif screen.status == "running":
        if screen.cancel_requested_at is None:
            screen.cancel_requested_at = clock()
    else:
        raise Conflict(f"screen {screen.id} is already {screen.status}; only a queued or running "
                       f"screen can be cancelled")
    session.flush()
    return screen.to_record()


def retry_screen(session: Session, ref: int | str) -> ScreenRow:
    """Queue a failed or cancelled screen (id or 'latest') again with a fresh attempt
    budget (attempts_used 0). Its earlier attempts stay as they are; the next claim adds
    one. `Conflict` for a queued, running or done screen (submit the protocol again
    to re-run a done one)."""
    screen = find_screen(session, ref, for_update=True)
    if screen.status not in ("failed", "cancelled"):
        raise Conflict(f"screen {screen.id} is {screen.status}; only a failed or cancelled screen "
                       f"can be retried")
    screen.status, screen.finished_at, screen.attempts_used = "queued", None, 0
    screen.cancel_requested_at, screen.unplaceable_reason = None, None
    session.flush()
    return screen.to_record()


def set_unplaceable(session: Session, screen_id: int, reason: str | None) -> bool:
    """Record why a queued screen cannot be placed (None clears it); False if not queued."""
    done = session.execute(
        update(SqlScreen)
        .where(SqlScreen.id == screen_id, SqlScreen.status == "queued")
        .values(unplaceable_reason=reason)
        .returning(SqlScreen.id)
        .execution_options(synchronize_session=False)
    ).all()
    return bool(done)


def replica_nodes(session: Session, replica_group: str) -> set[str]:
    """Nodes where screens of `replica_group` run or ran to completion."""
    query = (
        select(SqlAttempt.node).distinct().join(SqlScreen, SqlScreen.id == SqlAttempt.screen_id)
        .where(SqlScreen.replica_group == replica_group, SqlAttempt.status.in_(("running", "done")))
    )
    return set(session.scalars(query))


# -- the claim's statements ----------------------------------------------------------------


def _node_lock_key(node: str) -> int:
    """The PostgreSQL advisory-lock key of a node: 64 bits of its id's SHA-256 (signed bigint)."""
    return int.from_bytes(hashlib.sha256(node.encode()).digest()[:8], "big", signed=True)


def _fitting(connection: Connection, node: str, capacity: Mapping[str, float], follows: int | None) -> list[str]:
    """The distinct `resources` values of queued screens that fit on `node` now: its declared
    `capacity` less the needs of the screens running there (the slot's own `follows` attempt
    excepted: it ends before the claimed screen starts). Run inside the claim's transaction,
    after the node's lock, so no other claim for the node changes the answer meanwhile."""
    screens, attempts = SqlScreen.__table__, SqlAttempt.__table__
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
    screens, attempts = SqlScreen.__table__, SqlAttempt.__table__
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
    screens, attempts = SqlScreen.__table__, SqlAttempt.__table__
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
    attempts = SqlAttempt.__table__
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
