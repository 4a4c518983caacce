"""Read-only queries behind `packbench results` and `screens list|show`, and screen lookup.

Contract
- Each query function takes an open `Session` and returns frozen dataclasses (or records
  from `db.records`); ORM rows never leave. `Store` wraps each one in a transaction after
  its schema check (`Store.results`, `Store.list_screens`, `Store.screen_detail`), so
  callers never see a Session either. `packbench compare` reads through `db.compare`,
  `packbench status` through `db.status`, in the same way.
- Filters are frozen dataclasses validated on construction: a filter that cannot match by
  construction (an unknown gate, a malformed date) raises `InvalidFilter`, naming the
  allowed values, before any database is touched.
- Every timestamp is an aware UTC datetime.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from collections.abc import Iterable
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, and_, case, exists, func, or_, select
from sqlalchemy.orm import Session, aliased

from packbench.core.protocol import DTYPE_NAMES, GATE_NAMES, PHASES
from packbench.core.record import SORT_NAMES
from packbench.core.text import one_line, show
from packbench.db.errors import InvalidFilter, NotFound
from packbench.db.models import (
    EPISODE_STATUSES,
    SCREEN_STATUSES,
    SqlAttempt,
    SqlAudit,
    SqlEpisode,
    SqlMachine,
    SqlProtocol,
    SqlScreen,
    SqlVerdict,
    episode_column,
)
from packbench.db.records import AttemptRow, AuditRow, MachineRow, ProtocolRow, ScreenRow, StoredVerdict

# The gate names a verdict can carry: the protocol's registry (pure Python, no numpy).
GATES: tuple[str, ...] = GATE_NAMES


# -- filters ---------------------------------------------------------------------------------


def check_one_of(value: str | None, allowed: tuple[str, ...], what: str) -> None:
    if value is not None and value not in allowed:
        raise InvalidFilter(f"unknown {what} {value!r}; use one of {', '.join(allowed)}")


MAX_SUBSTRING = 4096  # --model and --machine: PATH_MAX


@dataclass(frozen=True)
class ResultFilter:
    """Which episodes `results` returns; every field left None matches everything.

    protocol: a protocol name (exact) or a prefix of its SHA-256.
    model: a case-insensitive substring of the protocol's model.path or the screen's
        resolved model directory (a synthetic checkpoint's directory names its shape).
    dtype: exact, one of the protocol dtypes. condition: exact.
    gate: one of `GATES`; the rows are then the episodes that gate judged, each once, with
        its verdict (see `results`); episodes it did not judge are left out.
    phase: with `gate`, only its verdict of this phase (all, prefill or decode).
    passed: with `gate`, that verdict passed (True) or failed (False). Without `gate`: True
        keeps episodes whose condition has verdicts and all passed, False those whose
        condition failed at least one.
    status: the episode's status, 'ok' or 'failed'. role: 'scored' or 'warmup'.
    since, until: when the episode's attempt started, since <= started_at < until.
    machine: a case-insensitive substring of the host, node or GPU name.
    min_energy_j, max_energy_j: the episode's NVML energy in joules lies in
        [min_energy_j, max_energy_j]; either bound leaves out episodes without a reading.
    sort: order by this column of `SORT_KEYS` (episodes without a value last), then as usual;
        descending: largest first.
    screen_id: one screen (every attempt of it).
    limit: at most this many rows (None: all).
    """

    protocol: str | None = None
    model: str | None = None
    dtype: str | None = None
    condition: str | None = None
    gate: str | None = None
    passed: bool | None = None
    status: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    machine: str | None = None
    phase: str | None = None
    min_energy_j: float | None = None
    max_energy_j: float | None = None
    sort: str | None = None
    descending: bool = False
    screen_id: int | None = None
    limit: int | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        check_one_of(self.gate, GATES, "gate")
        check_one_of(self.role, ("scored", "warmup"), "role")
        check_one_of(self.phase, PHASES, "phase")
        if self.phase is not None and self.gate is None:
            raise InvalidFilter(f"--phase {self.phase} picks a verdict of a gate; give --gate too")
        check_one_of(self.sort, tuple(SORT_KEYS), "sort column")
        if self.descending and self.sort is None:
            raise InvalidFilter("--desc reverses a --sort column; give --sort too, e.g. --sort energy_j --desc")
        for option, text in (("--model", self.model), ("--machine", self.machine)):
            # SQLite refuses a LIKE pattern past 50,000 bytes ("pattern too complex", which read as a
            # database fault); no path or host name is longer than PATH_MAX.
            if text is not None and len(text) > MAX_SUBSTRING:
                raise InvalidFilter(f"{option}: a substring of {len(text)} characters is longer than any path or host "
                                    f"name ({MAX_SUBSTRING}); give part of one")
        for name in ("min_energy_j", "max_energy_j"):
            bound = getattr(self, name)
            if bound is not None and not (math.isfinite(bound) and bound >= 0):
                option = "--min-energy" if name == "min_energy_j" else "--max-energy"
                raise InvalidFilter(f"{option} {bound} is not a finite number of joules >= 0; give e.g. {option} 12.5")
        if (self.min_energy_j is not None and self.max_energy_j is not None
                and self.min_energy_j > self.max_energy_j):
            raise InvalidFilter(f"--min-energy {self.min_energy_j} J is above --max-energy {self.max_energy_j} J; "
                                f"swap them")
        check_one_of(self.dtype, DTYPE_NAMES, "dtype")
        check_one_of(self.status, EPISODE_STATUSES, "episode status")
        for name in ("since", "until"):
            moment = getattr(self, name)
            if moment is not None and moment.tzinfo is None:
                raise InvalidFilter(f"{name} {moment!r} is naive; pass an aware datetime (UTC)")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise InvalidFilter(
                f"since {self.since.isoformat()} is not before until {self.until.isoformat()}; "
                f"swap them or widen the range"
            )
        check_limit(self.limit, "row")


# -- results -------------------------------------------------------------------------------


class ResultRow(NamedTuple):
    """One episode with its screen, attempt and protocol; the verdict fields are set only
    when the query named a gate.

    A NamedTuple rather than a frozen dataclass (the other records): a listing builds
    thousands of these, and a 32-field frozen dataclass costs ~9 us per row to construct and
    ~20 us to turn into a dict (`dataclasses.asdict`), against ~1 us for a tuple and its
    `_asdict()`. It is just as immutable and plain.
    """

    screen_id: int
    attempt: int
    attempt_status: str
    protocol: str
    protocol_sha256: str
    model: str | None
    dtype: str | None
    model_dir: str | None
    node: str
    gpu_name: str
    host: str | None
    started_at: datetime
    plan_index: int
    condition: str
    role: str
    prompt: int
    status: str
    error: str | None
    n_tokens: int
    h2d_bytes: int  # weights + indices
    prefill_h2d_bytes: int
    decode_h2d_bytes: int
    d2h_bytes: int
    wall_s: float
    call_s: float
    peak_allocated_bytes: int | None
    peak_sampled_bytes: int | None
    energy_j: float | None  # NVML joules over the episode; None without a counter (the CPU)
    # An approximate condition's fidelity to its reference (core/fidelity.py); None on exact episodes.
    fidelity_mean_kl: float | None
    fidelity_p99_kl: float | None
    fidelity_top1: float | None
    fidelity_max_abs_logit: float | None
    fidelity_divergence_step: int | None  # None on an approximate episode: its tokens never diverged
    gate: str | None = None
    phase: str | None = None  # the verdicts' phases, '+'-joined when the gate judged several
    passed: bool | None = None  # every phase's verdict passed
    value: float | None = None  # with one phase only (pick one with `phase`)
    threshold: float | None = None


# `results --sort` columns (`core.record.SORT_NAMES`, in its order): a stored field's own
# column, or one of these.
_SORT_EXPRESSIONS: dict[str, Any] = {
    "h2d_bytes": SqlEpisode.h2d_weight_bytes + SqlEpisode.h2d_index_bytes,
    "started_at": SqlAttempt.started_at,
}
SORT_KEYS: dict[str, Any] = {
    name: _SORT_EXPRESSIONS[name] if name in _SORT_EXPRESSIONS else episode_column(name) for name in SORT_NAMES
}


def protocol_matches(ref: str) -> ColumnElement[bool]:
    if not isinstance(ref, str):  # an int or None was an AttributeError (no .lower())
        raise InvalidFilter(f"protocol {show(ref, 40)}: give a protocol name or SHA-256 prefix as text")
    condition = SqlProtocol.name == ref
    lowered = ref.lower()
    if lowered and all(c in "0123456789abcdef" for c in lowered):
        condition = or_(condition, SqlProtocol.sha256.startswith(lowered))
    return condition


def _same_condition_verdicts(*criteria: ColumnElement[bool]) -> Any:
    """EXISTS a verdict of the episode's attempt and condition that meets `criteria`."""
    return exists().where(
        SqlVerdict.attempt_id == SqlEpisode.attempt_id, SqlVerdict.condition == SqlEpisode.condition, *criteria
    )


# `results`' columns: ResultRow's in its order, then the episode's attempt id (not a
# ResultRow field: the key its verdicts are fetched by).
_RESULT_COLUMNS = (
    SqlScreen.id, SqlAttempt.number, SqlAttempt.status, SqlProtocol.name, SqlProtocol.sha256,
    SqlProtocol.model, SqlProtocol.dtype, SqlScreen.model_dir, SqlAttempt.node, SqlAttempt.gpu_name,
    SqlMachine.host, SqlAttempt.started_at, SqlEpisode.plan_index, SqlEpisode.condition, SqlEpisode.role,
    SqlEpisode.prompt, SqlEpisode.status, SqlEpisode.error, SqlEpisode.n_tokens,
    SqlEpisode.h2d_weight_bytes + SqlEpisode.h2d_index_bytes, SqlEpisode.prefill_h2d_bytes,
    SqlEpisode.decode_h2d_bytes, SqlEpisode.d2h_bytes, SqlEpisode.wall_s, SqlEpisode.call_s,
    SqlEpisode.peak_allocated_bytes, SqlEpisode.peak_sampled_bytes, SqlEpisode.energy_j,
    SqlEpisode.fidelity_mean_kl, SqlEpisode.fidelity_p99_kl, SqlEpisode.fidelity_top1,
    SqlEpisode.fidelity_max_abs_logit, SqlEpisode.fidelity_divergence_step,
    SqlEpisode.attempt_id,
)


def results(session: Session, f: ResultFilter) -> list[ResultRow]:
    """Episodes matching `f`, ordered by screen, attempt and plan index (after `f.sort`).

    With `f.gate` each episode appears once, carrying the verdicts of that gate that judged
    it: same attempt and condition, and its plan index among the verdict's episodes (a
    verdict that failed closed before judging any covers its condition's scored episodes).
    So warmups carry a faithfulness verdict (exactness includes them) but no acquisition or
    runtime one; several phases fold into one row (`phase` 'prefill+decode', `passed` only
    when every phase passed, `value` and `threshold` only for a single phase).
    """
    query = (
        select(*_RESULT_COLUMNS)
        .select_from(SqlEpisode)
        .join(SqlAttempt, SqlAttempt.id == SqlEpisode.attempt_id)
        .join(SqlScreen, SqlScreen.id == SqlAttempt.screen_id)
        .join(SqlProtocol, SqlProtocol.id == SqlScreen.protocol_id)
        .outerjoin(SqlMachine, SqlMachine.id == SqlAttempt.machine_id)
        .where(*_result_criteria(f))
    )
    order = [SqlScreen.id, SqlAttempt.number, SqlEpisode.plan_index]
    if f.sort is not None:
        key = SORT_KEYS[f.sort]
        order.insert(0, (key.desc() if f.descending else key.asc()).nulls_last())
    query = query.order_by(*order)
    if f.limit is not None and f.gate is None:
        # With a gate, which candidates a verdict judged is read from its episode list (JSON
        # text, not joinable on both backends alike), so `_with_verdicts` applies the limit.
        query = query.limit(f.limit)
    # Core execution (no ORM result machinery): the rows are plain column tuples anyway.
    rows = list(session.connection().execute(query))
    if f.gate is None:
        return [ResultRow(*row[:-1]) for row in rows]
    return _with_verdicts(session, rows, f)


def _result_criteria(f: ResultFilter) -> list[ColumnElement[bool]]:
    """The WHERE clauses of the filters `f` sets (ANDed)."""
    criteria: list[ColumnElement[bool]] = []
    if f.gate is not None:
        # Candidates: episodes of a condition the gate judged in that attempt. Which of them
        # a verdict covers, and --passed/--failed, are decided per episode (`_with_verdicts`).
        criteria.append(_same_condition_verdicts(*_gate_criteria(f)))
    elif f.passed is True:
        criteria += [_same_condition_verdicts(), ~_same_condition_verdicts(~SqlVerdict.passed)]
    elif f.passed is False:
        criteria.append(_same_condition_verdicts(~SqlVerdict.passed))
    if f.protocol is not None:
        criteria.append(protocol_matches(f.protocol))
    if f.model is not None:
        criteria.append(or_(SqlProtocol.model.icontains(f.model, autoescape=True),
                            SqlScreen.model_dir.icontains(f.model, autoescape=True)))
    if f.dtype is not None:
        criteria.append(SqlProtocol.dtype == f.dtype)
    if f.condition is not None:
        criteria.append(SqlEpisode.condition == f.condition)
    if f.status is not None:
        criteria.append(SqlEpisode.status == f.status)
    if f.role is not None:
        criteria.append(SqlEpisode.role == f.role)
    if f.since is not None:
        criteria.append(SqlAttempt.started_at >= f.since)
    if f.until is not None:
        criteria.append(SqlAttempt.started_at < f.until)
    if f.machine is not None:
        criteria.append(or_(*(column.icontains(f.machine, autoescape=True) for column in
                              (SqlAttempt.node, SqlAttempt.gpu_name, SqlMachine.host, SqlMachine.gpu_name))))
    if f.min_energy_j is not None:
        criteria.append(SqlEpisode.energy_j >= f.min_energy_j)
    if f.max_energy_j is not None:
        criteria.append(SqlEpisode.energy_j <= f.max_energy_j)
    if f.screen_id is not None:
        criteria.append(SqlAttempt.screen_id == f.screen_id)
    return criteria


def _gate_criteria(f: ResultFilter) -> list[ColumnElement[bool]]:
    return [SqlVerdict.gate == f.gate, *([SqlVerdict.phase == f.phase] if f.phase is not None else [])]


_PLAN_INDEX, _CONDITION, _ROLE = (ResultRow._fields.index(name) for name in ("plan_index", "condition", "role"))
_CHUNK = 500  # ids per IN (...): far below SQLite's bound on bound parameters


def _with_verdicts(session: Session, rows: list[Any], f: ResultFilter) -> list[ResultRow]:
    """`rows` (ResultRow columns + attempt_id) with the verdicts of `f.gate` that judged each;
    episodes none judged, or whose verdict `f.passed` rules out, are left out."""
    attempt_ids = sorted({row[-1] for row in rows})
    by_key: dict[tuple[int, str], list[tuple[str, bool, float | None, float | None, frozenset[int] | None]]] = {}
    for i in range(0, len(attempt_ids), _CHUNK):
        query = select(SqlVerdict.attempt_id, SqlVerdict.condition, SqlVerdict.phase, SqlVerdict.passed, SqlVerdict.value,
                       SqlVerdict.threshold, SqlVerdict.episodes_json).where(
            SqlVerdict.attempt_id.in_(attempt_ids[i:i + _CHUNK]), *_gate_criteria(f))
        for attempt_id, condition, phase, passed, value, threshold, episodes_json in session.execute(query):
            by_key.setdefault((attempt_id, condition), []).append(
                (phase, bool(passed), value, threshold, _judged(episodes_json)))
    out: list[ResultRow] = []
    for row in rows:
        base, attempt_id = row[:-1], row[-1]
        plan_index, condition, role = base[_PLAN_INDEX], base[_CONDITION], base[_ROLE]
        mine = sorted((v for v in by_key.get((attempt_id, condition), ())
                       if (plan_index in v[4] if v[4] else role == "scored")),
                      key=lambda v: PHASES.index(v[0]) if v[0] in PHASES else len(PHASES))
        if not mine:
            continue
        passed = all(v[1] for v in mine)
        if f.passed is not None and passed != f.passed:
            continue
        one = mine[0] if len(mine) == 1 else None
        out.append(ResultRow(*base, gate=f.gate, phase="+".join(v[0] for v in mine), passed=passed,
                             value=one[2] if one else None, threshold=one[3] if one else None))
        if f.limit is not None and len(out) >= f.limit:
            break
    return out


def _judged(episodes_json: str) -> frozenset[int] | None:
    """The plan indexes a verdict judged; None when it lists none (it failed closed first)."""
    try:
        indexes = json.loads(episodes_json)
    except (TypeError, ValueError):
        return None
    if not isinstance(indexes, list):
        return None
    return frozenset(i for i in indexes if isinstance(i, int)) or None


# -- screens -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScreenSummary:
    """A screen in `screens list`; `latest_status` is its latest attempt's status (None: it never
    started), and the verdict counts are those that attempt stored (0 and 0: it stored none, as a
    running attempt or one that ended before its verdicts)."""

    id: int
    protocol: str
    protocol_sha256: str
    status: str
    submitter: str
    created_at: datetime
    attempts: int
    latest_status: str | None
    passed: int
    failed: int


def verdict_order(v: StoredVerdict) -> tuple[str, str, str]:
    """Verdicts in (gate, condition, phase) order by code point, sorted here and not by ORDER BY:
    PostgreSQL orders text by the database's collation (en_US puts 'packet' before 'Zeta', C and
    SQLite after), so the two backends listed one attempt's verdicts differently."""
    return v.gate, v.condition, v.phase


def condition_tiers(session: Session, protocol_sha256s: Iterable[str]) -> dict[str, dict[str, str]]:
    """protocol SHA-256 -> condition name -> tier, from each stored protocol's frozen body
    (`Store.condition_tiers`)."""
    from packbench.core.registry import tier_of

    wanted = sorted(set(protocol_sha256s))
    out: dict[str, dict[str, str]] = {}
    for start in range(0, len(wanted), _CHUNK):
        rows = session.execute(select(SqlProtocol.sha256, SqlProtocol.canonical_json)
                               .where(SqlProtocol.sha256.in_(wanted[start:start + _CHUNK])))
        for sha, body in rows:
            conditions = json.loads(body).get("conditions")
            out[sha] = {c["name"]: tier_of(c["policy"]) for c in conditions if isinstance(c, dict)
                        and isinstance(c.get("name"), str) and isinstance(c.get("policy"), str)} \
                if isinstance(conditions, list) else {}
    return out


def condition_names(session: Session) -> list[str]:
    """Every condition name any stored episode has, sorted."""
    return sorted(session.scalars(select(SqlEpisode.condition).distinct()))


def get_row(session: Session, model: type, key: int, noun: str, *, for_update: bool = False) -> Any:
    """The `model` row with primary key `key` (locked with `for_update`, PostgreSQL), or
    `NotFound` naming the `noun`."""
    obj = session.get(model, key, with_for_update=True if for_update else None)
    if obj is None:
        raise NotFound(f"no {noun} with id {key}; list screens with `packbench screens list`")
    return obj


MAX_ID = 2**31 - 1  # ids are `integer` columns: 32-bit on PostgreSQL


def check_limit(limit: Any, what: str) -> None:
    """A row limit is None (every row) or an integer 1..MAX_ID: a float, a bool, 0, a negative
    or a number past what a LIMIT takes (SQLite's driver overflows at 2**63) is refused."""
    if limit is None:
        return
    if type(limit) is not int or not 1 <= limit <= MAX_ID:
        raise InvalidFilter(f"limit {str(limit)[:30]!s} must be an integer from 1 to {MAX_ID} (or None for every {what})")


def find_screen(session: Session, ref: int | str, *, for_update: bool = False) -> SqlScreen:
    """The screen with id `ref` (an int or a string of digits), or 'latest' (highest id);
    `for_update` locks its row (PostgreSQL) for a read-then-write."""
    if ref == "latest":
        query = select(SqlScreen).order_by(SqlScreen.id.desc()).limit(1)
        screen = session.scalars(query.with_for_update() if for_update else query).first()
        if screen is None:
            raise NotFound("there is no screen yet; submit one with `packbench submit`")
        return screen
    if isinstance(ref, str) and not (ref.isascii() and ref.isdigit()):
        raise NotFound(f"no screen {one_line(ref[:60])!r}; give a screen id or 'latest'")
    if not isinstance(ref, (int, str)) or isinstance(ref, bool):  # a float (nan, inf, 1.5), True, None, ...
        raise NotFound(f"no screen {one_line(repr(ref)[:60])}; give a screen id (an integer) or 'latest'")
    if not 0 <= int(ref) <= MAX_ID:  # beyond the id column: no such screen (SQLite's driver would overflow)
        raise NotFound(f"no screen with id {str(ref)[:30]}{'...' if len(str(ref)) > 30 else ''}; ids are at most "
                       f"{MAX_ID}; list them with `packbench screens list`")
    screen = session.get(SqlScreen, int(ref), with_for_update=True if for_update else None)
    if screen is None:
        raise NotFound(f"no screen with id {ref}; list them with `packbench screens list`")
    return screen


def list_screens(
    session: Session,
    *,
    status: str | None = None,
    protocol: str | None = None,
    limit: int | None = None,
) -> list[ScreenSummary]:
    """Screens, newest first, optionally by status and protocol (name or SHA-256 prefix)."""
    check_one_of(status, SCREEN_STATUSES, "screen status")
    check_limit(limit, "screen")
    attempts = (
        select(
            SqlAttempt.screen_id.label("screen_id"),
            func.count(SqlAttempt.id).label("attempts"),
            func.max(SqlAttempt.number).label("latest"),
        )
        .group_by(SqlAttempt.screen_id)
        .subquery()
    )
    verdicts = (
        select(
            SqlAttempt.screen_id.label("screen_id"),
            func.sum(case((SqlVerdict.passed, 1), else_=0)).label("passed"),
            func.sum(case((SqlVerdict.passed, 0), else_=1)).label("failed"),
        )
        .join(SqlVerdict, SqlVerdict.attempt_id == SqlAttempt.id)
        .join(attempts, and_(attempts.c.screen_id == SqlAttempt.screen_id, attempts.c.latest == SqlAttempt.number))
        .group_by(SqlAttempt.screen_id)
        .subquery()
    )
    latest = aliased(SqlAttempt)
    query = (
        select(
            SqlScreen.id, SqlProtocol.name, SqlProtocol.sha256, SqlScreen.status, SqlScreen.submitter,
            SqlScreen.created_at, attempts.c.attempts, verdicts.c.passed, verdicts.c.failed, latest.status,
        )
        .join(SqlProtocol, SqlProtocol.id == SqlScreen.protocol_id)
        .outerjoin(attempts, attempts.c.screen_id == SqlScreen.id)
        .outerjoin(latest, and_(latest.screen_id == SqlScreen.id, latest.number == attempts.c.latest))
        .outerjoin(verdicts, verdicts.c.screen_id == SqlScreen.id)
        .order_by(SqlScreen.id.desc())
    )
    if status is not None:
        query = query.where(SqlScreen.status == status)
    if protocol is not None:
        query = query.where(protocol_matches(protocol))
    if limit is not None:
        query = query.limit(limit)
    return [
        ScreenSummary(
            id=row[0], protocol=row[1], protocol_sha256=row[2], status=row[3], submitter=row[4],
            created_at=row[5], attempts=int(row[6] or 0), latest_status=row[9], passed=int(row[7] or 0),
            failed=int(row[8] or 0),
        )
        for row in session.execute(query)
    ]


@dataclass(frozen=True, slots=True)
class AttemptDetail:
    attempt: AttemptRow
    machine: MachineRow | None
    episodes: int
    failed_episodes: int
    verdicts: tuple[StoredVerdict, ...]  # by (gate, condition, phase)
    audits: tuple[AuditRow, ...]  # oldest first


@dataclass(frozen=True, slots=True)
class ScreenDetail:
    screen: ScreenRow
    protocol: ProtocolRow
    attempts: tuple[AttemptDetail, ...]  # by number; failed and interrupted ones included


def screen_detail(session: Session, ref: int | str) -> ScreenDetail:
    """A screen with its protocol and every attempt's verdicts, audits and episode counts."""
    screen = find_screen(session, ref)
    protocol = session.get_one(SqlProtocol, screen.protocol_id)
    attempts = session.scalars(
        select(SqlAttempt).where(SqlAttempt.screen_id == screen.id).order_by(SqlAttempt.number)
    ).all()
    ids = [a.id for a in attempts]
    counts = {
        attempt_id: (total, int(failed or 0))
        for attempt_id, total, failed in session.execute(
            select(
                SqlEpisode.attempt_id,
                func.count(SqlEpisode.id),
                func.sum(case((SqlEpisode.status == "failed", 1), else_=0)),
            )
            .where(SqlEpisode.attempt_id.in_(ids))
            .group_by(SqlEpisode.attempt_id)
        )
    }
    verdicts: dict[int, list[StoredVerdict]] = {i: [] for i in ids}
    for verdict in session.scalars(select(SqlVerdict).where(SqlVerdict.attempt_id.in_(ids))):
        verdicts[verdict.attempt_id].append(verdict.to_record())
    for listed in verdicts.values():
        listed.sort(key=verdict_order)
    audits: dict[int, list[AuditRow]] = {i: [] for i in ids}
    for audit in session.scalars(select(SqlAudit).where(SqlAudit.attempt_id.in_(ids)).order_by(SqlAudit.id)):
        audits[audit.attempt_id].append(audit.to_record())
    details = []
    for attempt in attempts:
        machine = session.get(SqlMachine, attempt.machine_id) if attempt.machine_id is not None else None
        total, failed = counts.get(attempt.id, (0, 0))
        details.append(
            AttemptDetail(
                attempt=attempt.to_record(),
                machine=machine.to_record() if machine is not None else None,
                episodes=total,
                failed_episodes=failed,
                verdicts=tuple(verdicts[attempt.id]),
                audits=tuple(audits[attempt.id]),
            )
        )
    return ScreenDetail(screen=screen.to_record(), protocol=protocol.to_record(), attempts=tuple(details))
