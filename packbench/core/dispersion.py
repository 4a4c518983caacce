"""How spread out a condition's episode times are, and whether two screens' difference is
inside that spread (`packbench compare`, the comparison report). Pure: lists of seconds in,
numbers out.

A ratio of two screens' times means little without the spread of each: on a shared 2-core host
one screen's walls ran 24x another's for the same protocol. `ratio_interval` resamples each
screen's episodes independently (the screens are not paired: different runs, maybe different
machines) and gives a percentile interval of the ratio of means; when it holds 1 the difference
is within noise.
"""

from __future__ import annotations

import math

import numpy as np

MIN_EPISODES = 2  # fewer on either side: no spread to judge a difference by
RESAMPLES = 2000
CONFIDENCE = 0.95


def _rank(xs: list[float], q: float) -> float:
    """The q-quantile as an order statistic (nearest rank, no interpolation)."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def spread(values: list[float]) -> dict:
    """n, median, p10 and p90 (order statistics) and p90/p10 of some seconds; None where empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return {"n": 0, "median": None, "p10": None, "p90": None, "p90_over_p10": None}
    mid = len(xs) // 2
    median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    p10, p90 = _rank(xs, 0.10), _rank(xs, 0.90)
    return {"n": len(xs), "median": median, "p10": p10, "p90": p90,
            "p90_over_p10": p90 / p10 if p10 > 0 else None}


def ratio_interval(a: list[float], b: list[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple[float, float] | None:
    """Percentile interval of mean(b*)/mean(a*), a and b resampled independently (PCG64(seed)
    raw draws, like the runtime gate's bootstrap, so every machine prints the same); None when
    either side has fewer than MIN_EPISODES or a resampled mean of a is 0."""
    if len(a) < MIN_EPISODES or len(b) < MIN_EPISODES:
        return None
    gen = np.random.PCG64(seed)
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ia = (gen.random_raw(size=(resamples, len(xa))) % np.uint64(len(xa))).astype(np.intp)
    ib = (gen.random_raw(size=(resamples, len(xb))) % np.uint64(len(xb))).astype(np.intp)
    den = xa[ia].mean(axis=1)
    if not np.all(den > 0):
        return None
    ratios = np.sort(xb[ib].mean(axis=1) / den)
    alpha = (1 - confidence) / 2
    lo = ratios[min(max(math.floor(alpha * resamples), 0), resamples - 1)]
    hi = ratios[min(max(math.ceil((1 - alpha) * resamples) - 1, 0), resamples - 1)]
    return float(lo), float(hi)


def noise(a: list[float], b: list[float]) -> str:
    """`within noise` when the ratio's interval holds 1, `outside noise` when it does not,
    `too few episodes` when there is no interval."""
    interval = ratio_interval(a, b)
    if interval is None:
        return "too few episodes"
    return "within noise" if interval[0] <= 1 <= interval[1] else "outside noise"


def compare_spread(walls_a: dict[str, list[float]], walls_b: dict[str, list[float]]) -> list[dict]:
    """Per condition (sorted): each screen's spread of scored-episode walls, B/A of the means,
    the bootstrap interval of B/A (of means) and whether the difference is within noise."""
    out = []
    for condition in sorted(set(walls_a) | set(walls_b)):
        a, b = walls_a.get(condition, []), walls_b.get(condition, [])
        sa, sb = spread(a), spread(b)
        interval = ratio_interval(a, b)
        mean_a, mean_b = (math.fsum(a) / len(a) if a else None), (math.fsum(b) / len(b) if b else None)
        out.append({"condition": condition, "a": sa, "b": sb,
                    "mean_ratio": mean_b / mean_a if mean_a and mean_b is not None else None,
                    "ratio_lo": None if interval is None else interval[0],
                    "ratio_hi": None if interval is None else interval[1],
                    "noise": noise(a, b)})
    return out


# Other processes keeping half a core or more busy on average during an episode: its times are
# not this worker's alone (engine/host_load.py).
NOISY_CORES = 0.5
# /proc/stat counts in clock ticks (10 ms where CLK_TCK is 100): one tick in an 8 ms episode
# reads as 1.25 cores. Episodes shorter than this are not judged.
MIN_JUDGED_S = 0.1


def other_cores(record: dict) -> float | None:
    """Cores other processes kept busy on average during the episode (`host_load.other_cpu_s`
    over the worker's time for it); None where the record has no reading (older archives) or
    the episode is too short for the tick count to mean anything (MIN_JUDGED_S)."""
    load = record.get("host_load") if isinstance(record, dict) else None
    other = load.get("other_cpu_s") if isinstance(load, dict) else None
    seconds = record.get("episode_s") or record.get("wall_s")
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (other, seconds))
    return other / seconds if ok and seconds >= MIN_JUDGED_S and other >= 0 else None


def noisy_host(records, threshold: float = NOISY_CORES) -> dict:
    """{episodes: plan indices where other processes kept >= threshold cores busy, worst: the
    most cores any episode saw taken, threshold}."""
    episodes, worst = [], None
    for record in records:
        cores = other_cores(record)
        if cores is None:
            continue
        worst = cores if worst is None else max(worst, cores)
        if cores >= threshold:
            episodes.append(record.get("plan_index"))
    return {"episodes": episodes, "worst": worst, "threshold": threshold}
