"""Serving figures, position checks and robust ratios of a screen's episodes: pure Python over
archived records (no numpy but the bootstrap's bit generator, no SQLAlchemy, no Ray).

Three readings beside the frozen gates (`core/gates.py` is never changed by them):

- **Serving figures**, named as serving benchmarks name them (vLLM's benchmark scripts,
  optimum-benchmark, MLPerf Inference) and defined with their formulas in docs/metrics.md:
  TTFT, TPOT, inter-token latency percentiles over decode calls, decode tokens/s, the episode
  wall and what lies outside its forward calls; the steady-state decode call (every decode call
  but the first) apart from what happens once per episode (a graph capture in the first decode
  call, a competitor's unshelve before the wall).
- **A position check**: each episode's wall over its condition's median, by plan position and
  by block, and every position more than `POSITION_FACTOR` x its neighbours' median flagged.
  A slow plan position (a collection, a flush, a sampler) shows here before it moves a verdict.
- **Robust ratios**: the ratio of medians with a paired bootstrap interval, beside the runtime
  gate's ratio of summed walls, and whether the two disagree because of outliers (Tukey's far
  fences: beyond 3 IQR of the quartiles, hyperfine's warning).

`bench.engine`, the report (`core/report.py`), `packbench results` / `compare` and the Python
API all read these functions, so they agree on the same episodes.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

import numpy as np

# A plan position slower than this many times its neighbours' median is flagged.
POSITION_FACTOR = 2.0
NEIGHBOURS = 2  # plan positions each side a position is compared with
OUTLIER_IQR = 3.0  # Tukey's far-out fences, hyperfine's "outliers" warning
PERCENTILES = (50, 90, 99)
# The captured decode step of a CpuFirstModel in mode graph (engine/graph.py DecodeStep.describe):
# the capture ran inside this episode's first decode call.
_CAPTURED = re.compile(r"^captured \(([0-9.]+) ms")


def _time(v: Any) -> float | None:
    """A finite number >= 0 as float, else None (an archive is read without trusting its types)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return float(v) if ok else None


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 < q <= 100) as an order statistic (nearest rank, no interpolation:
    every value reported is one that was measured); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def median(values: Iterable[float]) -> float | None:
    xs = list(values)
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------- outliers


def quartiles(values: Iterable[float]) -> tuple[float, float] | None:
    """Q1 and Q3 by linear interpolation between order statistics (numpy's default, R type 7);
    None for fewer than 2 values."""
    xs = sorted(values)
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def outliers(values: Iterable[float], *, k: float = OUTLIER_IQR) -> list[int]:
    """Positions (in the given order) of the values beyond k IQR of the quartiles:
    x < Q1 - k IQR or x > Q3 + k IQR. [] for fewer than 4 values (no quartiles to speak of)."""
    xs = list(values)
    if len(xs) < 4:
        return []
    q1, q3 = quartiles(xs)  # type: ignore[misc]
    iqr = q3 - q1
    lo, hi = q1 - k * iqr, q3 + k * iqr
    return [i for i, x in enumerate(xs) if x < lo or x > hi]


def outlier_text(n: int) -> str:
    """The flag printed beside a time or ratio: '' for none."""
    return "" if not n else f"{n} outlier{'s' if n != 1 else ''} beyond {OUTLIER_IQR:g} IQR"


# ----------------------------------------------------------------------------- serving figures


def capture_in_episode_s(record: Mapping) -> float | None:
    """Seconds of the decode graph captured inside this episode's first decode call (a
    CpuFirstModel in mode graph), or None when none was (eager; a competitor's step, captured
    once per model and again on unshelve, outside the wall)."""
    engine = record.get("engine")
    text = engine.get("decode_graph") if isinstance(engine, Mapping) else None
    m = _CAPTURED.match(text) if isinstance(text, str) else None
    return float(m.group(1)) / 1e3 if m else None


def unshelve_s(record: Mapping) -> float | None:
    """Seconds a shelved competitor took to move back and make its graphs again before the
    episode (outside its wall), or None."""
    q = record.get("quantization")
    return _time(q.get("unshelve_s")) if isinstance(q, Mapping) else None


def episode_serving(record: Mapping) -> dict | None:
    """One finished episode's serving figures (docs/metrics.md), from its call ledger and wall;
    None when the record has no usable ledger (a failed episode, a broken archive).

    ttft_s: the prefill call, from its start to the first logit on the host.
    itl_s: every decode call, from its start to its logit on the host (one token per sequence).
    tpot_s: (wall_s - ttft_s) / decode calls: per output token after the first, host work between
        calls included. decode_tokens_per_s: decode tokens (every sequence's) over the same span.
    steady_call_s: the median decode call but the first (which may hold a capture);
    first_decode_excess_s: the first decode call over that median (a once-per-episode cost).
    outside_s: wall_s - the forward calls' seconds (argmax, the next ids, the recorder).
    outside_wall_s: episode_s - wall_s (the policy's activation and the record's measurements);
        less the second runs of the episode inside episode_s: with separate passes the recording
        pass's wall, for an approximate condition its teacher-forced pass (`forced_s`).
    """
    calls = record.get("calls")
    wall = _time(record.get("wall_s"))
    if record.get("status") != "ok" or not isinstance(calls, list) or not calls or wall is None:
        return None
    prefill, decode, decode_tokens = [], [], 0
    for c in calls:
        w = _time(c.get("wall_s")) if isinstance(c, Mapping) else None
        if w is None or c.get("phase") not in ("prefill", "decode"):
            return None
        if c["phase"] == "prefill":
            prefill.append(w)
        else:
            decode.append(w)
            tokens = c.get("tokens")
            decode_tokens += tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 1
    if len(prefill) != 1:
        return None
    ttft = prefill[0]
    call_s = math.fsum(prefill + decode)
    after_first = wall - ttft
    steady = median(decode[1:]) if len(decode) > 1 else None
    episode_s = _time(record.get("episode_s"))
    passes = record.get("passes")
    recording = _time(passes.get("recording_wall_s")) if isinstance(passes, Mapping) else None
    if episode_s is not None and recording is not None:  # schema 7's recording pass ran inside episode_s
        episode_s -= recording
    forced = _time(record.get("forced_s"))
    if episode_s is not None and forced is not None:  # an approximate condition's teacher-forced rerun, too
        episode_s -= forced
    return {
        "ttft_s": ttft,
        "tpot_s": after_first / len(decode) if decode else None,
        "itl_s": decode,
        **{f"itl_p{p}_s": nearest_rank(decode, p) for p in PERCENTILES},
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / after_first if decode and after_first > 0 else None,
        "steady_call_s": steady,
        "first_decode_excess_s": decode[0] - steady if steady is not None else None,
        "capture_s": capture_in_episode_s(record),
        "unshelve_s": unshelve_s(record),
        "wall_s": wall,
        "call_s": call_s,
        "outside_s": wall - call_s,
        "outside_wall_s": episode_s - wall if episode_s is not None and episode_s >= wall else None,
    }


def condition_serving(records: Iterable[Mapping]) -> dict:
    """One condition's serving figures over its finished episodes (pass the scored ones):
    medians of the per-episode figures (decode tokens/s included: the median episode's rate,
    so one slow episode moves it no more than it moves TPOT), inter-token percentiles over
    every decode call pooled, and the outliers of the walls, the TTFTs and the TPOTs (Tukey's
    far fences)."""
    figs = [(r, f) for r in records if (f := episode_serving(r)) is not None]
    itl = [x for _, f in figs for x in f["itl_s"]]

    def med(key: str) -> float | None:
        return median(f[key] for _, f in figs if f[key] is not None)

    def flagged(key: str) -> list[int]:
        rows = [(r.get("plan_index"), f[key]) for r, f in figs if f[key] is not None]
        return [rows[i][0] for i in outliers([v for _, v in rows])]

    return {
        "episodes": len(figs),
        "ttft_s": med("ttft_s"),
        "tpot_s": med("tpot_s"),
        **{f"itl_p{p}_s": nearest_rank(itl, p) for p in PERCENTILES},
        "decode_tokens_per_s": med("decode_tokens_per_s"),
        "steady_call_s": med("steady_call_s"),
        "first_decode_excess_s": med("first_decode_excess_s"),
        "capture_s": med("capture_s"),
        "unshelve_s": med("unshelve_s"),
        "wall_s": med("wall_s"),
        "outside_s": med("outside_s"),
        "outside_wall_s": med("outside_wall_s"),
        "outliers": {"wall_s": flagged("wall_s"), "ttft_s": flagged("ttft_s"), "tpot_s": flagged("tpot_s")},
    }


def scored_ok(records: Iterable[Mapping], condition: str) -> list[Mapping]:
    """A condition's finished scored episodes, in plan order."""
    rows = [r for r in records if r.get("condition") == condition and r.get("role") == "scored"
            and r.get("status") == "ok"]
    return sorted(rows, key=lambda r: r.get("plan_index", 0))


def screen_serving(records: list[Mapping], conditions: Iterable[str]) -> dict[str, dict]:
    """condition -> condition_serving of its finished scored episodes."""
    return {c: condition_serving(scored_ok(records, c)) for c in conditions}


# ----------------------------------------------------------------------------- what ran before


def previous_conditions(records: Iterable[Mapping]) -> dict[int, str | None]:
    """plan index -> the condition that ran in the worker just before it: the record's own
    `previous` (what the worker says it ran last, across screens too) where it has one, else
    the previous plan entry's (older archives; None for the first)."""
    rows = sorted((r for r in records if isinstance(r.get("plan_index"), int)), key=lambda r: r["plan_index"])
    out, last = {}, None
    for r in rows:
        prev = r.get("previous")
        out[r["plan_index"]] = prev.get("condition") if isinstance(prev, Mapping) else last
        last = r.get("condition")
    return out


def by_previous(records: list[Mapping], condition: str, *, key: str = "steady_call_s") -> dict[str | None, dict]:
    """A condition's serving figure `key` split by what ran in the worker before each of its
    scored episodes: {previous condition: {n, median, episodes}}. A steady-state figure that
    moves with what ran before is interference, not the condition's own speed."""
    prev = previous_conditions(records)
    out: dict[str | None, dict] = {}
    for r in scored_ok(records, condition):
        f = episode_serving(r)
        if f is None or f[key] is None:
            continue
        row = out.setdefault(prev.get(r["plan_index"]), {"values": [], "episodes": []})
        row["values"].append(f[key])
        row["episodes"].append(r["plan_index"])
    return {p: {"n": len(v["values"]), "median": median(v["values"]), "episodes": v["episodes"]}
            for p, v in out.items()}


def persistent_slowdown(records: list[Mapping], condition: str, *, after: str, key: str = "steady_call_s",
                        factor: float = 1.05) -> dict:
    """Whether `condition`'s steady-state figure is slower in every episode that ran after
    `after` had first run in the worker than in every one before it (a slowdown that persists
    across conditions: state a library left behind). {before, since, ratio, slowed}: medians of
    `key` before and since `after`'s first episode, their ratio, and slowed = ratio > factor and
    the two groups do not overlap."""
    first = min((r["plan_index"] for r in records if r.get("condition") == after
                 and isinstance(r.get("plan_index"), int)), default=None)
    before, since = [], []
    for r in scored_ok(records, condition):
        f = episode_serving(r)
        if f is None or f[key] is None:
            continue
        (since if first is not None and r["plan_index"] > first else before).append(f[key])
    mb, ms = median(before), median(since)
    ratio = ms / mb if mb and ms is not None else None
    slowed = bool(ratio is not None and ratio > factor and min(since) > max(before))
    return {"before": mb, "since": ms, "ratio": ratio, "slowed": slowed, "n_before": len(before),
            "n_since": len(since)}


# ----------------------------------------------------------------------------- position check


def _block(r: Mapping, prompts: int | None) -> Any:
    """A scored episode's block (core/plan.py: repetition * prompts + prompt); a warmup's 'warmup'."""
    if r.get("role") != "scored":
        return "warmup"
    rep, prompt = r.get("repetition") or 0, r.get("prompt")
    return rep * prompts + prompt if prompts and isinstance(prompt, int) else (rep, prompt)


def position_check(screens: list[list[Mapping]], *, prompts: int | None = None, factor: float = POSITION_FACTOR,
                   neighbours: int = NEIGHBOURS, include_warmups: bool = False) -> dict:
    """Whether an episode's time depends on where it sits in the plan.

    Each finished episode's wall over the median wall of its condition in its screen (so
    conditions of different speeds compare); per plan position the median of that relative time
    over `screens` (one or more screens of one protocol); a position is flagged when it exceeds
    `factor` x the median of its `neighbours` positions each side. Per block, the median relative
    time. Warmups are left out unless asked (a first use is slower by design).

    Returns {positions: [{index, condition, relative, wall_s, neighbours, flagged}], flagged:
    [plan indices], blocks: [{block, relative, n}], worst: the largest relative over neighbours}.
    """
    from packbench.core.dispersion import NOISY_CORES, other_cores

    rel: dict[int, list[float]] = {}
    walls: dict[int, list[float]] = {}
    cores: dict[int, list[float]] = {}
    cond_of: dict[int, str] = {}
    block_of: dict[int, Any] = {}
    for records in screens:
        mine = [r for r in records if r.get("status") == "ok" and _time(r.get("wall_s")) is not None
                and isinstance(r.get("plan_index"), int) and (include_warmups or r.get("role") == "scored")]
        by_cond: dict[str, list[float]] = {}
        for r in mine:
            by_cond.setdefault(r.get("condition"), []).append(float(r["wall_s"]))
        meds = {c: statistics.median(v) for c, v in by_cond.items()}
        for r in mine:
            m = meds[r.get("condition")]
            if m > 0:
                i = r["plan_index"]
                rel.setdefault(i, []).append(float(r["wall_s"]) / m)
                walls.setdefault(i, []).append(float(r["wall_s"]))
                taken = other_cores(dict(r))
                if taken is not None:
                    cores.setdefault(i, []).append(taken)
                cond_of[i], block_of[i] = r.get("condition"), _block(r, prompts)
    order = sorted(rel)
    point = {i: statistics.median(rel[i]) for i in order}
    rows, flagged, worst = [], [], None
    for n, i in enumerate(order):
        near = [point[j] for j in order[max(0, n - neighbours):n] + order[n + 1:n + 1 + neighbours]]
        ref = statistics.median(near) if near else None
        over = point[i] / ref if ref else None
        if over is not None:
            worst = over if worst is None else max(worst, over)
        bad = over is not None and over > factor
        if bad:
            flagged.append(i)
        busy = statistics.median(cores[i]) if i in cores else None
        rows.append({"index": i, "condition": cond_of[i], "relative": point[i], "wall_s": statistics.median(walls[i]),
                     "neighbours": ref, "over_neighbours": over, "flagged": bad, "other_cores": busy})
    blocks: dict[Any, list[float]] = {}
    for i in order:
        blocks.setdefault(block_of[i], []).extend(rel[i])
    block_rows = [{"block": b, "relative": statistics.median(v), "n": len(v)} for b, v in blocks.items()]
    # A flagged position during which other processes kept NOISY_CORES or more busy (host_load) is
    # the host's, not the plan's: said apart, never dropped.
    on_busy_host = [r["index"] for r in rows if r["flagged"] and r["other_cores"] is not None
                    and r["other_cores"] >= NOISY_CORES]
    return {"positions": rows, "flagged": flagged, "blocks": block_rows, "worst": worst, "factor": factor,
            "screens": len(screens), "on_busy_host": on_busy_host,
            "unexplained": [i for i in flagged if i not in on_busy_host]}


def position_text(check: dict) -> str:
    """One line: the flagged positions, or that none is."""
    if not check["positions"]:
        return "position check: no finished scored episodes"
    worst = "" if check["worst"] is None else f" (worst {check['worst']:.2f}x its neighbours)"
    if not check["flagged"]:
        return f"position check: no plan position above {check['factor']:g}x its neighbours' median{worst}"
    rows = {r["index"]: r for r in check["positions"]}
    names = ", ".join(f"{i} ({rows[i]['condition']}, {rows[i]['over_neighbours']:.1f}x)" for i in check["flagged"][:6])
    more = f" and {len(check['flagged']) - 6} more" if len(check["flagged"]) > 6 else ""
    busy = check.get("on_busy_host") or []
    host = (f"; {len(busy)} of them ran while other processes kept half a core or more busy (host_load)"
            if busy else "")
    return (f"position check: {len(check['flagged'])} plan position(s) above {check['factor']:g}x their "
            f"neighbours' median: {names}{more}{host}")


# ----------------------------------------------------------------------------- robust ratios


def _order_stat_bounds(ratios: np.ndarray, confidence: float) -> tuple[float, float]:
    """The runtime gate's percentile bounds (core.gates.bootstrap_ratio): order statistics,
    lo = sorted[floor(a R)], hi = sorted[ceil((1 - a) R) - 1], a = (1 - confidence) / 2."""
    r = len(ratios)
    ratios = np.sort(ratios)
    alpha = (1 - Fraction(str(confidence))) / 2
    lo = min(max(math.floor(alpha * r), 0), r - 1)
    hi = min(max(math.ceil((1 - alpha) * r) - 1, 0), r - 1)
    return float(ratios[lo]), float(ratios[hi])


def median_ratio(num: list[float], den: list[float], *, confidence: float = 0.95, resamples: int = 10000,
                 seed: int = 0) -> dict | None:
    """median(num) / median(den) of paired times, with a paired bootstrap interval: pairs drawn
    with replacement (PCG64(seed) raw outputs modulo n, the runtime gate's stream, so every
    machine prints the same), the ratio of medians of each resample, order-statistic bounds.
    None for no pairs or a zero median of `den`."""
    n = len(num)
    if n == 0 or n != len(den) or statistics.median(den) <= 0:
        return None
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    gen = np.random.PCG64(seed)
    ratios = np.empty(int(resamples), dtype=np.float64)
    step = max(1, (1 << 18) // n)
    for row in range(0, int(resamples), step):
        k = min(step, int(resamples) - row)
        idx = (gen.random_raw(size=(k, n)) % np.uint64(n)).astype(np.intp)
        d = np.median(b[idx], axis=1)
        ratios[row:row + k] = np.where(d > 0, np.median(a[idx], axis=1) / np.where(d > 0, d, 1.0), np.inf)
    lo, hi = _order_stat_bounds(ratios, confidence)
    return {"value": float(statistics.median(num) / statistics.median(den)), "interval": [lo, hi], "pairs": n,
            "confidence": confidence, "resamples": int(resamples), "seed": seed}


def robust_runtime(records: list[Mapping], *, condition: str, control: str, gate: Mapping | None = None,
                   confidence: float = 0.95, resamples: int = 10000, seed: int = 0) -> dict | None:
    """Beside the runtime gate's verdict (`gate`: ratio of summed walls, bootstrap bound), the
    ratio of median walls over the same pairs (core.gates pairing by repetition and prompt) with
    its paired interval, the outliers of each side, and whether the two readings disagree.

    disagree: the two points lie outside each other's intervals, or (with a threshold) one
    reading's upper bound passes it and the other's does not. `because` names the outliers when
    there are any ("because of 1 outlier beyond 3 IQR: episode 38"). None when there are no
    pairs (the gate fails closed and says why)."""
    from packbench.core.gates import paired_episodes, seconds_of  # the gate's own pairing, read-only

    pairs, bad, _ = paired_episodes(list(records), condition, control)
    values = [(seconds_of(a, "all"), seconds_of(b, "all"), a, b) for a, b in pairs]
    values = [v for v in values if v[0] is not None and v[1] is not None]
    if not values:
        return None
    num, den = [v[0] for v in values], [v[1] for v in values]
    med = median_ratio(num, den, confidence=confidence, resamples=resamples, seed=seed)
    if med is None:
        return None
    out_num = [values[i][2].get("plan_index") for i in outliers(num)]
    out_den = [values[i][3].get("plan_index") for i in outliers(den)]
    flagged = sorted(i for i in out_num + out_den if i is not None)
    gate_value = gate.get("value") if gate else None
    gate_interval = gate.get("interval") if gate else None
    threshold = gate.get("threshold") if gate else None
    disagree = False
    if gate_value is not None and gate_interval:
        lo, hi = med["interval"]
        apart = not (lo <= gate_value <= hi) and not (gate_interval[0] <= med["value"] <= gate_interval[1])
        decided = threshold is not None and (gate_interval[1] <= threshold) != (hi <= threshold)
        disagree = apart or decided
    because = ""
    if disagree:
        because = (f"because of {outlier_text(len(flagged))}: episode{'s' if len(flagged) > 1 else ''} "
                   f"{', '.join(map(str, flagged))}" if flagged else "though no episode lies beyond 3 IQR")
    return {"condition": condition, "control": control, "median": med, "gate_value": gate_value,
            "gate_interval": gate_interval, "threshold": threshold, "outliers": flagged,
            "outliers_text": outlier_text(len(flagged)), "disagree": disagree, "because": because}


def robust_text(row: Mapping) -> str:
    """`median ratio 1.18 [1.02, 1.25]` plus the outlier flag and, when the readings disagree, why."""
    m = row["median"]
    text = f"median ratio {m['value']:.4g} [{m['interval'][0]:.4g}, {m['interval'][1]:.4g}]"
    if row["outliers_text"]:
        text += f"; {row['outliers_text']}"
    if row["disagree"]:
        text += f"; disagrees with the summed walls {row['because']}"
    return text
