"""Reconciliation: episodes an archive holds and the database lacks get their rows.

Per episode the driver fsyncs the archive member before it writes the database row
(service/screen.py), so a database outage leaves evidence without rows, never rows without
evidence. Reconciling reads each such episode back from the archive, checks its members
(record, logits, trace) against the hashes the archive vouches for, and inserts the record as
the row the driver would have written (`Store.put_reconciled`: ON CONFLICT DO NOTHING on
(attempt, plan index), so it is idempotent and safe beside a live writer).

What a member is checked against (`check`, strongest first):
- `manifest`: a sealed archive's manifest.json, SHA-256 and size per member;
- `writer`: the live `ArchiveWriter`'s member table, for an attempt this dispatcher still
  drives: the same SHA-256 entries its seal will write into the manifest;
- `crc32`: an unsealed archive no writer holds any more (a lost or failed attempt): there is
  no manifest yet, so only each member's zip CRC-32 (checked on every read) and the record's
  agreement with plan.json vouch for it. The attempt records which check its rows passed.

The writer puts an episode's record after its other members, so an episode cut off inside its
writes has no record and no row. In archives written before that order, an episode whose record
says `ok` but whose logits member is absent from an unsealed archive was cut off between its
members: it was never recorded (the audit agrees) and gets no row.
Pure Python over the archive and a Store; no Ray, no SQLAlchemy.
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from packbench.core.archive import PLAN_NAME, PROTOCOL_NAME, VERDICTS_NAME, ArchiveReader
from packbench.core.canonical import canonical_sha256
from packbench.core.errors import ArchiveError, PackbenchError

_REQUIRED = ("plan_index", "condition", "role", "prompt", "status")


@dataclass(frozen=True)
class Reconciled:
    """What reconciling one attempt's archive did."""

    screen_id: int
    attempt_id: int
    attempt_number: int
    archive_path: str
    inserted: int  # rows inserted now
    check: str  # manifest | writer | crc32
    refused: tuple[str, ...] = ()  # one line per archived episode left without a row, and why
    verdicts: int = 0  # verdict rows inserted now (a sealed archive whose verdicts the database lacked)

    def line(self) -> str:
        rows = f"{self.inserted} episode row{'s' if self.inserted != 1 else ''}"
        if self.verdicts:
            rows += f" and {self.verdicts} verdict row{'s' if self.verdicts != 1 else ''}"
        against = {"manifest": "its manifest's SHA-256", "writer": "the writer's SHA-256 (the manifest to be)",
                   "crc32": "zip CRC-32 only (unsealed archive, no manifest)"}[self.check]
        text = f"screen {self.screen_id} attempt {self.attempt_number}: {rows} inserted from its archive, checked against {against}"
        if self.refused:
            text += f"; {len(self.refused)} refused ({self.refused[0]})"
        return text


@dataclass
class ReconcileReport:
    attempts: list[Reconciled] = field(default_factory=list)  # those with something missing
    checked: int = 0  # attempts whose archive was read
    not_here: list[str] = field(default_factory=list)  # archive paths not on this host

    @property
    def inserted(self) -> int:
        return sum(r.inserted for r in self.attempts)

    @property
    def refused(self) -> int:
        return sum(len(r.refused) for r in self.attempts)

    @property
    def verdicts(self) -> int:
        return sum(r.verdicts for r in self.attempts)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def missing_records(reader: ArchiveReader, stored: Iterable[int], *,
                    expected: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[str, list[dict], list[str]]:
    """(check, records to insert, refusals) for the episodes `reader` holds whose plan index
    is not in `stored`. `expected`: the live writer's member table, for an unsealed archive
    this process is still writing."""
    stored = set(stored)
    if reader.complete:
        table: Mapping[str, Mapping[str, Any]] | None = reader.manifest["members"]
        check = "manifest"
    elif expected is not None:
        table, check = expected, "writer"
    else:
        table, check = None, "crc32"
    names = set(reader.names)
    plan_entries: list | None = None
    records, refused = [], []
    for members in reader.episodes():
        if members.index in stored:
            continue
        try:
            record = _checked_record(reader, members, table, names)
            if record is None:
                continue  # cut off between its record and its logits: never recorded
            if plan_entries is None:
                plan = reader.read_json(PLAN_NAME) if PLAN_NAME in names else None
                plan_entries = plan.get("entries") if isinstance(plan, dict) else []
            entry = plan_entries[members.index] if members.index < len(plan_entries or []) else None
            if not isinstance(entry, dict) or any(record.get(k) != entry.get(k) for k in ("condition", "role", "prompt")):
                raise PackbenchError(f"episode {members.index}'s record does not match plan entry {members.index}")
        except PackbenchError as e:  # ArchiveError (a CRC, a bound) or a check below
            refused.append(str(e))
            continue
        records.append(record)
    return check, records, refused


def _checked_record(reader: ArchiveReader, members, table, names: set[str]) -> dict | None:
    present = [m for m in (members.record, members.logits, members.trace) if m in names]
    for name in present:
        data = reader.read_bytes(name)  # the zip CRC-32 is checked as it is read
        if table is None:
            continue
        entry = table.get(name)
        if entry is None:
            raise PackbenchError(f"member {name} is in the archive but not in its "
                                 f"{'manifest' if reader.complete else 'writer table'}")
        if entry.get("size") != len(data) or entry.get("sha256") != _sha256(data):
            raise PackbenchError(f"member {name} does not match its SHA-256 entry (altered after it was written)")
    record = reader.read_json(members.record)
    if not isinstance(record, dict) or record.get("plan_index") != members.index:
        raise PackbenchError(f"{members.record} is not the record of episode {members.index}")
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise PackbenchError(f"{members.record} lacks {', '.join(missing)}")
    if record.get("status") == "ok" and members.logits not in names and not reader.complete:
        return None
    return record


def sealed_verdicts(reader: ArchiveReader) -> list[dict]:
    """The verdicts a sealed archive holds, checked against its manifest's SHA-256 entry: what
    its driver stores in one transaction after the seal (service/screen.py `finish`), so that a
    driver killed (or cut off by a database outage) between the two leaves them in the archive
    only. None in the archive: none to insert (the audit names a sealed archive without them).
    Raises PackbenchError for a member that does not check."""
    if VERDICTS_NAME not in set(reader.names):
        return []
    entry = reader.manifest["members"].get(VERDICTS_NAME)
    if not isinstance(entry, dict):
        raise PackbenchError(f"member {VERDICTS_NAME} is in the archive but not in its manifest")
    data = reader.read_bytes(VERDICTS_NAME)
    if entry.get("size") != len(data) or entry.get("sha256") != _sha256(data):
        raise PackbenchError(f"member {VERDICTS_NAME} does not match its SHA-256 entry (altered after it was written)")
    verdicts = reader.read_json(VERDICTS_NAME)
    keys = {"gate": str, "condition": str, "phase": str, "passed": bool}

    def well_formed(v) -> bool:  # what the verdicts' columns take (db/ingest.py verdict_columns)
        interval, episodes = v.get("interval"), v.get("episodes")
        return (all(isinstance(v.get(k), t) for k, t in keys.items())
                and (interval is None or isinstance(interval, list) and len(interval) == 2)
                and (episodes is None or isinstance(episodes, list)))

    if not isinstance(verdicts, list) or not all(isinstance(v, dict) and well_formed(v) for v in verdicts):
        raise PackbenchError(f"{VERDICTS_NAME} is not a list of verdicts")
    return verdicts


def not_this_attempts(store, attempt, reader: ArchiveReader) -> str | None:
    """Why the archive at `attempt.archive_path` is another screen's (its protocol.json, or its
    sealed manifest's screen and attempt, differ from the database's), or None. Before, `db
    reconcile` inserted the episodes of whatever archive lay at the recorded path: an attempt whose
    path named another screen's archive got that screen's episodes as its own rows."""
    expected = store.protocol(store.screen(attempt.screen_id).protocol_id).sha256
    try:
        archived = canonical_sha256(reader.read_json(PROTOCOL_NAME)) if PROTOCOL_NAME in set(reader.names) else None
    except ArchiveError:
        archived = None
    mine = f"screen {attempt.screen_id} attempt {attempt.number}"
    # Only what the archive says can contradict the attempt: one without protocol.json (cut short
    # before it, or made by hand) is checked member by member as before.
    if archived is not None and archived != expected:
        return (f"{attempt.archive_path} ran protocol {archived[:12]}, not {mine}'s {expected[:12]}: it is another "
                f"screen's archive; nothing was inserted (find this attempt's archive, or audit it)")
    manifest = reader.manifest if reader.complete else None
    if isinstance(manifest, dict) and attempt.ingested_from is None:  # an ingested attempt keeps its lab's numbers
        said = (manifest.get("screen_id"), manifest.get("attempt"))
        if None not in said and said != (attempt.screen_id, attempt.number):
            return (f"{attempt.archive_path} is screen {said[0]} attempt {said[1]}'s archive (its manifest), not "
                    f"{mine}'s; nothing was inserted (find this attempt's archive, or audit it)")
    return None


def reconcile_attempt(store, attempt, *, stored: Iterable[int],
                      expected: Mapping[str, Mapping[str, Any]] | None = None) -> Reconciled | None:
    """Insert the rows `attempt`'s archive holds and the database lacks: episodes, and a sealed
    archive's verdicts when the database holds none of them and never recorded the seal. None
    when nothing is missing.
    Raises `ArchiveError` for an archive that cannot be opened."""
    verdicts: list[dict] = []
    with ArchiveReader(Path(attempt.archive_path)) as reader:
        check, records, refused = missing_records(reader, stored, expected=expected)
        # Only while the database never recorded the seal (the rows an audit calls pending): an
        # attempt whose seal it recorded stored its verdicts first, so lacking them now they were removed.
        if reader.complete and attempt.archive_sha256 is None and not store.verdicts(attempt.id):
            try:
                verdicts = sealed_verdicts(reader)
            except PackbenchError as e:  # ArchiveError (a CRC, a bound) or a check above
                refused.append(str(e))
        foreign = not_this_attempts(store, attempt, reader) if records or refused or verdicts else None
    if not records and not refused and not verdicts:
        return None
    if foreign is not None:
        return Reconciled(attempt.screen_id, attempt.id, attempt.number, attempt.archive_path, 0, check,
                          (foreign,))
    inserted = store.put_reconciled(attempt.id, records, check=check) if records else 0
    added = store.put_verdicts(attempt.id, verdicts) if verdicts else 0
    return Reconciled(attempt.screen_id, attempt.id, attempt.number, attempt.archive_path, inserted, check,
                      tuple(refused), verdicts=added)


def reconcile(store, *, attempt_ids: Iterable[int] | None = None, finished_since: datetime | None = None,
              expected: Mapping[int, Mapping[str, Mapping[str, Any]]] | None = None) -> ReconcileReport:
    """Every attempt not running (finished at or after `finished_since` when given; or those of
    `attempt_ids`, running ones included) whose archive is on this host, and every running
    attempt whose dispatcher on this host is gone (a one-shot `dispatch` that stopped in a
    database outage: its lease has not run out yet, but nothing writes its archive): insert the
    rows of archived episodes the database lacks. `expected`: per attempt id, the live writer's
    member table (the dispatcher's own)."""
    from packbench.service.dispatcher.holders import holder_alive

    report = ReconcileReport()
    targets = store.reconcile_targets(attempt_ids=None if attempt_ids is None else list(attempt_ids),
                                      finished_since=finished_since, host=platform.node(), alive=holder_alive)
    for target in targets:
        attempt = target.attempt
        path = Path(attempt.archive_path)
        if not path.is_file():
            report.not_here.append(str(path))
            continue
        report.checked += 1
        try:
            done = reconcile_attempt(store, attempt, stored=target.stored,
                                     expected=(expected or {}).get(attempt.id))
        except ArchiveError as e:  # the archive, not the database (a DatabaseError goes up)
            done = Reconciled(attempt.screen_id, attempt.id, attempt.number, str(path), 0, "crc32",
                              (f"archive unreadable: {e}",))
        if done is not None:
            report.attempts.append(done)
    return report
