"""The promise of docs/protocol.md's gates: ratios and bounds are compared exactly, a threshold
read as the decimal written. Each case here is one that float arithmetic gets wrong, in one
direction or the other, so a gate that compares in floats (`num <= max_ratio * den`,
`num / den <= max_ratio`, `value <= threshold`, `agree / n >= threshold`) fails a test."""

from fractions import Fraction

import numpy as np
import pytest

from packbench.core.gates import acquisition, fidelity, runtime, useful_latency
from packbench.core.protocol import FidelityBounds


def ep(i, cond, prompt=0, *, role="scored", h2d=100, wall=1.0, first_logit=10.0, **extra):
    return {"plan_index": i, "condition": cond, "role": role, "prompt": prompt, "status": "ok", "repetition": 0,
            "tokens": [5, 6], "h2d_weight_bytes": h2d, "h2d_index_bytes": 0, "wall_s": wall,
            "phases": {"prefill": {"h2d_bytes": h2d, "call_s": wall}, "decode": {"h2d_bytes": h2d, "call_s": wall}},
            "first_logit_since_entry_s": first_logit, **extra}


def acq(packet, dense, max_ratio):
    return acquisition([ep(0, "dense", h2d=dense), ep(1, "packet", h2d=packet)], condition="packet",
                       control="dense", max_ratio=max_ratio)


# ----------------------------------------------------------------------------- acquisition


def test_acquisition_57_of_100_passes_a_057_gate():
    # 0.57 * 100 is 56.99999999999999 in floats: `num <= max_ratio * den` fails this pair.
    v = acq(57, 100, 0.57)
    assert v["passed"] and v["value"] == 0.57 and v["detail"].startswith("57 B / 100 B")
    assert not acq(58, 100, 0.57)["passed"]


def test_acquisition_a_hair_over_the_ratio_fails_though_floats_round_it_onto_the_ratio():
    # (10**17 + 1) / 10**18 rounds to 0.1 in floats: `num / den <= max_ratio` passes it.
    v = acq(10 ** 17 + 1, 10 ** 18, 0.1)
    assert not v["passed"] and v["threshold"] == 0.1
    assert acq(10 ** 17, 10 ** 18, 0.1)["passed"]


def test_acquisition_exact_in_both_directions_over_many_pairs():
    # 7 pairs of 1 B over 10 B: 7 / 70 = 0.1 exactly (float sums would give the same; the point is
    # the per-phase path takes the same exact comparison)
    eps = []
    for p in range(7):
        eps += [ep(2 * p, "dense", p, h2d=10), ep(2 * p + 1, "packet", p, h2d=1)]
    for phase in ("all", "prefill", "decode"):
        v = acquisition(eps, condition="packet", control="dense", max_ratio=0.1, phase=phase)
        assert v["passed"] and v["phase"] == phase
    eps[1]["phases"]["decode"]["h2d_bytes"] = 2
    assert not acquisition(eps, condition="packet", control="dense", max_ratio=0.1, phase="decode")["passed"]
    assert acquisition(eps, condition="packet", control="dense", max_ratio=0.1, phase="prefill")["passed"]


# ----------------------------------------------------------------------------- useful latency


def latency(first_wall, cold, *, max_first, max_cold):
    eps = [ep(0, "packet", role="warmup", wall=first_wall, first_logit=cold), ep(1, "packet", wall=0.01,
                                                                               first_logit=cold + 1)]
    return useful_latency(eps, condition="packet", max_first_episode_s=max_first, max_cold_start_s=max_cold)


def test_useful_latency_compares_seconds_with_the_written_decimal_exactly():
    # A recorded 0.1 s is the binary 0.1000000000000000055...: over a bound written 0.1; floats
    # call the two equal and pass it.
    assert Fraction(0.1) > Fraction("0.1")
    v = latency(0.1, 1.0, max_first=0.1, max_cold=5.0)
    assert not v["passed"] and v["value"] == 0.1 and "0.1 s > 0.1 s" in v["detail"]
    v = latency(1.0, 0.1, max_first=5.0, max_cold=0.1)
    assert not v["passed"] and "cold start 0.1 s" in v["detail"] and v["detail"].endswith("> 0.1 s")
    # the binary 0.3 is under 0.3: both pass; so do exact equals
    assert latency(0.3, 0.3, max_first=0.3, max_cold=0.3)["passed"]
    assert latency(5.0, 10.0, max_first=5.0, max_cold=10.0)["passed"]
    assert not latency(5.000000000000001, 10.0, max_first=5.0, max_cold=10.0)["passed"]
    assert not latency(5.0, 10.000000000000002, max_first=5.0, max_cold=10.0)["passed"]


# ----------------------------------------------------------------------------- runtime


def test_runtime_upper_bound_against_the_written_decimal_exactly():
    # one pair: every resample is the same float ratio, so hi is it
    eps = [ep(0, "dense", wall=1.0), ep(1, "packet", wall=0.1)]
    v = runtime(eps, condition="packet", control="dense", max_ratio=0.1, resamples=100)
    assert v["interval"] == [0.1, 0.1] and not v["passed"]  # binary 0.1 > decimal 0.1
    eps[1]["wall_s"] = 0.3
    v = runtime(eps, condition="packet", control="dense", max_ratio=0.3, resamples=100)
    assert v["interval"] == [0.3, 0.3] and v["passed"]  # binary 0.3 < decimal 0.3


# ----------------------------------------------------------------------------- fidelity


def approx_screen(forced: np.ndarray, reference: np.ndarray | None = None, tokens=(5, 6)):
    """A reference episode (dense) and one teacher-forced approximate episode (q8)."""
    ref_logits = np.zeros_like(forced) if reference is None else reference
    return [{**ep(0, "dense"), "logits": ref_logits, "tokens": [5, 6]},
            {**ep(1, "q8"), "forced_logits": forced, "forced_from": 0, "tokens": list(tokens), "logits": None}]


def agreeing(k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(reference, forced) logits over n positions whose argmaxes agree at exactly k."""
    ref = np.tile(np.array([[1.0, 0.0]], np.float32), (n, 1))
    forced = ref.copy()
    forced[k:] = [[0.0, 1.0]]
    return ref, forced


def test_fidelity_top1_57_of_100_meets_057_and_5_of_6_misses_its_float():
    ref, forced = agreeing(57, 100)
    v = fidelity(approx_screen(forced, ref), reference="dense", bounds=FidelityBounds("q8", min_top1=0.57))
    assert v["passed"] and v["value"] == 0.57 and v["episodes"] == [0, 1]
    assert not fidelity(approx_screen(forced, ref), reference="dense",
                        bounds=FidelityBounds("q8", min_top1=0.58))["passed"]
    # 5/6 is below the decimal 0.8333333333333334 that 5/6 prints as; floats call them equal
    ref, forced = agreeing(5, 6)
    assert Fraction(5, 6) < Fraction("0.8333333333333334") and 5 / 6 == 0.8333333333333334
    v = fidelity(approx_screen(forced, ref), reference="dense",
                 bounds=FidelityBounds("q8", min_top1=0.8333333333333334))
    assert not v["passed"] and "outside: episode 1 top1" in v["detail"]
    assert fidelity(approx_screen(forced, ref), reference="dense",
                    bounds=FidelityBounds("q8", min_top1=0.8333333333333333))["passed"]


def test_fidelity_logit_bound_is_the_written_decimal():
    # float32 0.7 is 0.699999988079071044921875, which prints as 0.699999988079071: a bound
    # written so is under the measured difference, though floats call them equal.
    x = float(np.float32(0.7))
    assert repr(x) == "0.699999988079071" and Fraction(x) > Fraction(repr(x))
    forced = np.array([[x, 0.0]], np.float32)
    v = fidelity(approx_screen(forced), reference="dense", bounds=FidelityBounds("q8", max_abs_logit=x))
    assert not v["passed"] and v["value"] == x
    # float32 0.9 prints as 0.8999999761581421, above its binary value: it meets that bound
    y = float(np.float32(0.9))
    assert Fraction(y) < Fraction(repr(y))
    forced = np.array([[y, 0.0]], np.float32)
    assert fidelity(approx_screen(forced), reference="dense", bounds=FidelityBounds("q8", max_abs_logit=y))["passed"]


def _kl_case(want_over: bool) -> tuple[np.ndarray, float]:
    """One position whose KL, as a float, prints as a decimal below (want_over) or above its
    binary value: the gate's verdict at a bound written as that decimal is then fixed."""
    from packbench.core.fidelity import kl_per_position

    for step in range(1, 400):
        forced = np.array([[0.0, step / 400]], np.float32)
        kl = float(kl_per_position(np.zeros_like(forced), forced)[0])
        if kl > 0 and (Fraction(kl) > Fraction(repr(kl))) == want_over:
            return forced, kl
    raise AssertionError("no such case")


@pytest.mark.parametrize("bound", ["max_mean_kl", "max_p99_kl"])
def test_fidelity_kl_bounds_are_the_written_decimal(bound):
    forced, kl = _kl_case(want_over=True)
    v = fidelity(approx_screen(forced), reference="dense", bounds=FidelityBounds("q8", **{bound: kl}))
    assert not v["passed"] and v["value"] == kl
    forced, kl = _kl_case(want_over=False)
    assert fidelity(approx_screen(forced), reference="dense", bounds=FidelityBounds("q8", **{bound: kl}))["passed"]


def test_fidelity_divergence_step_bound_is_inclusive_and_never_diverging_meets_it():
    forced = np.zeros((2, 2), np.float32)
    at1 = approx_screen(forced, tokens=(5, 9))  # differs at call 1
    assert fidelity(at1, reference="dense", bounds=FidelityBounds("q8", min_divergence_step=1))["passed"]
    v = fidelity(at1, reference="dense", bounds=FidelityBounds("q8", min_divergence_step=2))
    assert not v["passed"] and v["value"] == 1.0
    v = fidelity(approx_screen(forced), reference="dense", bounds=FidelityBounds("q8", min_divergence_step=99))
    assert v["passed"] and v["value"] is None and "never" in v["detail"]
