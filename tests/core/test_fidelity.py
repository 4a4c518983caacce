"""Fidelity figures against numbers worked out by hand on small logit arrays."""

import math

import numpy as np
import pytest

from packbench.core.fidelity import divergence_step, fidelity, kl_per_position, log_softmax, nearest_rank

LN3 = float(np.float32(math.log(3)))  # what a float32 logit array holds


def arrays():
    # row 0: p = (1/2, 1/2) against q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3);
    #        argmaxes 0 (the first of a tie) and 1 disagree.
    # row 1: equal rows: KL 0, argmaxes agree. row 2: equal ties: KL 0, both argmax 0.
    ref = np.array([[0.0, 0.0], [LN3, 0.0], [0.0, 0.0]], dtype=np.float32)
    cond = np.array([[0.0, LN3], [LN3, 0.0], [0.0, 0.0]], dtype=np.float32)
    return ref, cond


def test_kl_per_position_by_hand():
    ref, cond = arrays()
    kl = kl_per_position(ref, cond)
    # q = (1/(1+3'), 3'/(1+3')) with 3' = exp(float32 ln 3): the float32 rounding of ln 3 is kept.
    three = math.exp(LN3)
    q0, q1 = 1 / (1 + three), three / (1 + three)
    assert kl[0] == pytest.approx(0.5 * math.log(0.5 / q0) + 0.5 * math.log(0.5 / q1), rel=1e-12)
    assert kl[0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert kl[1] == 0.0 and kl[2] == 0.0


def test_kl_is_not_symmetric_and_zero_probability_terms_vanish():
    ref = np.array([[-1e4, 0.0]], dtype=np.float32)  # p = (0, 1): exp underflows to exactly 0
    cond = np.array([[0.0, 0.0]], dtype=np.float32)  # q = (1/2, 1/2)
    assert kl_per_position(ref, cond)[0] == pytest.approx(math.log(2), rel=1e-12)  # 1 * ln(1 / (1/2))
    assert kl_per_position(cond, ref)[0] > 1e3  # the other direction sees the vanishing token


def test_episode_figures_by_hand():
    ref, cond = arrays()
    f = fidelity(ref, cond, reference_tokens=[5, 7, 9], tokens=[5, 7, 8])
    expected_kl0 = kl_per_position(ref, cond)[0]
    assert f.positions == 3
    assert f.mean_kl == pytest.approx(expected_kl0 / 3, rel=1e-12)
    assert f.p99_kl == expected_kl0  # nearest rank of 3: ceil(2.97) = the 3rd smallest, the largest
    assert (f.top1_agree, f.top1) == (2, 2 / 3)
    assert f.max_abs_logit == LN3  # |0 - float32(ln 3)|, exact in float64
    assert f.divergence_step == 2


def test_identical_logits_are_perfect():
    ref, _ = arrays()
    f = fidelity(ref, ref.copy(), reference_tokens=[1, 2, 3], tokens=[1, 2, 3])
    assert (f.mean_kl, f.p99_kl, f.top1, f.max_abs_logit, f.divergence_step) == (0.0, 0.0, 1.0, 0.0, None)


def test_nearest_rank_does_not_interpolate():
    values = np.arange(1, 201, dtype=np.float64)[::-1]  # 200 values, unsorted
    assert nearest_rank(values, 0.99) == 198.0  # ceil(198.0) = the 198th smallest
    assert nearest_rank(np.array([3.0]), 0.99) == 3.0
    assert nearest_rank(np.arange(1, 101, dtype=np.float64), 0.99) == 99.0


def test_divergence_step():
    assert divergence_step([1, 2, 3], [1, 2, 3]) is None
    assert divergence_step([1, 2, 3], [4, 2, 3]) == 0
    assert divergence_step([1, 2, 3], [1, 2]) == 2  # the shorter run ends there


def test_log_softmax_is_shift_exact():
    row = np.array([[1000.0, 1000.0]], dtype=np.float32)  # exp would overflow unshifted
    assert np.allclose(log_softmax(row), [[-math.log(2), -math.log(2)]])


@pytest.mark.parametrize("cond", [np.zeros((3, 3), np.float32), np.zeros((2, 2), np.float32),
                                  np.array([[np.nan, 0.0]] * 3, np.float32), np.zeros((3, 2), np.int64)])
def test_uncomparable_logits_raise(cond):
    ref, _ = arrays()
    with pytest.raises(ValueError):
        fidelity(ref, cond, reference_tokens=[0, 0, 0], tokens=[0, 0, 0])
