"""`packbench compare`: two screens' latest attempts side by side.

Per condition the scored episodes' totals, peaks, energy and (approximate conditions)
fidelity, with b / a ratios, and every verdict of either attempt. Called by `Store.compare`
inside its transaction; returns frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Float, and_, case, cast, func, select
from sqlalchemy.orm import Session

from packbench.core.record import FIELDS_BY_NAME, STORED_FIELDS
from packbench.db.errors import NotFound
from packbench.db.models import SqlAttempt, SqlEpisode, SqlProtocol, SqlVerdict, episode_column
from packbench.db.queries import find_screen

_OK = SqlEpisode.status == "ok"


def _ok_sum(column: Any, as_type: Any) -> Any:
    # cast: PostgreSQL sums BIGINT into NUMERIC, which would come back as Decimal.
    return cast(func.sum(case((_OK, column), else_=0)), as_type)


def _sum_type(name: str) -> Any:
    return BigInteger if FIELDS_BY_NAME[name].type is int else Float


# Totals `compare` sums and peaks it takes the maximum of: fields of `core.record`.
COMPARE_TOTALS = ("prefill_h2d_bytes", "decode_h2d_bytes", "d2h_bytes", "wall_s", "call_s")
COMPARE_PEAKS = tuple(f.name for f in STORED_FIELDS if f.name.startswith("peak_"))

# Per condition, over the scored episodes of one attempt. Totals and peaks count only
# episodes that finished ('ok'); 'failed' says how many did not, so a total is never read
# without knowing what it left out.
COMPARE_METRICS: dict[str, Any] = {
    "episodes": func.count(SqlEpisode.id),
    "failed": func.sum(case((_OK, 0), else_=1)),
    "h2d_bytes": _ok_sum(episode_column("h2d_weight_bytes") + episode_column("h2d_index_bytes"), BigInteger),
    **{name: _ok_sum(episode_column(name), _sum_type(name)) for name in COMPARE_TOTALS},
    **{name: func.max(case((_OK, episode_column(name)))) for name in COMPARE_PEAKS},
}
_COUNTS = ("episodes", "failed")  # no ratio: they say what the totals cover

# Energy (NVML joules), over the ok scored episodes that carry a reading and generated tokens,
# as the HTML report takes it (core.report.energy): per episode the mean, per generated token
# the sum of joules over the sum of tokens. None where no episode has a reading (the CPU).
_HAS_ENERGY = and_(_OK, SqlEpisode.energy_j.is_not(None), SqlEpisode.n_tokens > 0)
_ENERGY_SUMS: dict[str, Any] = {
    "energy_episodes": func.sum(case((_HAS_ENERGY, 1), else_=0)),
    "energy_j": cast(func.sum(case((_HAS_ENERGY, SqlEpisode.energy_j))), Float),
    "energy_tokens": cast(func.sum(case((_HAS_ENERGY, SqlEpisode.n_tokens))), BigInteger),
}
ENERGY_METRICS = ("energy_j_per_episode", "energy_j_per_token")

# Fidelity of an approximate condition over its ok scored episodes (each bounded per episode by
# the fidelity gate, so the worst is what a reader compares; the mean KL is also averaged).
# Listed only for a condition that has them on either side: exact conditions have none.
_HAS_FIDELITY = and_(_OK, SqlEpisode.fidelity_mean_kl.is_not(None))
FIDELITY_METRICS: dict[str, Any] = {
    "fidelity_mean_kl_mean": func.avg(case((_HAS_FIDELITY, SqlEpisode.fidelity_mean_kl))),
    "fidelity_mean_kl_max": func.max(case((_HAS_FIDELITY, SqlEpisode.fidelity_mean_kl))),
    "fidelity_p99_kl_max": func.max(case((_HAS_FIDELITY, SqlEpisode.fidelity_p99_kl))),
    "fidelity_top1_min": func.min(case((_HAS_FIDELITY, SqlEpisode.fidelity_top1))),
    "fidelity_max_abs_logit_max": func.max(case((_HAS_FIDELITY, SqlEpisode.fidelity_max_abs_logit))),
    "fidelity_divergence_step_min": func.min(case((_HAS_FIDELITY, SqlEpisode.fidelity_divergence_step))),
}


def _energy(sums: dict[str, Any]) -> dict[str, float | None]:
    joules, n, tokens = sums["energy_j"], sums["energy_episodes"], sums["energy_tokens"]
    return {"energy_j_per_episode": joules / n if joules is not None and n else None,
            "energy_j_per_token": joules / tokens if joules is not None and tokens else None}


@dataclass(frozen=True, slots=True)
class CompareSide:
    screen_id: int
    protocol: str
    protocol_sha256: str
    attempt: int
    attempt_status: str


@dataclass(frozen=True, slots=True)
class MetricPair:
    condition: str
    metric: str
    a: float | int | None
    b: float | int | None
    ratio: float | None  # b / a; None when either is missing or a is 0


@dataclass(frozen=True, slots=True)
class VerdictPair:
    gate: str
    condition: str
    phase: str
    a_passed: bool | None  # None: screen A has no such verdict
    a_value: float | None
    b_passed: bool | None
    b_value: float | None
    # What each was judged on: the interval where the gate judges one (runtime), and its detail.
    a_interval_lo: float | None = None
    a_interval_hi: float | None = None
    a_detail: str | None = None
    b_interval_lo: float | None = None
    b_interval_hi: float | None = None
    b_detail: str | None = None


@dataclass(frozen=True, slots=True)
class ScreenComparison:
    a: CompareSide
    b: CompareSide
    metrics: tuple[MetricPair, ...]  # by condition, then COMPARE_METRICS and ENERGY_METRICS order
    verdicts: tuple[VerdictPair, ...]  # by (gate, condition, phase)


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, or None when it is undefined."""
    if a is None or b is None or a == 0:
        return None
    return b / a


def _side(session: Session, ref: int | str) -> tuple[CompareSide, int]:
    screen = find_screen(session, ref)
    attempt = session.scalars(
        select(SqlAttempt).where(SqlAttempt.screen_id == screen.id).order_by(SqlAttempt.number.desc()).limit(1)
    ).first()
    if attempt is None:
        raise NotFound(
            f"screen {screen.id} has not run yet, so there is nothing to compare; "
            f"run it with `packbench dispatch`"
        )
    protocol = session.get_one(SqlProtocol, screen.protocol_id)
    side = CompareSide(screen_id=screen.id, protocol=protocol.name, protocol_sha256=protocol.sha256,
                       attempt=attempt.number, attempt_status=attempt.status)
    return side, attempt.id


def _totals(session: Session, attempt_id: int) -> dict[str, dict[str, Any]]:
    query = (
        select(SqlEpisode.condition, *COMPARE_METRICS.values(), *_ENERGY_SUMS.values(), *FIDELITY_METRICS.values())
        .where(SqlEpisode.attempt_id == attempt_id, SqlEpisode.role == "scored")
        .group_by(SqlEpisode.condition)
    )
    out = {}
    energy_at, fidelity_at = 1 + len(COMPARE_METRICS), 1 + len(COMPARE_METRICS) + len(_ENERGY_SUMS)
    for row in session.execute(query):
        metrics = dict(zip(COMPARE_METRICS, row[1:]))
        fidelity = {k: v for k, v in zip(FIDELITY_METRICS, row[fidelity_at:])}
        out[row[0]] = {**metrics, **_energy(dict(zip(_ENERGY_SUMS, row[energy_at:fidelity_at]))), **fidelity}
    return out


_NO_VERDICT = (None, None, None, None, None)


def _verdicts(session: Session, attempt_id: int) -> dict[tuple[str, str, str], tuple]:
    """(gate, condition, phase) -> (passed, value, interval_lo, interval_hi, detail)."""
    query = select(SqlVerdict.gate, SqlVerdict.condition, SqlVerdict.phase, SqlVerdict.passed, SqlVerdict.value,
                   SqlVerdict.interval_lo, SqlVerdict.interval_hi, SqlVerdict.detail).where(SqlVerdict.attempt_id == attempt_id)
    return {(g, c, p): tuple(rest) for g, c, p, *rest in session.execute(query)}


def compare(session: Session, ref_a: int | str, ref_b: int | str) -> ScreenComparison:
    """Scored-episode totals per condition and verdicts of two screens' latest attempts."""
    side_a, attempt_a = _side(session, ref_a)
    side_b, attempt_b = _side(session, ref_b)
    totals_a, totals_b = _totals(session, attempt_a), _totals(session, attempt_b)
    metrics = []
    for condition in sorted(set(totals_a) | set(totals_b)):
        a, b = totals_a.get(condition, {}), totals_b.get(condition, {})
        approximate = a.get("fidelity_mean_kl_max") is not None or b.get("fidelity_mean_kl_max") is not None
        for metric in (*COMPARE_METRICS, *ENERGY_METRICS, *(FIDELITY_METRICS if approximate else ())):
            value_a, value_b = a.get(metric), b.get(metric)
            metrics.append(
                MetricPair(
                    condition=condition, metric=metric, a=value_a, b=value_b,
                    ratio=None if metric in _COUNTS else ratio(value_a, value_b),
                )
            )
    verdicts_a, verdicts_b = _verdicts(session, attempt_a), _verdicts(session, attempt_b)
    verdicts = []
    for key in sorted(set(verdicts_a) | set(verdicts_b)):
        a_passed, a_value, a_lo, a_hi, a_detail = verdicts_a.get(key, _NO_VERDICT)
        b_passed, b_value, b_lo, b_hi, b_detail = verdicts_b.get(key, _NO_VERDICT)
        verdicts.append(VerdictPair(*key, a_passed=a_passed, a_value=a_value, b_passed=b_passed, b_value=b_value,
                                    a_interval_lo=a_lo, a_interval_hi=a_hi, a_detail=a_detail,
                                    b_interval_lo=b_lo, b_interval_hi=b_hi, b_detail=b_detail))
    return ScreenComparison(a=side_a, b=side_b, metrics=tuple(metrics), verdicts=tuple(verdicts))
