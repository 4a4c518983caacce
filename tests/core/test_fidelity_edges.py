"""core/fidelity.py at its edges: batches (3-D logits, one token list per sequence), every
refusal with its words, the reference an approximate episode was forced on, the blocking of
long arrays, and figures pinned by hand."""

import math

import numpy as np
import pytest

from packbench.core.fidelity import (
    Fidelity,
    batch_divergence_step,
    fidelity,
    forced_reference,
    kl_per_position,
    log_softmax,
    nearest_rank,
    of_episode,
)


def test_log_softmax_rows_by_hand():
    x = np.array([[0.0, math.log(3.0)], [2.0, 2.0], [5.0, 5.0 + math.log(3.0)]])
    want = [[math.log(1 / 4), math.log(3 / 4)], [math.log(1 / 2)] * 2, [math.log(1 / 4), math.log(3 / 4)]]
    assert log_softmax(x) == pytest.approx(np.array(want), rel=1e-12)  # per row, shift-exact
    assert log_softmax(np.array([[7.0]]))[0, 0] == 0.0 and log_softmax(np.float32([[1, 2]])).dtype == np.float64


def test_kl_rows_are_independent_and_blocked_rows_match():
    ref = np.zeros((3, 2), np.float32)
    cond = np.array([[0.0, 0.0], [0.0, math.log(3.0)], [math.log(3.0), 0.0]], np.float32)
    kl = kl_per_position(ref, cond)
    three = math.exp(float(np.float32(math.log(3.0))))
    one = 0.5 * math.log(0.5 * (1 + three)) + 0.5 * math.log(0.5 * (1 + three) / three)
    assert kl.dtype == np.float64 and kl.tolist() == pytest.approx([0.0, one, one], rel=1e-12)
    # more rows than one block of 2**20 values holds (vocab 2**19: blocks of 2 rows): same per row
    big_ref, big_cond = np.zeros((5, 1 << 19), np.float32), np.zeros((5, 1 << 19), np.float32)
    big_cond[3, 0] = 1.0
    got = kl_per_position(big_ref, big_cond)
    assert got[:3].tolist() == [0.0, 0.0, 0.0] and got[4] == 0.0 and got[3] > 0


def test_kl_is_never_negative():
    ref = np.array([[0.1, 0.2, 0.3]], np.float32)
    assert kl_per_position(ref, ref.copy())[0] == 0.0  # rounding a hair below 0 is clipped


def test_nearest_rank_at_its_edges():
    assert nearest_rank(np.array([4.0, 1.0, 3.0, 2.0]), 0.5) == 2.0  # ceil(2) = the 2nd smallest
    assert nearest_rank(np.array([4.0, 1.0, 3.0, 2.0]), 0.51) == 3.0
    assert nearest_rank(np.array([4.0, 1.0, 3.0, 2.0]), 0.0) == 1.0  # at least the 1st
    assert nearest_rank(np.array([4.0, 1.0, 3.0, 2.0]), 1.0) == 4.0


def test_batch_divergence_is_the_first_sequence_to_leave_its_reference():
    assert batch_divergence_step([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) is None
    assert batch_divergence_step([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 8, 6]]) == 1
    assert batch_divergence_step([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == 1
    assert batch_divergence_step([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5]]) == 2  # a shorter sequence
    # batches that do not pair up diverge at once
    assert batch_divergence_step([[1, 2], [3, 4]], [[1, 2]]) == 0
    assert batch_divergence_step([[1, 2], [3, 4]], [1, 2]) == 0
    assert batch_divergence_step([1, 2], [[1, 2], [3, 4]]) == 0
    # one sequence: the plain comparison
    assert batch_divergence_step([1, 2, 3], [1, 2, 4]) == 2 and batch_divergence_step([], []) is None


def test_a_batch_counts_every_sequences_positions():
    ref = np.zeros((2, 3, 4), np.float32)
    cond = ref.copy()
    cond[1, 2, 3] = 0.5  # the last position of the second sequence: argmax moves, logit differs
    f = fidelity(ref, cond, reference_tokens=[[1, 1, 1], [2, 2, 2]], tokens=[[1, 1, 1], [2, 2, 2]])
    assert (f.positions, f.top1_agree, f.max_abs_logit, f.divergence_step) == (6, 5, 0.5, None)
    assert f.top1 == 5 / 6 and f.mean_kl == pytest.approx(kl_per_position(ref[1, 2:], cond[1, 2:])[0] / 6)
    assert f.p99_kl == kl_per_position(ref[1, 2:], cond[1, 2:])[0]
    assert f.as_dict() == {"positions": 6, "mean_kl": f.mean_kl, "p99_kl": f.p99_kl, "top1": 5 / 6, "top1_agree": 5,
                           "max_abs_logit": 0.5, "divergence_step": None}


def test_max_abs_logit_over_blocks_and_signs():
    ref = np.zeros((3, 1 << 19), np.float32)
    cond = ref.copy()
    cond[2, 7] = -2.5  # in the last block; negative: the absolute value counts
    cond[0, 1] = 1.5
    f = fidelity(ref, cond, reference_tokens=[1, 1, 1], tokens=[1, 1, 1])
    assert f.max_abs_logit == 2.5 and f.positions == 3 and f.top1_agree == 2  # row 0's argmax moved to 1


@pytest.mark.parametrize("ref, cond, words", [
    (np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32), "logits float32(2, 4) cannot be compared with "
                                                                  "the reference's float32(2, 3)"),
    (np.zeros(3, np.float32), np.zeros(3, np.float32), "logits float32(3,) cannot be compared"),
    (np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32), "logits float32(1, 1, 1, 1) cannot"),
    (np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32), "logits float32(2, 3) cannot be compared with the "
                                                                "reference's int32(2, 3)"),
    (np.zeros((2, 3), np.float32), np.zeros((2, 3), np.int32), "logits int32(2, 3) cannot be compared"),
    (np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32), "logits (0, 3) hold no position"),
    (np.zeros((2, 0), np.float32), np.zeros((2, 0), np.float32), "logits (2, 0) hold no position"),
    (np.zeros((2, 0, 3), np.float32), np.zeros((2, 0, 3), np.float32), "logits (0, 3) hold no position"),
    (np.zeros((2, 3), np.float32), np.array([[0, 0, np.inf]] * 2, np.float32), "non-finite logits"),
    (np.array([[np.nan, 0, 0]] * 2, np.float32), np.zeros((2, 3), np.float32), "non-finite logits"),
])
def test_every_refusal_says_why(ref, cond, words):
    with pytest.raises(ValueError, match=f"^{words.replace('(', '[(]').replace(')', '[)]')}"):
        fidelity(ref, cond, reference_tokens=[1, 1], tokens=[1, 1])
    with pytest.raises(ValueError):
        kl_per_position(ref, cond)


def episodes():
    ref = {"plan_index": 4, "condition": "dense", "prompt": 1, "status": "ok", "tokens": [3, 4],
           "logits": np.zeros((2, 3), np.float32)}
    mine = {"plan_index": 5, "condition": "q8", "prompt": 1, "status": "ok", "tokens": [3, 9], "forced_from": 4,
            "forced_logits": np.array([[0, 0, 1], [0, 0, 0]], np.float32)}
    return ref, mine


def test_of_episode_reads_the_reference_it_was_forced_on():
    ref, mine = episodes()
    f = of_episode(mine, {4: ref, 5: mine}, reference="dense")
    assert isinstance(f, Fidelity) and (f.positions, f.top1_agree, f.max_abs_logit, f.divergence_step) == (2, 1, 1.0, 1)
    assert forced_reference(mine, {4: ref}, reference="dense") is ref


@pytest.mark.parametrize("damage, words", [
    (lambda ref, mine: mine.update(status="failed"), "did not finish"),
    (lambda ref, mine: mine.pop("forced_from"), "was not teacher-forced (no forced_from)"),
    (lambda ref, mine: mine.update(forced_from=True), "was not teacher-forced (no forced_from)"),
    (lambda ref, mine: mine.update(forced_from="4"), "was not teacher-forced (no forced_from)"),
    (lambda ref, mine: mine.update(forced_from=7), "forced_from 7 is not a dense episode of prompt 1"),
    (lambda ref, mine: ref.update(condition="q8"), "forced_from 4 is not a dense episode of prompt 1"),
    (lambda ref, mine: ref.update(prompt=2), "forced_from 4 is not a dense episode of prompt 1"),
    (lambda ref, mine: ref.update(status="failed"), "reference episode 4 did not finish or has no logits"),
    (lambda ref, mine: ref.update(logits=None), "reference episode 4 did not finish or has no logits"),
    (lambda ref, mine: ref.update(tokens=None), "reference episode 4 did not finish or has no logits"),
    (lambda ref, mine: mine.update(forced_logits=None), "has no teacher-forced logits or tokens"),
    (lambda ref, mine: mine.update(tokens=(3, 9)), "has no teacher-forced logits or tokens"),
    (lambda ref, mine: mine.update(tokens=[[3, 9], 4]), "its tokens are not token ids (one list, or one list per "
                                                        "sequence)"),
    (lambda ref, mine: mine.update(tokens=[3, None]), "its tokens are not token ids"),
    (lambda ref, mine: mine.update(tokens=[3, True]), "its tokens are not token ids"),
    (lambda ref, mine: ref.update(tokens=[3, "4"]), "reference episode 4's tokens are not token ids"),
])
def test_of_episode_names_what_is_missing(damage, words):
    ref, mine = episodes()
    damage(ref, mine)
    with pytest.raises(ValueError, match=f"^{words.replace('(', '[(]').replace(')', '[)]')}"):
        of_episode(mine, {4: ref, 5: mine}, reference="dense")


def test_the_fidelity_gate_fails_closed_on_tokens_that_are_not_ids():
    """A gate never raises on a record (core/gates.py): a hostile archive's mixed token list was a
    TypeError out of the gate."""
    from packbench.core.gates import fidelity as gate
    from packbench.core.protocol import FidelityBounds

    ref, mine = episodes()
    ref.update(role="scored")
    mine.update(role="scored", tokens=[[3, 9], 4])
    v = gate([ref, mine], reference="dense", bounds=FidelityBounds("q8", max_mean_kl=1.0))
    assert not v["passed"] and "episode 5: its tokens are not token ids" in v["detail"]
    mine.update(tokens=[3, 9])
    assert gate([ref, mine], reference="dense", bounds=FidelityBounds("q8", max_mean_kl=1.0))["passed"]
    # numpy integers are ids too (what an in-process record may hold)
    mine.update(tokens=[np.int64(3), np.int64(9)])
    assert of_episode(mine, {4: ref}, reference="dense").divergence_step == 1


def test_a_reference_that_is_not_a_record_is_refused():
    _, mine = episodes()
    with pytest.raises(ValueError, match="forced_from 4 is not a dense episode"):
        forced_reference(mine, {4: "not a record"}, reference="dense")


def test_log_softmax_shifts_each_row_by_its_own_maximum():
    # one shift for the whole array would underflow the small row to exp(-1000) = 0 and log(0)
    out = log_softmax(np.array([[0.0, 0.0], [1000.0, 1000.0]]))
    assert out.tolist() == [[-math.log(2)] * 2, [-math.log(2)] * 2]


def test_a_vocabulary_of_one_is_comparable():
    f = fidelity(np.zeros((2, 1), np.float32), np.ones((2, 1), np.float32), reference_tokens=[0, 0], tokens=[0, 0])
    assert (f.positions, f.mean_kl, f.top1, f.max_abs_logit, f.divergence_step) == (2, 0.0, 1.0, 1.0, None)


def test_max_abs_logit_reaches_the_last_rows_of_a_long_narrow_array():
    # 3000 positions x 1000 tokens: blocks of 1048 rows; the difference is in the last row
    ref = np.zeros((3000, 1000), np.float32)
    cond = ref.copy()
    cond[2999, 5] = 0.75
    f = fidelity(ref, cond, reference_tokens=[1], tokens=[1])
    assert f.max_abs_logit == 0.75 and f.top1_agree == 2999


def test_of_episode_takes_a_batch():
    ref, mine = episodes()
    ref.update(tokens=[[3, 4], [3, 4]], logits=np.zeros((2, 2, 3), np.float32))
    mine.update(tokens=[[3, 4], [3, 9]], forced_logits=np.zeros((2, 2, 3), np.float32))
    f = of_episode(mine, {4: ref}, reference="dense")
    assert (f.positions, f.divergence_step, f.top1) == (4, 1, 1.0)
