"""Auditing: re-read a screen's raw archive (here or as a Ray task), compare, record the audit."""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from core.audit import AuditReport, audit_archive
from core.errors import PackbenchError
from core.settings import Settings


@dataclass(frozen=True)
class AuditOutcome:
    report: AuditReport
    archive_path: Path
    screen_id: int | None
    attempt_number: int | None
    recorded: bool  # the audit row reached the database
    record_error: str | None  # why it did not, when it did not


def verdict_dicts(rows) -> list[dict]:
    """VerdictRows in the gates' own dict form (what the auditor compares)."""
    return [{"gate": v.gate, "condition": v.condition, "phase": v.phase, "passed": v.passed, "value": v.value,
             "threshold": v.threshold, "interval": list(v.interval) if v.interval is not None else None}
            for v in rows]


def episode_dicts(rows) -> list[dict]:
    """EpisodeRows as plain dicts (what the auditor compares with the archive's records)."""
    return [{**dataclasses.asdict(e), "tokens": list(e.tokens)} for e in rows]


def _run(path: Path, *, on_ray: bool, settings: Settings, compare: dict) -> AuditReport:
    if on_ray:
        from cluster.audit import audit_on_cluster

        return audit_on_cluster(path, settings=settings, **compare)
    return audit_archive(path, **compare)


def audit_file(path: Path, *, on_ray: bool = False, settings: Settings | None = None) -> AuditOutcome:
    """Audit an archive alone: no database needed or touched."""
    report = _run(Path(path), on_ray=on_ray, settings=settings or Settings(), compare={})
    return AuditOutcome(report, Path(path), None, None, False, None)


def audit_screen(store, ref: int | str, *, archive: Path | None = None, on_ray: bool = False,
                 settings: Settings | None = None) -> AuditOutcome:
    """Audit the latest attempt of screen `ref` against the database, and record the audit.

    The audit's own result is returned even when recording it fails (a read-only database,
    say): `recorded` is then False and `record_error` says why.
    """
    row = store.screen(ref)
    attempt = store.latest_attempt(row.id)
    if attempt is None:
        raise PackbenchError(f"screen {row.id} has not run yet; run `packbench dispatch` first")
    compare = dict(expected_sha256=attempt.archive_sha256, db_verdicts=verdict_dicts(store.verdicts(attempt.id)),
                   db_episodes=episode_dicts(store.episodes(attempt.id)))
    path = Path(archive or attempt.archive_path)
    started = datetime.now(timezone.utc)
    report = _run(path, on_ray=on_ray, settings=settings or Settings(), compare=compare)
    try:
        store.put_audit(attempt_id=attempt.id, archive_sha256=report.record["archive_sha256"], digest=report.digest,
                        result=report.record["result"], problems=report.problems, machine=platform.node(),
                        started_at=started, finished_at=datetime.now(timezone.utc))
    except PackbenchError as e:
        return AuditOutcome(report, path, row.id, attempt.number, False, str(e))
    return AuditOutcome(report, path, row.id, attempt.number, True, None)
