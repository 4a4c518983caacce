"""`packbench status`: the queue as it stands, read in one transaction.

Screens per state, running screens with progress and placement, the queue in claim order
with unplaceable reasons, dispatchers (live: a heartbeat within `live_within_s`) and their
workers, and the attempts whose rows were last inserted from their archives. Called by
`Store.queue_status`; returns frozen dataclasses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from packbench.db.models import SCREEN_STATUSES, SqlAttempt, SqlDispatcher, SqlEpisode, SqlProtocol, SqlScreen

QUEUE_LISTED = 100  # queued screens `status` lists (in claim order); the count covers them all
DISPATCHERS_SHOWN_S = 24 * 3600  # a dispatcher silent for longer (and never stopped) is forgotten


@dataclass(frozen=True, slots=True)
class RunningScreen:
    screen_id: int
    protocol: str
    priority: int
    attempt: int  # its number
    attempt_id: int
    attempt_key: str | None
    dispatcher: str | None  # name; None for an attempt started outside the queue
    worker: str
    node: str
    gpu_name: str
    gpu_index: int
    model_state: str | None  # cold | warm
    shared_node: bool | None
    started_at: datetime
    lease_expires_at: datetime | None
    cancel_requested: bool
    episodes_done: int  # episodes stored so far
    episodes_total: int | None  # planned by the protocol; None if its plan cannot be computed


@dataclass(frozen=True, slots=True)
class QueuedScreen:
    screen_id: int
    protocol: str
    priority: int
    created_at: datetime
    attempts_used: int
    max_attempts: int
    gpu_type: str | None
    placement_node: str | None
    replica_group: str | None
    unplaceable_reason: str | None  # why no dispatcher can place it now; it stays queued


@dataclass(frozen=True, slots=True)
class DispatcherStatus:
    id: int
    name: str
    host: str
    pid: int | None
    started_at: datetime
    heartbeat_at: datetime
    live: bool  # heartbeat within live_within_s
    workers: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class ReconciledAttempt:
    screen_id: int
    attempt: int  # its number
    status: str
    reconciled_at: datetime
    episodes: int  # rows inserted from its archive, in all
    check: str | None  # manifest | writer | crc32


RECONCILED_LISTED = 20  # the latest reconciled attempts `status` lists


@dataclass(frozen=True, slots=True)
class QueueStatus:
    now: datetime
    counts: dict[str, int]  # every screen status, zeros included
    running: tuple[RunningScreen, ...]  # by screen id
    queued: tuple[QueuedScreen, ...]  # claim order (priority, then oldest); at most QUEUE_LISTED
    dispatchers: tuple[DispatcherStatus, ...]  # not stopped, heard from in the last day
    idle_workers: int  # over live dispatchers
    busy_workers: int
    reconciled: tuple[ReconciledAttempt, ...] = ()  # latest first: rows inserted from archives (db reconcile)


def _planned_episodes(canonical_json: str) -> int | None:
    """How many episodes the protocol plans (core.plan, imported here only: it needs numpy)."""
    from packbench.core.plan import plan

    try:
        return len(plan(json.loads(canonical_json)))
    except Exception:  # an old or odd body: the total is unknown, the status still shows
        return None


def queue_status(session: Session, *, now: datetime, live_within_s: float) -> QueueStatus:
    """The queue at `now`; a dispatcher is live when its heartbeat is within `live_within_s`."""
    counts = dict.fromkeys(SCREEN_STATUSES, 0)
    for status, n in session.execute(select(SqlScreen.status, func.count(SqlScreen.id)).group_by(SqlScreen.status)):
        counts[status] = n
    done = (  # episodes stored by running attempts only: not a scan of every episode
        select(SqlEpisode.attempt_id, func.count(SqlEpisode.id).label("n"))
        .where(SqlEpisode.attempt_id.in_(select(SqlAttempt.id).where(SqlAttempt.status == "running")))
        .group_by(SqlEpisode.attempt_id)
        .subquery()
    )
    rows = session.execute(
        select(SqlScreen, SqlAttempt, SqlProtocol.name, SqlProtocol.id, SqlDispatcher.name, done.c.n)
        .join(SqlAttempt, and_(SqlAttempt.screen_id == SqlScreen.id, SqlAttempt.status == "running"))
        .join(SqlProtocol, SqlProtocol.id == SqlScreen.protocol_id)
        .outerjoin(SqlDispatcher, SqlDispatcher.id == SqlAttempt.dispatcher_id)
        .outerjoin(done, done.c.attempt_id == SqlAttempt.id)
        .where(SqlScreen.status == "running")
        .order_by(SqlScreen.id, SqlAttempt.number)
    ).all()
    totals: dict[int, int | None] = {}
    for protocol_id in {row[3] for row in rows}:
        totals[protocol_id] = _planned_episodes(session.get_one(SqlProtocol, protocol_id).canonical_json)
    running = tuple(
        RunningScreen(
            screen_id=screen.id, protocol=protocol, priority=screen.priority, attempt=attempt.number,
            attempt_id=attempt.id, attempt_key=attempt.attempt_key, dispatcher=dispatcher,
            worker=attempt.worker, node=attempt.node, gpu_name=attempt.gpu_name, gpu_index=attempt.gpu_index,
            model_state=attempt.model_state, shared_node=attempt.shared_node, started_at=attempt.started_at,
            lease_expires_at=attempt.lease_expires_at, cancel_requested=screen.cancel_requested_at is not None,
            episodes_done=int(n or 0), episodes_total=totals[protocol_id],
        )
        for screen, attempt, protocol, protocol_id, dispatcher, n in rows
    )
    queued = tuple(
        QueuedScreen(
            screen_id=screen.id, protocol=protocol, priority=screen.priority, created_at=screen.created_at,
            attempts_used=screen.attempts_used, max_attempts=screen.max_attempts, gpu_type=screen.gpu_type,
            placement_node=screen.placement_node, replica_group=screen.replica_group,
            unplaceable_reason=screen.unplaceable_reason,
        )
        for screen, protocol in session.execute(
            select(SqlScreen, SqlProtocol.name)
            .join(SqlProtocol, SqlProtocol.id == SqlScreen.protocol_id)
            .where(SqlScreen.status == "queued")
            .order_by(SqlScreen.priority.desc(), SqlScreen.id)
            .limit(QUEUE_LISTED)
        )
    )
    live_since = now - timedelta(seconds=live_within_s)
    dispatchers = []
    idle = busy = 0
    for d in session.scalars(
        select(SqlDispatcher)
        .where(SqlDispatcher.stopped_at.is_(None),
               SqlDispatcher.heartbeat_at >= now - timedelta(seconds=DISPATCHERS_SHOWN_S))
        .order_by(SqlDispatcher.id)
    ):
        row = d.to_record()
        live = row.heartbeat_at >= live_since
        if live:
            idle += sum(1 for w in row.workers if w.get("state") == "idle")
            busy += sum(1 for w in row.workers if w.get("state") == "busy")
        dispatchers.append(DispatcherStatus(id=row.id, name=row.name, host=row.host, pid=row.pid,
                                            started_at=row.started_at, heartbeat_at=row.heartbeat_at,
                                            live=live, workers=row.workers))
    reconciled = tuple(
        ReconciledAttempt(screen_id=a.screen_id, attempt=a.number, status=a.status, reconciled_at=a.reconciled_at,
                          episodes=a.reconciled_episodes or 0, check=a.reconciled_check)
        for a in session.scalars(
            select(SqlAttempt).where(SqlAttempt.reconciled_at.is_not(None))
            .order_by(SqlAttempt.reconciled_at.desc(), SqlAttempt.id.desc()).limit(RECONCILED_LISTED)
        )
    )
    return QueueStatus(now=now, counts=counts, running=running, queued=queued, dispatchers=tuple(dispatchers),
                       idle_workers=idle, busy_workers=busy, reconciled=reconciled)
