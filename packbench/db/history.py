"""A protocol's runs across code versions: each screen's latest ended attempt with the source
freeze its worker recorded (`core/source.py`: git commit, dirty flag, package version)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from packbench.db.models import SqlAttempt, SqlProtocol, SqlScreen
from packbench.db.queries import protocol_matches


@dataclass(frozen=True, slots=True)
class HistoryRun:
    """One screen of a protocol as history sees it: its latest done attempt and where it ran."""

    screen_id: int
    attempt_id: int
    attempt: int
    protocol: str
    protocol_sha256: str
    name: str | None
    commit: str  # "" when the worker's tree was not a git checkout
    dirty: bool | None
    package_version: str | None
    started_at: datetime
    node: str
    gpu_name: str


def runs(session: Session, protocol: str) -> list[HistoryRun]:
    """The done screens of `protocol` (name or SHA-256 prefix), each by its latest done attempt,
    oldest first (by when the attempt started)."""
    latest = (select(SqlAttempt.screen_id, func.max(SqlAttempt.number).label("number"))
              .where(SqlAttempt.status == "done").group_by(SqlAttempt.screen_id).subquery())
    query = (select(SqlScreen.id, SqlAttempt.id, SqlAttempt.number, SqlProtocol.name, SqlProtocol.sha256,
                    SqlScreen.name, SqlAttempt.source_freeze, SqlAttempt.started_at, SqlAttempt.node, SqlAttempt.gpu_name)
             .join(SqlProtocol, SqlProtocol.id == SqlScreen.protocol_id)
             .join(latest, latest.c.screen_id == SqlScreen.id)
             .join(SqlAttempt, (SqlAttempt.screen_id == SqlScreen.id) & (SqlAttempt.number == latest.c.number))
             .where(protocol_matches(protocol))
             .order_by(SqlAttempt.started_at, SqlScreen.id))
    out = []
    for sid, aid, number, pname, sha, name, freeze, started, node, gpu in session.execute(query):
        source = json.loads(freeze) if freeze else {}
        out.append(HistoryRun(screen_id=sid, attempt_id=aid, attempt=number, protocol=pname, protocol_sha256=sha,
                              name=name, commit=str(source.get("git_commit") or ""), dirty=source.get("git_dirty"),
                              package_version=source.get("package_version"), started_at=started, node=node,
                              gpu_name=gpu))
    return out
