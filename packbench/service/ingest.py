"""Ingesting evidence from elsewhere: audit an archive made on another machine or by another
lab and, only if it agrees (and its signature is by a trusted key), record its screen in this
database in one transaction, marked as ingested with its signer.

Refused (nothing written): an archive that disagrees, is incomplete, unsigned, signed by a key
that is not trusted, signed by a revoked key (`packbench keys revoke`; given with `--trust` too),
or already in this database. Trusted keys are the ones given with `--trust` plus every signer
registered in the database (`packbench keys register`) that is not revoked.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from packbench.core.archive import PROTOCOL_NAME, VERDICTS_NAME, WORKER_NAME, ArchiveReader
from packbench.core.audit import AuditReport, audit_archive
from packbench.core.canonical import canonical_json
from packbench.core.errors import ArchiveError, PackbenchError
from packbench.core.provenance import key_id, load_public_key
from packbench.core.text import one_line


@dataclass(frozen=True)
class IngestOutcome:
    report: AuditReport
    attempt_id: int | None  # None: refused
    screen_id: int | None
    reasons: list[str]  # why it was refused ([] when ingested)
    attempt_number: int | None = None  # the attempt's number within its screen (attempt_id is its row id)
    registered: str | None = None  # the signer's key id, when ingest registered it (given by --trust alone)

    @property
    def ingested(self) -> bool:
        return self.attempt_id is not None


def revoked_line(key: str | None, signers: list) -> str | None:
    """Why an archive signed by `key` is refused when the key is revoked (`packbench keys
    revoke`), or None: a revoked key vouches for nothing from then on, --trust or not."""
    row = next((s for s in signers if s.key_id == key and s.revoked_at is not None), None)
    if row is None:
        return None
    return (f"signature: by key {key} ({one_line(row.name)!r}), revoked at {row.revoked_at:%Y-%m-%d %H:%M} UTC; "
            f"a revoked key's archives are never ingested: ask its lab for the archive signed by a key in force")


def ingest(store, archive: Path, *, trust_files: list[Path]) -> IngestOutcome:
    """Audit `archive` against the trusted keys; if it agrees, write it to `store`."""
    archive = Path(archive)
    given = {key_id(raw): (raw, path) for path in trust_files for raw in [load_public_key(path)]}
    signers = store.signers()
    registered = {s.key_id: bytes.fromhex(s.public_key) for s in signers}
    keys = [raw for raw, _ in given.values()] + list(registered.values())
    if not keys:
        raise PackbenchError("no trusted keys: pass --trust PUBKEY_FILE or register the lab's key with "
                             "`packbench keys register`; unsigned evidence is never ingested")
    report = audit_archive(archive, trust=keys)  # revoked keys included: a signature by one is named below
    if not report.agrees:
        return IngestOutcome(report, None, None, list(report.problems) or ["the audit did not agree"])
    revoked = revoked_line(report.record.get("signature", {}).get("key_id"), signers)
    if revoked is not None:
        return IngestOutcome(report, None, None, [revoked])
    try:
        with ArchiveReader(archive) as r:
            body = r.read_json(PROTOCOL_NAME)
            worker = r.read_json(WORKER_NAME)
            manifest = r.manifest or {}
            records = []
            for entry in r.episodes():
                rec = r.read_json(entry.record)
                records.append({k: v for k, v in rec.items() if k != "calls"})
            verdicts = r.read_json(VERDICTS_NAME)
    except ArchiveError as e:
        return IngestOutcome(report, None, None, [str(e)])
    from packbench.db.errors import Conflict

    # A signer trusted by --trust alone is registered with the attempt: every later audit of the
    # screen checks its signature against the key the database names (service/audit.py
    # `_signed_by`), and without it `audit --all` called accepted evidence DISAGREE forever.
    signer = report.record.get("signature", {}).get("key_id")
    new_signer = None
    if signer in given and signer not in registered:
        raw, path = given[signer]
        new_signer = {"key_id": signer, "public_key": raw.hex(), "name": f"{Path(path).name} (--trust at ingest)"}
    try:
        row = _write(store, archive, report, body, worker, manifest, records, verdicts, signer=signer,
                     new_signer=new_signer)
    except Conflict as e:
        return IngestOutcome(report, None, None, [str(e)])
    return IngestOutcome(report, row.id, row.screen_id, [], attempt_number=row.number,
                         registered=None if new_signer is None else signer)


def _write(store, archive: Path, report: AuditReport, body: dict, worker: dict, manifest: dict, records: list,
           verdicts: list, *, signer: str | None, new_signer: dict | None):
    env = worker.get("environment") if isinstance(worker.get("environment"), dict) else {}
    start = worker.get("start") if isinstance(worker.get("start"), dict) else {}
    return store.ingest_attempt(
        protocol_sha256=report.record["protocol_sha256"], protocol_name=str(body.get("name")),
        protocol_json=canonical_json(body).decode(),
        machine={"host": env.get("host"), "gpu_name": env.get("gpu"), "driver": env.get("driver"),
                 "torch": env.get("torch"), "cuda": env.get("cuda")},
        attempt={"archive_path": str(archive.resolve()), "archive_sha256": report.record["archive_sha256"],
                 "source_freeze": manifest.get("source_freeze") or {}, "model_sha256": start.get("model_sha256"),
                 "signer_key_id": signer, "node": env.get("host"), "worker": "ingested",
                 "submitter": f"ingest@{platform.node()}",
                 "ingested_from": f"{env.get('host') or 'unknown host'} (signed by {signer})"},
        episodes=records, verdicts=verdicts, signer=new_signer)
