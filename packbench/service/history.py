"""History: one protocol's screens across code versions, each figure's median and spread, and
the steps where a figure moved (`packbench history`, `packbench compare A B --fail-above`).

The method, stated once (docs/api.md, "History and regressions"):

- A screen's value of a timed figure is the median over its scored, ok episodes of one
  condition. Screens are ordered by their recorded source commit (`core/source.py`; commits in
  the order their first screen ran), then by when they ran.
- A **step** at screen i: its value lies more than `K` spreads from the median of the runs
  before it (since the last step, at most `WINDOW` of them, at least `MIN_BEFORE`), and the run
  after it lies beyond the same bound on the same side and within `K` spreads (scaled to the new
  level) of the step's own value (confirmed: a blip just before a real step is not the step).
  The spread is the larger of 1.4826 x the median absolute deviation and the sample standard
  deviation, floored at `FLOOR` of the median (identical repeats spread by 0). The newest run
  has no run after it: a change there is reported as unconfirmed, and `--fail-above` counts it
  (CI judges the newest commit).
- The false-alarm rate is measured, not assumed. On i.i.d. log-normal noise (sigma 0.05, 0.1,
  0.3; 2000 sequences of 12 runs each) a confirmed step was found in 0.5 %, 0.75 % and 0.85 % of
  sequences; a 30 % slowdown after 6 runs of 5 % noise was found in 73 % of sequences, a 50 %
  one in 97 % (tests/cli/test_history.py holds the rate under 1.5 % and
  the 50 % step's detection above 95 %). `false_alarm_rate` shuffles a
  protocol's own repeated runs of one commit (exchangeable when nothing changed) and counts the
  orderings with a step; `history` prints it for the commit with the most runs.
- **Exact counters** (bytes moved, episode rows, the generated tokens) have no noise: any change
  between consecutive screens is flagged.

Pure functions over plain rows: the database is reached through the `Store` passed in.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median, stdev
from typing import Any

from packbench.core.text import show

K = 4.0  # spreads beyond the baseline median
MIN_BEFORE = 5  # runs a baseline needs
WINDOW = 10  # newest runs a baseline keeps
FLOOR = 0.01  # spread floor, as a fraction of the baseline median
MAD_SCALE = 1.4826  # MAD -> sigma for normal noise


def decode_tokens(e: Any) -> int:
    """An episode's decode tokens: every sequence's tokens but its first, the prefill's (a batch's
    `tokens` hold one list per sequence, so B x (N - 1) of its B x N; docs/metrics.md)."""
    return e.n_tokens - (sum(isinstance(t, list) for t in e.tokens) or 1)


# Timed figures: a screen's value is the median over its scored ok episodes of one condition.
TIMED: dict[str, Callable[[Any], float | None]] = {
    "wall_ms": lambda e: 1e3 * e.wall_s,
    "call_ms": lambda e: 1e3 * e.call_s,
    "decode_ms_per_token": lambda e: 1e3 * e.decode_call_s / decode_tokens(e) if decode_tokens(e) > 0 else None,
}
# Exact counters: one value per screen and condition, over every ok episode (warmups too).
EXACT: dict[str, Callable[[list], Any]] = {
    "h2d_bytes": lambda eps: sum(e.h2d_weight_bytes + e.h2d_index_bytes for e in eps),
    "d2h_bytes": lambda eps: sum(e.d2h_bytes for e in eps),
    "rows": lambda eps: len(eps),
    "tokens": lambda eps: hashlib.sha256(json.dumps(sorted((e.plan_index, list(e.tokens)) for e in eps))
                                         .encode()).hexdigest()[:16],
}
METRICS = (*TIMED, *EXACT)


@dataclass(frozen=True)
class Step:
    index: int  # position in the sequence
    before: float  # the baseline median
    value: float
    change_pct: float  # (value - before) / before * 100
    confirmed: bool  # the run after it is beyond the bound too (False: the newest run)


def robust(values: Sequence[float]) -> tuple[float, float]:
    """(median, spread) of `values`: the larger of 1.4826 x MAD and the sample standard
    deviation, floored at FLOOR x |median|. Either alone misleads on a baseline of five runs:
    the MAD of a few runs is often near 0 (a 17 % false-alarm rate on 12-run log-normal
    sequences with the MAD alone at K=4), the standard deviation swells with one outlier."""
    m = median(values)
    mad = median(abs(v - m) for v in values)
    sd = stdev(values) if len(values) > 1 else 0.0
    return m, max(MAD_SCALE * mad, sd, FLOOR * abs(m))


def steps(values: Sequence[float], *, k: float = K) -> list[Step]:
    """The steps of a sequence of per-screen values (the method in the module docstring)."""
    out: list[Step] = []
    start = 0
    for i in range(len(values)):
        base = values[max(start, i - WINDOW):i]
        if len(base) < MIN_BEFORE:
            continue
        m, s = robust(base)
        d = values[i] - m
        if abs(d) <= k * s:
            continue
        nxt = values[i + 1] if i + 1 < len(values) else None
        # Confirmed: the next run is beyond the bound on the same side, and at the new level
        # (within k spreads of this value, the spread scaled to it). Else this run is one outlier,
        # even when the next run is a real step further on: a blip just before a slowdown must
        # not take the slowdown's screen (and commit) from it.
        level = s * abs(values[i] / m) if m else s
        if nxt is not None and not (abs(nxt - m) > k * s and (nxt - m) * d > 0
                                    and abs(nxt - values[i]) <= k * level):
            continue
        out.append(Step(i, m, values[i], 100.0 * d / m if m else math.inf, confirmed=nxt is not None))
        start = i  # the new level is the next baseline
    return out


def false_alarm_rate(values: Sequence[float], *, k: float = K, shuffles: int = 1000, seed: int = 0) -> float:
    """The fraction of random orderings of `values` (repeated runs of one commit) in which
    `steps` finds a confirmed step: the detector's false-alarm rate on this noise."""
    rng = random.Random(seed)
    xs = list(values)
    alarms = 0
    for _ in range(shuffles):
        rng.shuffle(xs)
        alarms += any(s.confirmed for s in steps(xs, k=k))
    return alarms / shuffles


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """n, median, min and max."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": median(values), "min": min(values), "max": max(values)}


@dataclass(frozen=True)
class ScreenFigures:
    """One screen in history order, with its figures per condition."""

    screen_id: int
    commit: str
    started_at: Any
    name: str | None
    timed: dict[str, dict[str, dict]]  # condition -> metric -> spread over its episodes
    exact: dict[str, dict[str, Any]]  # condition -> counter -> value


@dataclass(frozen=True)
class Series:
    condition: str
    metric: str
    values: list[Any]  # one per point (None where the screen has no such episodes)
    steps: list[Step] = field(default_factory=list)  # timed figures
    changes: list[int] = field(default_factory=list)  # exact counters: indexes whose value differs from the previous


@dataclass(frozen=True, repr=False)
class History:
    protocol: str
    points: list[ScreenFigures]
    series: list[Series]
    far: dict[str, Any] | None  # the measured false-alarm rate: commit, runs, shuffles, rate
    # condition -> tier (exact | approximate): every row and heading says it, as `results` and
    # `compare` do, so an approximate competitor's figures never stand unlabelled beside exact ones
    tiers: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # the fields print kilobytes of figures: a summary, as a notebook shows it
        commits = len({p.commit for p in self.points})
        steps = sum(len(s.steps) for s in self.series)
        changes = sum(len(s.changes) for s in self.series)
        return (f"History({self.protocol!r}: {len(self.points)} screens over {commits} commits, "
                f"{len(self.series)} series, {steps} steps, {changes} changes; .rows() or .frame() for the figures)")

    def rows(self) -> list[dict[str, Any]]:
        """One row per screen, condition and figure, in history order: screen_id, commit,
        started_at, name, condition, metric, value, and whether a step or a change lands there."""
        out = []
        for s in self.series:
            steps = {st.index for st in s.steps}
            for i, p in enumerate(self.points):
                out.append({"screen_id": p.screen_id, "commit": p.commit, "started_at": p.started_at, "name": p.name,
                            "condition": s.condition, "tier": self.tiers.get(s.condition), "metric": s.metric,
                            "value": s.values[i],
                            "step": i in steps, "changed": i in s.changes})
        return out

    def frame(self):
        """`rows()` as a pandas DataFrame (pandas: `pip install 'packbench[api]'`)."""
        from packbench.core.errors import PackbenchError

        try:
            import pandas as pd
        except ImportError:
            raise PackbenchError("History.frame() needs pandas, which is not installed: "
                                 "pip install 'packbench[api]'") from None
        return pd.DataFrame(self.rows(), columns=["screen_id", "commit", "started_at", "name", "condition", "metric",
                                                  "value", "step", "changed"])

    def regressions(self, fail_above_pct: float) -> list[str]:
        """One line per timed step slower by more than `fail_above_pct` percent, and per exact
        counter change (any change: exact figures have no noise to hide in)."""
        check_pct(fail_above_pct)
        out = []
        for s in self.series:
            for st in s.steps:
                if st.change_pct > fail_above_pct:
                    p = self.points[st.index]
                    out.append(f"{s.condition} {s.metric}: {st.change_pct:+.1f}% at screen {p.screen_id} (commit "
                               f"{p.commit[:10] or '?'}), {st.before:.4g} -> {st.value:.4g}"
                               f"{'' if st.confirmed else ' (newest run, unconfirmed)'}")
            for i in s.changes:
                p = self.points[i]
                out.append(f"{s.condition} {s.metric}: changed at screen {p.screen_id} (commit {p.commit[:10] or '?'}),"
                           f" {s.values[i - 1]} -> {s.values[i]}")
        return out


def screen_figures(episodes: Sequence[Any], *, metrics: Sequence[str]) -> tuple[dict, dict]:
    """(timed, exact) figures of one attempt's episode rows, per condition."""
    timed: dict[str, dict[str, dict]] = {}
    exact: dict[str, dict[str, Any]] = {}
    for c in sorted({e.condition for e in episodes}):
        ok = [e for e in episodes if e.condition == c and e.status == "ok"]
        scored = [e for e in ok if e.role == "scored"]
        timed[c] = {m: spread([v for v in map(TIMED[m], scored) if v is not None]) for m in metrics if m in TIMED}
        exact[c] = {m: EXACT[m](ok) for m in metrics if m in EXACT}
    return timed, exact


def order(runs: Sequence[Any]) -> list[Any]:
    """Runs by commit (in the order each commit's first run started), then by start."""
    first: dict[str, Any] = {}
    for r in sorted(runs, key=lambda r: r.started_at):
        first.setdefault(r.commit, r.started_at)
    return sorted(runs, key=lambda r: (first[r.commit], r.started_at, r.screen_id))


def history(store, protocol: str, *, condition: str | None = None, metric: str | None = None,
            k: float = K) -> History:
    """A protocol's done screens in history order, their figures, steps and changes."""
    from packbench.core.errors import PackbenchError

    if metric is not None and metric not in METRICS:
        raise PackbenchError(f"--metric {show(metric)} is not one of {', '.join(METRICS)}")
    runs = order(store.history_runs(protocol))
    if not runs:
        shown = f" --protocol {protocol}" if len(protocol) <= 200 else ""  # no name or SHA-256 is longer
        raise PackbenchError(f"no done screen of protocol {show(protocol)}; list them with `packbench screens list"
                             f"{shown}`")
    # A name (or short prefix) shared by several frozen protocols (an edited file keeps its name)
    # would make one series of different measurements: every exact counter "CHANGED", a CI failure.
    shas = sorted({r.protocol_sha256 for r in runs})
    if len(shas) > 1:
        raise PackbenchError(f"{show(protocol)} matches {len(shas)} frozen protocols with done screens "
                             f"({', '.join(s[:12] for s in shas)}); give a longer SHA-256 prefix")
    metrics = (metric,) if metric else METRICS
    points = []
    for r in runs:
        timed, exact = screen_figures(store.episodes(r.attempt_id), metrics=metrics)
        points.append(ScreenFigures(r.screen_id, r.commit, r.started_at, r.name, timed, exact))
    conditions = sorted({c for p in points for c in p.timed})
    if condition is not None:
        if condition not in conditions:
            raise PackbenchError(f"--condition {show(condition)}: the protocol's conditions are {', '.join(conditions)}")
        conditions = [condition]
    series = [_series(points, c, m, k=k) for c in conditions for m in metrics]
    return History(protocol=runs[0].protocol, points=points, series=series, far=_far(points, series, k=k),
                   tiers=store.condition_tiers(shas).get(shas[0], {}))


def _series(points: list[ScreenFigures], c: str, m: str, *, k: float) -> Series:
    if m in TIMED:
        values = [p.timed.get(c, {}).get(m, {}).get("median") for p in points]
        known = [(i, v) for i, v in enumerate(values) if v is not None]
        found = [Step(known[s.index][0], s.before, s.value, s.change_pct, s.confirmed)
                 for s in steps([v for _, v in known], k=k)]
        return Series(c, m, values, steps=found)
    values = [p.exact.get(c, {}).get(m) for p in points]
    changes = [i for i in range(1, len(values)) if values[i] != values[i - 1]]
    return Series(c, m, values, changes=changes)


def _far(points: list[ScreenFigures], series: list[Series], *, k: float) -> dict[str, Any] | None:
    """The false-alarm rate on the commit with the most runs (at least MIN_BEFORE + 2: a
    baseline, a step and the run that confirms it), over every timed series, each shuffled on
    its own."""
    counts: dict[str, int] = {}
    for p in points:
        counts[p.commit] = counts.get(p.commit, 0) + 1
    commit, runs = max(counts.items(), key=lambda kv: kv[1], default=("", 0))
    if runs < MIN_BEFORE + 2:
        return None
    rates = []
    for s in series:
        if s.metric in TIMED:
            vals = [v for p, v in zip(points, s.values) if p.commit == commit and v is not None]
            if len(vals) >= MIN_BEFORE + 2:
                rates.append(false_alarm_rate(vals, k=k, shuffles=500))
    if not rates:
        return None
    return {"commit": commit, "runs": runs, "shuffles": 500, "rate": sum(rates) / len(rates),
            "series": len(rates)}


def compare_regressions(store, ref_a: int | str, ref_b: int | str, fail_above_pct: float) -> list[str]:
    """`compare A B --fail-above PCT`: B's timed figures slower than A's by more than PCT
    percent (per condition, median over scored ok episodes), and any exact counter that differs."""
    check_pct(fail_above_pct)
    sides = []
    for ref in (ref_a, ref_b):
        row = store.screen(ref)
        attempt = store.latest_attempt(row.id)
        if attempt is None:
            raise _no_attempt(row.id)
        sides.append((row.id, screen_figures(store.episodes(attempt.id), metrics=METRICS)))
    (ida, (ta, ea)), (idb, (tb, eb)) = sides
    out = []
    for c in sorted(set(ta) & set(tb)):
        for m in TIMED:
            a, b = ta[c][m]["median"], tb[c][m]["median"]
            if a and b is not None and 100.0 * (b - a) / a > fail_above_pct:
                out.append(f"{c} {m}: {100.0 * (b - a) / a:+.1f}% (screen {ida} {a:.4g}, screen {idb} {b:.4g})")
        for m in EXACT:
            if ea[c][m] != eb[c][m]:
                out.append(f"{c} {m}: screen {ida} {ea[c][m]}, screen {idb} {eb[c][m]}")
    return out


def check_pct(pct: Any) -> None:
    """A --fail-above percentage is a number >= 0: NaN compares False with everything, so a gate
    of NaN passed every step (the API reached this without the command line's check)."""
    from packbench.core.errors import PackbenchError

    if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not pct >= 0:
        raise PackbenchError(f"fail above {pct!r:.40}: give a percentage >= 0, e.g. 10")


def _no_attempt(screen_id: int):
    from packbench.core.errors import PackbenchError

    return PackbenchError(f"screen {screen_id} has no attempt yet; run it with `packbench dispatch`")


def as_json(h: History) -> dict[str, Any]:
    """The history as plain JSON-ready data."""
    return {"protocol": h.protocol, "method": {"k": K, "min_before": MIN_BEFORE, "window": WINDOW, "floor": FLOOR},
            "false_alarm": h.far, "tiers": h.tiers,
            "screens": [{"screen_id": p.screen_id, "commit": p.commit, "started_at": p.started_at.isoformat(),
                         "name": p.name, "timed": p.timed, "exact": p.exact} for p in h.points],
            "series": [{"condition": s.condition, "tier": h.tiers.get(s.condition), "metric": s.metric,
                        "values": s.values,
                        "steps": [{"screen_id": h.points[st.index].screen_id, "before": st.before, "value": st.value,
                                   "change_pct": st.change_pct, "confirmed": st.confirmed} for st in s.steps],
                        "changes": [h.points[i].screen_id for i in s.changes]} for s in h.series]}


def by_commit(h: History) -> list[dict[str, Any]]:
    """Rows of the history table: one per commit, each series' median (and min-max) over its screens."""
    rows: list[dict[str, Any]] = []
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(h.points):
        groups.setdefault(p.commit, []).append(i)
    for commit, idx in groups.items():
        row: dict[str, Any] = {"commit": commit[:10] or "?", "screens": ",".join(str(h.points[i].screen_id) for i in idx),
                               "first_run": h.points[idx[0]].started_at.isoformat(timespec="seconds")}
        for s in h.series:
            vals = [s.values[i] for i in idx if s.values[i] is not None]
            key = f"{s.condition}:{s.metric}"
            if s.metric in TIMED:
                sp = spread(vals)
                row[key] = (f"{sp['median']:.4g} [{sp['min']:.4g}-{sp['max']:.4g}]" if sp["n"] else None)
                if any(st.index in idx for st in s.steps):
                    row[key] += " STEP"
            else:
                distinct = sorted({str(v) for v in vals})
                row[key] = distinct[0] if len(distinct) == 1 else "CHANGED " + "|".join(distinct)
                if any(i in idx for i in s.changes) and len(distinct) == 1:
                    row[key] += " CHANGED"
        rows.append(row)
    return rows
