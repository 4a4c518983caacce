"""core/dispersion.py: the spread of a condition's episode walls and whether two screens'
difference is inside it (`packbench compare`)."""

import numpy as np
import pytest

from packbench.core.dispersion import compare_spread, noise, ratio_interval, spread


def test_spread_is_order_statistics():
    s = spread([0.5, 0.1, 0.2, 0.3, 0.4])
    assert (s["n"], s["median"], s["p10"], s["p90"]) == (5, 0.3, 0.1, 0.5)
    assert spread([1.0, 3.0])["median"] == 2.0
    assert spread([])["median"] is None


def test_a_ratio_inside_the_spread_is_noise_and_a_clear_one_is_not():
    a = [0.45, 0.19, 0.50, 0.21, 0.48]
    assert noise(a, [0.40, 0.22, 0.47, 0.30, 0.44]) == "within noise"
    assert noise(a, [0.009, 0.010, 0.008, 0.011, 0.009]) == "outside noise"
    assert noise(a, [0.3]) == "too few episodes" and ratio_interval(a, [0.3]) is None
    assert ratio_interval(a, a) == ratio_interval(a, a)  # seeded: the same on every run
    lo, hi = ratio_interval([1.0, 1.0], [2.0, 2.0])
    assert (lo, hi) == (2.0, 2.0)


def test_compare_spread_has_every_condition_of_either_screen():
    rows = compare_spread({"packet": [1.0, 1.0]}, {"packet": [1.0, 1.0], "dense-stream": [2.0, 2.0]})
    assert [r["condition"] for r in rows] == ["dense-stream", "packet"]
    assert rows[0]["a"]["n"] == 0 and rows[0]["noise"] == "too few episodes" and rows[0]["mean_ratio"] is None
    assert rows[1]["mean_ratio"] == 1.0 and rows[1]["noise"] == "within noise"


def test_a_host_busy_with_other_processes_is_flagged_from_the_records():
    from packbench.core.dispersion import noisy_host, other_cores

    busy = {"plan_index": 3, "episode_s": 0.5, "host_load": {"other_cpu_s": 0.6, "cores": 2}}
    quiet = {"plan_index": 4, "episode_s": 0.5, "host_load": {"other_cpu_s": 0.02, "cores": 2}}
    tiny = {"plan_index": 5, "episode_s": 0.008, "host_load": {"other_cpu_s": 0.01, "cores": 2}}  # one tick
    old = {"plan_index": 6, "wall_s": 0.5}  # archived before host_load was recorded
    assert other_cores(busy) == 1.2 and other_cores(tiny) is None and other_cores(old) is None
    assert noisy_host([busy, quiet, tiny, old]) == {"episodes": [3], "worst": 1.2, "threshold": 0.5}
    assert noisy_host([quiet, {"host_load": "hostile", "episode_s": 1.0}])["episodes"] == []



# ----------------------------------------------------------------------------- fixed values


def test_spread_at_ten_is_the_first_and_ninth_order_statistics():
    # nearest rank: p10 is the ceil(0.1 * 10) = 1st smallest, p90 the 9th (not the 2nd and 10th)
    s = spread([7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 4.0, 6.0])
    assert s == {"n": 10, "median": 5.5, "p10": 1.0, "p90": 9.0, "p90_over_p10": 9.0}
    # n = 11: the 2nd and 10th; n = 20: the 2nd and 18th; n = 1: the one value
    assert spread([float(x) for x in range(1, 12)]) == {"n": 11, "median": 6.0, "p10": 2.0, "p90": 10.0,
                                                         "p90_over_p10": 5.0}
    s = spread([float(x) for x in range(1, 21)])
    assert (s["p10"], s["p90"], s["median"]) == (2.0, 18.0, 10.5)
    assert spread([0.25]) == {"n": 1, "median": 0.25, "p10": 0.25, "p90": 0.25, "p90_over_p10": 1.0}
    assert spread([]) == {"n": 0, "median": None, "p10": None, "p90": None, "p90_over_p10": None}


def test_spread_ratio_needs_a_positive_p10_only():
    assert spread([0.5] * 9 + [2.0])["p90_over_p10"] == 1.0  # p10 under 1 s still gives a ratio
    assert spread([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 4.0])["p90_over_p10"] == 1.0
    assert spread([0.0, 1.0, 2.0])["p90_over_p10"] is None  # p10 of 0 s: no ratio


def _interval_by_hand(a, b, confidence, resamples, seed):
    """The documented method, written out: PCG64(seed) raw outputs mod n for a's resamples,
    then b's; the ratio of means of each; order statistics floor(alpha R) and ceil((1-alpha) R) - 1."""
    import math
    gen = np.random.PCG64(seed)
    ia = gen.random_raw(size=(resamples, len(a))) % np.uint64(len(a))
    ib = gen.random_raw(size=(resamples, len(b))) % np.uint64(len(b))
    ratios = sorted(float(np.mean([b[j] for j in rb]) / np.mean([a[j] for j in ra])) for ra, rb in zip(ia, ib))
    alpha = (1 - confidence) / 2
    return ratios[math.floor(alpha * resamples)], ratios[math.ceil((1 - alpha) * resamples) - 1]



# (0.95, 10): alpha R < 1, so hi is the largest resample and lo the smallest
@pytest.mark.parametrize("confidence, resamples, seed", [(0.95, 2000, 0), (0.5, 7, 3), (0.8, 10, 1), (0.95, 10, 0)])
def test_ratio_interval_is_the_documented_order_statistics(confidence, resamples, seed):
    a, b = [1.0, 1.4, 0.9, 1.2, 1.1], [2.1, 1.7, 2.4, 1.9]
    lo, hi = ratio_interval(a, b, confidence=confidence, resamples=resamples, seed=seed)
    want = _interval_by_hand(a, b, confidence, resamples, seed)
    assert (lo, hi) == pytest.approx(want, rel=1e-12) and lo < hi


def test_ratio_interval_defaults_and_pinned_values():
    a, b = [1.0, 1.4, 0.9, 1.2, 1.1], [2.1, 1.7, 2.4, 1.9]
    got = ratio_interval(a, b)
    assert got == pytest.approx(_interval_by_hand(a, b, 0.95, 2000, 0), rel=1e-12)
    assert got != ratio_interval(a, b, seed=1)
    assert ratio_interval([1, 2], [3, 4]) == ratio_interval([1.0, 2.0], [3.0, 4.0])  # integer seconds


def test_ratio_interval_refuses_a_resampled_zero_mean_and_too_few_episodes():
    assert ratio_interval([0.0, 1.0], [1.0, 1.0]) is None  # some resample of a is all zeros
    assert ratio_interval([0.5, 1.0], [0.0, 0.0]) == (0.0, 0.0)  # b may be 0
    assert ratio_interval([1.0], [1.0, 2.0]) is None and ratio_interval([1.0, 2.0], []) is None


def test_compare_spread_rows_in_full():
    a, b = [2.0, 2.4, 1.6, 2.0], [4.0, 4.8, 3.2, 4.0]  # means 2 and 4
    (row,) = compare_spread({"packet": a}, {"packet": b})
    lo, hi = ratio_interval(a, b)
    assert row == {"condition": "packet", "a": spread(a), "b": spread(b), "mean_ratio": 2.0,
                   "ratio_lo": lo, "ratio_hi": hi, "noise": "outside noise"}
    assert lo < 2.0 < hi and lo > 1.0
    (only_a,) = compare_spread({"packet": a}, {})
    assert only_a == {"condition": "packet", "a": spread(a), "b": spread([]), "mean_ratio": None,
                      "ratio_lo": None, "ratio_hi": None, "noise": "too few episodes"}


def test_other_cores_at_the_judged_bound_and_from_wall_s():
    from packbench.core.dispersion import MIN_JUDGED_S, noisy_host, other_cores

    assert other_cores({"episode_s": MIN_JUDGED_S, "host_load": {"other_cpu_s": 0.05}}) == 0.5
    assert other_cores({"wall_s": 2.0, "host_load": {"other_cpu_s": 1.0}}) == 0.5  # older records: wall_s
    assert other_cores({"episode_s": 1.0, "host_load": {"other_cpu_s": 0.0}}) == 0.0  # idle host: judged
    assert other_cores({"episode_s": 1.0, "host_load": {"other_cpu_s": -0.1}}) is None
    assert other_cores({"episode_s": 1.0, "host_load": 3}) is None
    at = {"plan_index": 7, "episode_s": 1.0, "host_load": {"other_cpu_s": 0.5}}
    unread = {"plan_index": 8, "wall_s": 1.0}
    # at the threshold counts as noisy; a record with no reading does not stop the scan
    assert noisy_host([unread, at]) == {"episodes": [7], "worst": 0.5, "threshold": 0.5}
    assert noisy_host([at], threshold=0.6)["episodes"] == []
