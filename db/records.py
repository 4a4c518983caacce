"""Plain, immutable rows that leave the database layer.

`Store` converts every ORM object into one of these before returning, so callers never hold
a session-bound object (no lazy loads, no accidental writes, picklable across Ray). JSON text
columns are decoded here: callers get lists, tuples and dicts, never JSON strings.
Every timestamp is a timezone-aware `datetime` in UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


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
    status: str  # running | done | failed | interrupted
    error: str | None
    archive_path: str
    archive_sha256: str | None
    source_freeze: dict[str, Any]
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class EpisodeRow:
    """One stored episode. Counters a failed episode did not report are 0; peaks are None."""

    id: int
    attempt_id: int
    plan_index: int
    condition: str
    role: str  # warmup | scored
    prompt: int
    status: str  # ok | failed
    error: str | None
    tokens: tuple[int, ...]
    n_tokens: int
    wall_s: float
    call_s: float
    h2d_weight_bytes: int
    h2d_index_bytes: int
    d2h_bytes: int
    prefill_h2d_bytes: int
    decode_h2d_bytes: int
    prefill_call_s: float
    decode_call_s: float
    peak_allocated_bytes: int | None
    peak_sampled_bytes: int | None


@dataclass(frozen=True, slots=True)
class VerdictRow:
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
    archive_sha256: str
    digest: str
    result: str  # agree | disagree
    problems: tuple[str, ...]
    machine: str
    started_at: datetime
    finished_at: datetime
