"""core/serving.py: serving figures against hand-computed values, the position check, the
interference split by previous condition, and the median ratio beside the runtime gate."""

import statistics
from pathlib import Path

import numpy as np
import pytest

from packbench.core import serving
from packbench.core.gates import runtime
from packbench.core.report import read_screen

DATA = Path(__file__).resolve().parents[1] / "data"


def call(phase, wall, tokens=1):
    return {"phase": phase, "wall_s": wall, "tokens": tokens, "layers": 1, "active_rows": [None],
            "rows_copied": [0], "h2d_weight_bytes": [0], "h2d_index_bytes": [0], "d2h_bytes": [0],
            "logits_d2h_bytes": 0}


def episode(index, condition, *, walls=(0.05, 0.02, 0.01, 0.012, 0.011), wall=0.11, prompt=0, rep=0,
            role="scored", **extra):
    calls = [call("prefill", walls[0], tokens=32)] + [call("decode", w) for w in walls[1:]]
    return {"plan_index": index, "condition": condition, "role": role, "status": "ok", "prompt": prompt,
            "repetition": rep, "wall_s": wall, "episode_s": wall + 0.01, "calls": calls, **extra}


def test_serving_figures_of_one_episode_match_their_formulas_by_hand():
    f = serving.episode_serving(episode(0, "packet"))
    assert f["ttft_s"] == 0.05
    assert f["tpot_s"] == pytest.approx((0.11 - 0.05) / 4)
    # nearest rank over [0.010, 0.011, 0.012, 0.020]: p50 = 2nd, p90 = p99 = 4th
    assert (f["itl_p50_s"], f["itl_p90_s"], f["itl_p99_s"]) == (0.011, 0.02, 0.02)
    assert f["decode_tokens"] == 4 and f["decode_tokens_per_s"] == pytest.approx(4 / 0.06)
    assert f["steady_call_s"] == 0.011  # median of the decode calls after the first
    assert f["first_decode_excess_s"] == pytest.approx(0.009)
    assert f["call_s"] == pytest.approx(0.103) and f["outside_s"] == pytest.approx(0.007)
    assert f["outside_wall_s"] == pytest.approx(0.01)


def test_a_capture_in_the_first_decode_call_and_a_competitors_unshelve_are_apart():
    r = episode(0, "resident", engine={"decode_graph": "captured (31.5 ms, 2.0 of them instantiating)"})
    assert serving.episode_serving(r)["capture_s"] == pytest.approx(0.0315)
    q = episode(1, "int8", engine={"decode_graph": "compiled (torch.compile) and captured once in 900.0 ms, "
                                                    "replayed 40 times since"}, quantization={"unshelve_s": 0.04})
    f = serving.episode_serving(q)
    assert f["capture_s"] is None and f["unshelve_s"] == 0.04  # made outside the wall, said apart


def test_a_failed_or_ledgerless_episode_has_no_serving_figures():
    assert serving.episode_serving({**episode(0, "p"), "status": "failed"}) is None
    assert serving.episode_serving({**episode(0, "p"), "calls": []}) is None
    assert serving.episode_serving({**episode(0, "p"), "calls": [call("decode", "x")]}) is None


def test_serving_figures_of_recorded_episodes_agree_with_the_ledger_by_hand():
    """On a real archive's recorded episodes (tests/data/gates-v2.zip): TTFT is the prefill call's
    own wall, TPOT the rest of the wall over the decode calls, ITL p50 a decode call's wall."""
    screen = read_screen(DATA / "gates-v2.zip")
    checked = 0
    for e in screen.episodes:
        if not e.ok:
            continue
        r, f = e.record, serving.episode_serving(e.record)
        decode = [c["wall_s"] for c in r["calls"] if c["phase"] == "decode"]
        assert f["ttft_s"] == r["calls"][0]["wall_s"] == r["phases"]["prefill"]["call_s"]
        assert f["tpot_s"] == (r["wall_s"] - r["calls"][0]["wall_s"]) / len(decode)
        assert f["itl_p50_s"] == sorted(decode)[-(-len(decode) // 2) - 1]
        assert f["call_s"] == pytest.approx(r["call_s"], rel=1e-12)
        checked += 1
    assert checked >= 4


def test_outliers_beyond_three_iqr_by_hand():
    # inclusive quartiles of [1, 2, 3, 4, 100]: Q1 = 2, Q3 = 4, IQR 2, upper fence 10
    assert serving.quartiles([1, 2, 3, 4, 100]) == (2, 4)
    assert serving.outliers([1, 2, 3, 4, 100]) == [4]
    assert serving.outliers([1, 2, 3, 4, 10]) == []  # on the fence is not beyond it
    assert serving.outliers([3, 1, 2]) == []  # too few to judge
    assert serving.outlier_text(2) == "2 outliers beyond 3 IQR" and serving.outlier_text(0) == ""


def plan_records(n=39, slow=None, factor=10.0):
    """A 3-condition plan of n episodes, walls by condition with a little spread, one slow position."""
    base = {"dense-stream": 0.010, "packet": 0.008, "resident": 0.006}
    names = list(base)
    out = []
    for i in range(n):
        c = names[i % 3]
        w = base[c] * (1 + 0.03 * ((i * 7) % 5))
        out.append({"plan_index": i, "condition": c, "role": "scored", "status": "ok", "prompt": i // 3,
                    "repetition": 0, "wall_s": w * (factor if i == slow else 1)})
    return out


def test_a_planted_slow_position_is_flagged_and_a_clean_plan_is_not():
    clean = serving.position_check([plan_records()], prompts=13)
    assert clean["flagged"] == [] and clean["worst"] < 1.5
    slow = serving.position_check([plan_records(slow=38)], prompts=13)
    assert slow["flagged"] == [38]
    assert "38 (resident" in serving.position_text(slow)


def test_a_slow_block_shows_by_block_where_positions_hide_it():
    """Three slow positions side by side are each other's neighbours: the block median shows them."""
    records = plan_records()
    for r in records[15:18]:  # block 5
        r["wall_s"] *= 3
    check = serving.position_check([records], prompts=13)
    by_block = {b["block"]: b["relative"] for b in check["blocks"]}
    assert by_block[5] > 2.5 and all(v < 1.2 for b, v in by_block.items() if b != 5)


def test_the_position_check_takes_the_median_over_screens():
    """Over three screens a position slow in one of them only is not flagged; slow in all, it is."""
    once = serving.position_check([plan_records(slow=38), plan_records(), plan_records()], prompts=13)
    always = serving.position_check([plan_records(slow=38)] * 3, prompts=13)
    assert once["flagged"] == [] and always["flagged"] == [38]


def worker_screen(slow_after=None):
    """A screen where packet's steady decode call is 5 ms, 7.5 ms after `slow_after` first ran."""
    out, seen = [], False
    order = ["packet", "int8", "resident"] * 6
    for i, c in enumerate(order):
        seen = seen or c == slow_after
        step = 0.0075 if (seen and c == "packet" and slow_after) else 0.005
        walls = (0.02, step + 0.03, step, step * 1.01, step * 0.99)
        out.append(episode(i, c, walls=walls, wall=sum(walls) + 0.001, prompt=i // 3))
    return out


def test_a_planted_slowdown_that_persists_across_conditions_is_detected():
    hit = serving.persistent_slowdown(worker_screen("int8"), "packet", after="int8")
    assert hit["slowed"] and hit["ratio"] == pytest.approx(1.5)
    assert hit["before"] == pytest.approx(0.005) and hit["n_before"] == 1 and hit["n_since"] == 5
    clean = serving.persistent_slowdown(worker_screen(), "packet", after="int8")
    assert not clean["slowed"] and clean["ratio"] == pytest.approx(1.0)
    # and the split by what ran before shows where it comes from
    split = serving.by_previous(worker_screen("int8"), "packet")
    assert split[None]["median"] == pytest.approx(0.005) and split["resident"]["median"] == pytest.approx(0.0075)


def test_previous_conditions_read_the_record_before_the_plan():
    records = [{"plan_index": 0, "condition": "a", "previous": {"condition": "z", "plan_index": 9, "load": 1}},
               {"plan_index": 1, "condition": "b"}]
    assert serving.previous_conditions(records) == {0: "z", 1: "a"}


def reference_median_ratio(num, den, resamples, seed=0, confidence=0.95):
    """The interval by hand: one loop per resample, statistics.median, order statistics."""
    n = len(num)
    gen = np.random.PCG64(seed)
    ratios = []
    for _ in range(resamples):
        idx = [int(x) % n for x in gen.random_raw(size=n)]
        ratios.append(statistics.median([num[i] for i in idx]) / statistics.median([den[i] for i in idx]))
    ratios.sort()
    a = (1 - confidence) / 2
    import math
    return ratios[math.floor(a * resamples)], ratios[math.ceil((1 - a) * resamples) - 1]


def test_the_median_ratio_and_its_paired_interval_against_a_hand_computation():
    num = [1.0, 2.0, 3.0, 100.0]
    den = [1.0, 1.0, 1.0, 1.0]
    m = serving.median_ratio(num, den, resamples=400)
    assert m["value"] == 2.5  # median(1, 2, 3, 100) / median(1, 1, 1, 1), where summed walls say 26.5
    assert tuple(m["interval"]) == pytest.approx(reference_median_ratio(num, den, 400), rel=0, abs=0)
    same = serving.median_ratio([1.2, 2.4, 3.6], [1.0, 2.0, 3.0], resamples=100)
    assert same["value"] == pytest.approx(1.2) and same["interval"] == pytest.approx([1.2, 1.2])
    assert serving.median_ratio([1.0], [0.0]) is None and serving.median_ratio([], []) is None


def test_the_median_ratio_disagrees_with_the_summed_walls_because_of_an_outlier():
    """The slow position of issue 43: one packet episode 10x, the gate's summed walls FAIL while
    the medians say 1.0; the robust reading names the outlier."""
    records = plan_records(slow=37)  # a packet episode (37 % 3 == 1)
    for r in records:  # pair packet with dense-stream by prompt: same speed per pair
        r["wall_s"] = 0.010 * (10 if r["plan_index"] == 37 else 1) * (1 + 0.01 * (r["prompt"] % 3))
    gate = runtime(records, condition="packet", control="dense-stream", max_ratio=1.5, resamples=2000)
    assert not gate["passed"]
    row = serving.robust_runtime(records, condition="packet", control="dense-stream", gate=gate, resamples=2000)
    assert row["median"]["value"] == pytest.approx(1.0)
    assert row["disagree"] and row["outliers"] == [37] and "episode 37" in row["because"]
    assert "disagrees with the summed walls because of 1 outlier beyond 3 IQR" in serving.robust_text(row)
    clean = plan_records()
    for r in clean:
        r["wall_s"] = 0.010 * (1 + 0.01 * (r["prompt"] % 3))
    gate = runtime(clean, condition="packet", control="dense-stream", max_ratio=1.5, resamples=2000)
    row = serving.robust_runtime(clean, condition="packet", control="dense-stream", gate=gate, resamples=2000)
    assert not row["disagree"] and row["outliers"] == [] and row["because"] == ""


def test_a_slow_position_on_a_busy_host_is_said_apart_not_dropped():
    records = plan_records(slow=38)
    records[38].update(episode_s=0.2, host_load={"other_cpu_s": 0.3})  # 1.5 cores taken by others
    check = serving.position_check([records], prompts=13)
    assert check["flagged"] == [38] and check["on_busy_host"] == [38] and check["unexplained"] == []
    assert "1 of them ran while other processes kept half a core or more busy" in serving.position_text(check)
    quiet = serving.position_check([plan_records(slow=38)], prompts=13)
    assert quiet["on_busy_host"] == [] and quiet["unexplained"] == [38]


def test_readings_that_part_with_no_outlier_say_so():
    records = plan_records()
    for r in records:
        r["wall_s"] = 0.010 * (1 + 0.01 * (r["prompt"] % 3))
    gate = {"value": 3.0, "interval": [2.9, 3.1], "threshold": None}  # a summed-walls reading far from the medians'
    row = serving.robust_runtime(records, condition="packet", control="dense-stream", gate=gate, resamples=500)
    assert row["disagree"] and row["outliers"] == []
    assert serving.robust_text(row).endswith("disagrees with the summed walls though no episode lies beyond 3 IQR")


def test_outside_the_wall_of_separate_passes_leaves_the_recording_pass_out():
    """With `passes: separate` the worker's episode_s holds the recording pass, a second run of the
    episode: outside the wall is what lies outside both walls, not the recording pass itself
    (a 22 ms dense-stream episode showed 24 ms "outside the wall")."""
    r = episode(0, "packet", passes={"timing_wall_s": 0.11, "recording_wall_s": 0.12, "recording_call_s": []})
    r["episode_s"] = 0.11 + 0.12 + 0.01
    assert serving.episode_serving(r)["outside_wall_s"] == pytest.approx(0.01)


def test_outside_the_wall_of_an_approximate_episode_leaves_its_teacher_forced_pass_out():
    """An approximate condition's worker reruns the episode teacher-forced on the reference's tokens
    (`forced_s`, inside episode_s): outside the wall is not that second run either. Bug caught: a
    host-experts episode showed 22 ms "outside the wall" beside 2 ms for the exact conditions, its
    forced pass counted as activation and measurement."""
    r = episode(0, "packet")
    wall = r["wall_s"]
    r["episode_s"], r["forced_s"] = wall + 0.02 + 0.003, 0.02
    assert serving.episode_serving(r)["outside_wall_s"] == pytest.approx(0.003)
    both = episode(0, "packet", passes={"timing_wall_s": wall, "recording_wall_s": 0.12, "recording_call_s": []})
    both["episode_s"], both["forced_s"] = wall + 0.12 + 0.02 + 0.001, 0.02
    assert serving.episode_serving(both)["outside_wall_s"] == pytest.approx(0.001)
    del r["forced_s"]  # an exact condition's record has none: unchanged
    assert serving.episode_serving(r)["outside_wall_s"] == pytest.approx(0.023)
