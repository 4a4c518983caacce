"""core/workloads.py: real OPT's figures (the seed's byte counts, the papers' figures) and how
`packbench model stats` sets a checkpoint's summary beside them."""

import math

import pytest

from packbench.core.workloads import ANCHORS, TOLERANCE, compare


def anchor(key: str, shape: str):
    (a,) = [a for a in ANCHORS if a.key == key and a.shape == shape]
    return a


def test_every_anchor_is_its_sources_figure_recomputed_from_the_raw_counts():
    """Each figure recomputed here from the numbers its source prints (shared/seed's release notes:
    bytes and rows; GPTQ's perplexities), so a mistyped constant or a wrong row size (fp16 OPT-2.7B
    rows are 5120 B + an 8-byte index, fp32 OPT-1.3B rows 8192 B + 8) shows here."""
    fp16_27b, fp32_13b = 2560 * 2, 2048 * 4
    expect = {
        ("workload.decode_packet_over_dense", "opt-2.7b"): (0.033287 * fp16_27b / (fp16_27b + 8), 512, 16),
        ("workload.prefill_packet_over_dense", "opt-2.7b"): (0.689268 * fp16_27b / (fp16_27b + 8), 512, 16),
        # v0.40: 3 x 32-token prefixes, 16 calls each: dense moved 48 calls x 32 layers x 10240 rows
        ("workload.episode_packet_over_dense", "opt-2.7b"): ((3_825_246_984 / (fp16_27b + 8)) / (48 * 32 * 10240), 32, 16),
        # v0.33 / v0.35 (held out): 2 x 8 calls x 24 layers x 8192 rows of 8192 B; packets add 8 B a row
        ("workload.episode_packet_over_dense", "opt-1.3b"): ((1_635_580_200 / (fp32_13b + 8)) / (16 * 24 * 8192), 16, 8),
        # v0.38: early 5,850,946,000 B over demand-only 4,266,763,400 B (+37.1284 %), in 8,200-byte rows
        ("workload.forecast_extra_over_demand_decode_only", "opt-1.3b"):
            ((5_850_946_000 - 4_266_763_400) / 4_266_763_400, 32, 16),
        ("workload.forecast_wasted_over_used_decode_only", "opt-1.3b"): (193_193 / 188_336, 32, 16),
        ("next_token.entropy_nats", "opt-2.7b"): (math.log(12.47), 512, 16),
        ("next_token.entropy_nats", "opt-1.3b"): (math.log(14.62), 32, 16),
        ("hot.0.8", "opt-30b"): (0.26, 0, 0),
    }
    assert dense_rows_of_v040() == 80_530_636_800 // fp16_27b
    assert 16 * 24 * 8192 * fp32_13b == 25_769_803_776  # v0.33 / v0.35's dense bytes: OPT-1.3B fp32, 16 calls
    assert "held out" in anchor("workload.episode_packet_over_dense", "opt-1.3b").source
    assert (5_850_946_000 - 4_266_763_400) / (fp32_13b + 8) == 193_193  # the extra bytes are the wasted rows
    assert sorted((a.key, a.shape) for a in ANCHORS) == sorted(expect)
    for (key, shape), (value, prefix, calls) in expect.items():
        a = anchor(key, shape)
        assert a.value == pytest.approx(value, rel=1e-12), (key, shape)
        assert (a.prefix_tokens, a.calls) == (prefix, calls), (key, shape)
        assert a.source, (key, shape)


def dense_rows_of_v040() -> int:
    return 48 * 32 * 10240


def summary(*, prefix: int, decode_calls: int, **figures) -> dict:
    s = {"prefix_tokens": prefix, "decode_calls": decode_calls,
         "workload": {"decode_packet_over_dense": 0.0325, "prefill_packet_over_dense": 0.70,
                      "episode_packet_over_dense": 0.046, "forecast_extra_over_demand_decode_only": 0.35,
                      "forecast_wasted_over_used_decode_only": 1.1},
         "next_token": {"entropy_nats": 2.5}, "hot": {"0.8": 0.22}}
    for key, value in figures.items():
        head, _, rest = key.partition("__")
        s[head][rest] = value
    return s


def test_a_summary_is_compared_with_the_figures_of_its_own_workload_only():
    """Catches comparing across episode lengths: an OPT-1.3B summary of 32-token prompts with 4 calls an
    episode (`model stats --continuation 4`) was judged against v0.38's 16-call forecast counts (0.10
    against 0.371: "outside 20 %"), though 3 decode calls can forecast only 2 and an episode's extra
    over its demand grows with its length. Shape, prefix and calls per episode must all match; the
    hot-neuron share (an OPT-30B figure) is shape-free, given 256 prefix tokens."""
    rows = compare(summary(prefix=32, decode_calls=15), shape="opt-1.3b")
    assert [(r["key"], r["real_shape"], r["workload"]) for r in rows] == [
        ("workload.forecast_extra_over_demand_decode_only", "opt-1.3b", "32 + 16"),
        ("workload.forecast_wasted_over_used_decode_only", "opt-1.3b", "32 + 16"),
        ("next_token.entropy_nats", "opt-1.3b", "32 + 16")]
    extra = rows[0]
    real = anchor("workload.forecast_extra_over_demand_decode_only", "opt-1.3b").value
    assert extra["real"] == real and extra["measured"] == 0.35 and extra["ratio"] == pytest.approx(0.35 / real)
    assert extra["within"] is True and extra["label"] and extra["source"].startswith("seed v0.38")
    for other in (3, 14, 16):  # 4, 15 and 17 calls an episode: not v0.38's workload
        assert compare(summary(prefix=32, decode_calls=other), shape="opt-1.3b") == [], other
    assert compare(summary(prefix=31, decode_calls=15), shape="opt-1.3b") == []
    (v035,) = compare(summary(prefix=16, decode_calls=7), shape="opt-1.3b")  # the held-out 16 + 8 row
    assert (v035["key"], v035["workload"], v035["measured"]) == ("workload.episode_packet_over_dense", "16 + 8", 0.046)
    assert compare(summary(prefix=32, decode_calls=15), shape="opt-6.7b") == []  # no real figure there
    (v040,) = compare(summary(prefix=32, decode_calls=15), shape="opt-2.7b")  # 2.7b's 32 + 16: v0.40's row
    assert (v040["key"], v040["workload"]) == ("workload.episode_packet_over_dense", "32 + 16")
    assert compare(summary(prefix=32, decode_calls=7), shape="opt-2.7b") == []

    rows = compare(summary(prefix=512, decode_calls=15), shape="opt-2.7b")
    assert [r["key"] for r in rows] == ["workload.decode_packet_over_dense", "workload.prefill_packet_over_dense",
                                        "next_token.entropy_nats", "hot.0.8"]
    hot = rows[-1]
    assert (hot["real_shape"], hot["workload"], hot["real"], hot["measured"]) == ("opt-30b", "-", 0.26, 0.22)
    # the hot share with other episodes still (shape-free), the 512 + 16 figures not
    assert [r["key"] for r in compare(summary(prefix=512, decode_calls=7), shape="opt-2.7b")] == ["hot.0.8"]
    assert [r["key"] for r in compare(summary(prefix=256, decode_calls=7), shape=None)] == ["hot.0.8"]
    assert compare(summary(prefix=255, decode_calls=15), shape=None) == []


def test_within_is_the_stated_tolerance_at_its_edges():
    """`within` is |measured / real - 1| <= 20 %, both sides, at the edge included."""
    real = anchor("next_token.entropy_nats", "opt-1.3b").value
    for factor, ok in ((1 + TOLERANCE, True), (1 - TOLERANCE + 1e-9, True), (1 + TOLERANCE + 1e-6, False),
                       (1 - TOLERANCE - 1e-6, False)):
        (row,) = [r for r in compare(summary(prefix=32, decode_calls=15, next_token__entropy_nats=real * factor),
                                     shape="opt-1.3b") if r["key"] == "next_token.entropy_nats"]
        assert row["within"] is ok, factor
