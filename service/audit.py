"""Auditing: re-read raw archives (here, or fanned out over the cluster), compare, record each audit.

The audit's own result is always returned, even when recording it fails (a read-only
database, say): the outcome then says why it was not recorded.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from core.audit import AuditReport, audit_archive
from core.errors import PackbenchError
from core.record import STORED_FIELDS
from core.settings import Settings


@dataclass(frozen=True)
class AuditOutcome:
    report: AuditReport | None  # None: the archive was readable nowhere (`error`)
    archive_path: Path
    screen_id: int | None
    attempt_number: int | None
    node: str  # where the audit ran (a Ray node id, or this host)
    recorded: bool  # the audit row reached the database
    record_error: str | None  # why it did not, when it did not
    error: str | None = None

    @property
    def agrees(self) -> bool:
        return self.report is not None and self.report.agrees


def verdict_dicts(rows) -> list[dict]:
    """VerdictRows in the gates' own dict form (what the auditor compares)."""
    return [{"gate": v.gate, "condition": v.condition, "phase": v.phase, "passed": v.passed, "value": v.value,
             "threshold": v.threshold, "interval": list(v.interval) if v.interval is not None else None}
            for v in rows]


def episode_dicts(rows) -> list[dict]:
    """EpisodeRows as the auditor compares them: id, attempt_id and every stored field of
    `core.record`, tokens as a list."""
    return [{"id": e.id, "attempt_id": e.attempt_id,
             **{f.name: list(getattr(e, f.name)) if f.type is list else getattr(e, f.name) for f in STORED_FIELDS}}
            for e in rows]


def audit_file(path: Path, *, on_ray: bool = False, settings: Settings | None = None,
               trust: list[bytes] | None = None, max_mib: int | None = None) -> AuditOutcome:
    """Audit an archive alone: no database needed or touched. With `trust` (raw Ed25519
    public keys) its detached signature must be valid and by one of them (core.provenance)."""
    settings = settings or Settings()
    if on_ray and trust is None:
        from cluster.audit import audit_on_cluster

        report = audit_on_cluster(Path(path), settings=settings, **({"max_mib": max_mib} if max_mib else {}))
    else:
        report = audit_archive(Path(path), trust=trust, max_mib=max_mib)
    return AuditOutcome(report, Path(path), None, None, platform.node(), False, None)


def select_screens(store, refs: list[str], *, all_screens: bool = False, since: datetime | None = None,
                   protocol: str | None = None) -> list[int]:
    """Screen ids to audit: the given ids (or `latest`), or every screen that ran (optionally
    since a date, or of one protocol: name or SHA-256 prefix), oldest first."""
    if refs:
        return [store.screen(r).id for r in refs]
    if not (all_screens or since or protocol):
        raise PackbenchError("say what to audit: screen ids, `latest`, --all, --since DATE or --protocol SHA")
    out = []
    for s in store.list_screens(protocol=protocol):
        attempt = store.latest_attempt(s.id)
        if attempt is None or (since is not None and attempt.started_at < since):
            continue
        out.append(s.id)
    return sorted(out)


def audit_screens(store, screen_ids: list[int], *, on_ray: bool = False, settings: Settings | None = None,
                  archive: Path | None = None, concurrency: int = 8, other_node: bool | None = None,
                  repeat: int = 1, max_mib: int | None = None) -> list[AuditOutcome]:
    """Audit the latest attempt of each screen against the database and record every audit.

    With `on_ray` the audits fan out over the cluster (cluster/audit.py): at most
    `concurrency` at once, on a node other than the producer's when `other_node` (default:
    when the cluster has several nodes), each `repeat` times on distinct nodes.
    """
    settings = settings or Settings()
    jobs, started = [], datetime.now(timezone.utc)
    for screen_id in screen_ids:
        attempt = store.latest_attempt(screen_id)
        if attempt is None:
            raise PackbenchError(f"screen {screen_id} has not run yet; run `packbench dispatch` first")
        compare = dict(expected_sha256=attempt.archive_sha256, db_verdicts=verdict_dicts(store.verdicts(attempt.id)),
                       db_episodes=episode_dicts(store.episodes(attempt.id)))
        if max_mib is not None:
            compare["max_mib"] = max_mib
        jobs.append((screen_id, attempt, Path(archive or attempt.archive_path), compare))
    if on_ray:
        from cluster.audit import AuditJob, fan_out

        done = fan_out([AuditJob(key=i, path=str(path), producer_node=attempt.node or None, compare=compare)
                        for i, (_, attempt, path, compare) in enumerate(jobs)],
                       settings=settings, concurrency=concurrency, other_node=other_node, repeat=repeat)
        results = [(jobs[d.job.key], d.report, d.node, d.error) for d in done]
        kind = "ray"
    else:
        if repeat > 1:
            raise PackbenchError("--repeat runs audits on distinct nodes; add --ray")
        results = [(job, audit_archive(job[2], **job[3], **_signed_by(store, job[1])), platform.node(), None)
                   for job in jobs]
        kind = "local"
    outcomes = []
    for (screen_id, attempt, path, _), report, node, error in results:
        if report is None:
            outcomes.append(AuditOutcome(None, path, screen_id, attempt.number, node, False, None, error))
            continue
        try:
            store.put_audit(attempt_id=attempt.id, archive_sha256=report.record["archive_sha256"], digest=report.digest,
                            result=report.record["result"], problems=report.problems, machine=platform.node(),
                            started_at=started, finished_at=datetime.now(timezone.utc), node=node, kind=kind)
        except PackbenchError as e:
            outcomes.append(AuditOutcome(report, path, screen_id, attempt.number, node, False, str(e)))
            continue
        outcomes.append(AuditOutcome(report, path, screen_id, attempt.number, node, True, None))
    return outcomes


def _signed_by(store, attempt) -> dict:
    """A local audit of a signed attempt also checks its signature, against the key the database
    says signed it (a database row and an archive rewritten together would still be caught)."""
    if getattr(attempt, "signer_key_id", None) is None:
        return {}
    keys = [bytes.fromhex(s.public_key) for s in store.signers() if s.key_id == attempt.signer_key_id]
    return {"trust": keys}


def repeat_disagreements(outcomes: list[AuditOutcome]) -> list[str]:
    """Screens whose repeated audits gave different digests (each must reproduce the others)."""
    digests: dict[int, set[str]] = {}
    for o in outcomes:
        if o.report is not None and o.screen_id is not None:
            digests.setdefault(o.screen_id, set()).add(o.report.digest)
    return [f"screen {s}: repeated audits gave {len(d)} different digests" for s, d in sorted(digests.items())
            if len(d) > 1]
