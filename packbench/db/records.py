"""Plain, immutable rows that leave the database layer.

`Store` converts every ORM object into one of these before returning, so callers never hold
a session-bound object (no lazy loads, no accidental writes, picklable across Ray). JSON text
columns are decoded here: callers get lists, tuples and dicts, never JSON strings.
Every timestamp is a timezone-aware `datetime` in UTC.
"""

from __future__ import annotations

import json

from dataclasses import dataclass, make_dataclass
from datetime import datetime
from typing import Any

from packbench.core.record import STORED_FIELDS, Field


@dataclass(frozen=True, slots=True)
class ProtocolRow:
    id: int
    sha256: str
    name: str
    canonical_json: str
    model: str | None  # model.path, or 'synth:<shape>'; copied from canonical_json
    dtype: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class MachineRow:
    """A machine fingerprint; fields the worker did not know are None."""

    id: int
    host: str | None
    gpu_name: str | None
    driver: str | None
    torch: str | None
    cuda: str | None


@dataclass(frozen=True, slots=True)
class ScreenRow:
    id: int
    protocol_id: int
    status: str  # queued | running | done | failed | cancelled
    repetitions: int
    submitter: str
    model_dir: str | None
    prompt_file: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    priority: int = 0  # higher first; FIFO within a priority
    max_attempts: int = 3
    attempts_used: int = 0  # claims since submit or the last retry
    gpu_type: str | None = None
    placement_node: str | None = None
    exclusive_node: bool = False
    replica_group: str | None = None
    unplaceable_reason: str | None = None
    cancel_requested_at: datetime | None = None
    resources: str | None = None  # canonical JSON of the custom Ray resources it needs; None: none
    name: str | None = None  # labels (0010, db/labels.py)
    note: str | None = None
    sweep_id: str | None = None  # screens queued by one `submit --sweep` share it
    sweep_point: str | None = None  # canonical JSON of the swept fields and this screen's values

    @property
    def point(self) -> dict[str, Any]:
        """The swept fields (dotted protocol paths) and this screen's values ({} outside a sweep)."""
        return json.loads(self.sweep_point) if self.sweep_point else {}

    @property
    def needs(self) -> dict[str, float]:
        """The custom Ray resources this screen's node must have free ({} for none)."""
        return json.loads(self.resources) if self.resources else {}


@dataclass(frozen=True, slots=True)
class DispatcherRow:
    id: int
    name: str
    host: str
    pid: int | None
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    workers: tuple[dict[str, Any], ...]  # as last reported: name, node, gpu, gpu_index, state, screen_id


@dataclass(frozen=True, slots=True)
class AttemptRow:
    id: int
    screen_id: int
    number: int  # 1, 2, ... within the screen
    worker: str
    node: str
    gpu_name: str
    gpu_index: int
    machine_id: int | None
    status: str  # running | done | failed | interrupted | lost | cancelled
    error: str | None
    archive_path: str
    archive_sha256: str | None
    source_freeze: dict[str, Any]
    started_at: datetime
    finished_at: datetime | None
    attempt_key: str | None = None  # random hex, unique everywhere; in the archive's file name
    dispatcher_id: int | None = None
    lease_expires_at: datetime | None = None  # claimed attempts; renewed while running
    model_state: str | None = None  # cold | warm
    shared_node: bool | None = None  # another attempt ran on the node at the same time
    model_sha256: str | None = None  # content digest of the checkpoint it measured (0005)
    signer_key_id: str | None = None  # who signed its sealed archive (0005)
    ingested_from: str | None = None  # set when the attempt came from `packbench ingest` (0005)
    reconciled_at: datetime | None = None  # rows last inserted from its archive (0008, db reconcile)
    reconciled_episodes: int | None = None  # how many rows came from its archive, in all
    reconciled_check: str | None = None  # manifest | writer | crc32: what their members were checked against


def _row_type(f: Field) -> Any:
    kind = tuple[int, ...] if f.type is list else f.type  # token ids come back as a tuple
    return kind | None if f.nullable else kind


# One stored episode: id, attempt_id, then `core.record.STORED_FIELDS` by name and in order.
# Generated from that table so the row cannot drift from the record. Counters a failed
# episode did not report are 0; nullable measurements None; tokens a tuple.
EpisodeRow = make_dataclass(
    "EpisodeRow",
    [("id", int), ("attempt_id", int), *((f.name, _row_type(f)) for f in STORED_FIELDS)],
    frozen=True,
    slots=True,
)
EpisodeRow.__module__ = __name__  # picklable (across Ray) as packbench.db.records.EpisodeRow


@dataclass(frozen=True, slots=True)
class StoredVerdict:
    id: int
    attempt_id: int
    gate: str
    condition: str
    phase: str  # all | prefill | decode
    passed: bool
    value: float | None
    threshold: float | None
    interval: tuple[float, float] | None
    episodes: tuple[int, ...]  # plan indexes the verdict was computed from
    detail: str


@dataclass(frozen=True, slots=True)
class AuditRow:
    id: int
    attempt_id: int
    archive_sha256: str | None  # None: an archive over the size bound, never hashed
    digest: str
    result: str  # agree | disagree | partial (an unfinished attempt's consistent archive)
    problems: tuple[str, ...]
    machine: str
    started_at: datetime
    finished_at: datetime
    node: str | None = None
    kind: str | None = None  # local | ray


@dataclass(frozen=True, slots=True)
class SignerRow:
    """A registered Ed25519 public key: this deployment's own (`local`) or a trusted other lab's."""

    id: int
    key_id: str
    public_key: str  # 64 hex digits (raw Ed25519 public key)
    name: str
    local: bool
    created_at: datetime
    revoked_at: datetime | None = None  # `packbench keys revoke`: no longer trusted nor used to sign


@dataclass(frozen=True, slots=True)
class Claim:
    """What `Store.claim_screen` hands a dispatcher: the screen (now running), its new
    attempt (running, leased, with its attempt_key and archive_path) and its protocol."""

    screen: ScreenRow
    attempt: AttemptRow
    protocol: ProtocolRow


@dataclass(frozen=True, slots=True)
class Reaped:
    """An attempt whose lease expired, now `lost`, and what became of its screen."""

    attempt_id: int
    screen_id: int
    screen_status: str  # queued (requeued) | failed (max_attempts used) | cancelled
    why: str = "lease expired"  # or: its dispatcher on the reaper's host is gone
    attempt_number: int | None = None  # the attempt's number within its screen (what every message names)


@dataclass(frozen=True, slots=True)
class ReconcileTarget:
    """An attempt whose archive may hold episodes the database lacks, and the rows it has."""

    attempt: AttemptRow
    stored: frozenset[int]  # plan indexes with an episode row
