"""core/dispersion.py: the spread of a condition's episode walls and whether two screens'
difference is inside it (`packbench compare`)."""

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

