"""engine/ledger.py: the per-call, per-layer accounting every ledger in an archive comes from.
Pure host arithmetic: a call's counters start at zero (activity unobserved), `add` sums into the
current call's layer, nothing is charged outside a call or with recording off, and deferred
settlements run at the call's end, before the call is kept."""

import pytest

from packbench.engine.ledger import CallLedger, Recorder


def test_a_new_call_starts_at_zero_per_layer_with_activity_unobserved():
    c = CallLedger(index=3, phase="decode", tokens=1, layers=2)
    assert c.to_dict() == {"index": 3, "phase": "decode", "tokens": 1, "layers": 2, "active_rows": [None, None],
                           "rows_copied": [0, 0], "h2d_weight_bytes": [0, 0], "h2d_index_bytes": [0, 0],
                           "d2h_bytes": [0, 0], "rows_wasted": [0, 0], "copy_wait_s": [0.0, 0.0],
                           "logits_d2h_bytes": 0, "wall_s": 0.0}
    given = CallLedger(index=0, phase="prefill", tokens=4, layers=1, rows_copied=[5], active_rows=[7])
    assert given.rows_copied == [5] and given.active_rows == [7] and given.h2d_weight_bytes == [0]


def test_add_sums_each_counter_into_its_layer_and_sets_activity():
    r = Recorder(3)
    assert (r.phase, r.current, r.calls, r.serial) == (None, None, [], 0)  # no call in progress
    call = r.begin(phase="prefill", tokens=8)
    assert r.current is call and r.phase == "prefill" and call.index == 0 and call.tokens == 8
    r.add(1, active=5, rows=5, weight_bytes=100, index_bytes=40, d2h_bytes=3, wasted=1, wait_s=0.25)
    r.add(1, rows=2, weight_bytes=10, index_bytes=16, d2h_bytes=1, wasted=2, wait_s=0.5)
    r.add(2, active=0)
    assert call.active_rows == [None, 5, 0]  # the last observation, not a sum; 0 is observed
    assert (call.rows_copied, call.h2d_weight_bytes, call.h2d_index_bytes) == ([0, 7, 0], [0, 110, 0], [0, 56, 0])
    assert (call.d2h_bytes, call.rows_wasted, call.copy_wait_s) == ([0, 4, 0], [0, 3, 0], [0.0, 0.75, 0.0])
    r.add(1, active=9)
    assert call.active_rows[1] == 9 and call.rows_copied[1] == 7  # activity alone moves no bytes


def test_end_keeps_the_call_with_its_wall_and_logits_readback():
    r = Recorder(1)
    r.begin(phase="prefill", tokens=4)
    r.add(0, rows=1, weight_bytes=8)
    r.end(wall_s=0.5, logits_d2h_bytes=256)
    assert r.current is None and r.phase is None
    (call,) = r.calls
    assert (call.index, call.wall_s, call.logits_d2h_bytes, call.h2d_weight_bytes) == (0, 0.5, 256, [8])
    second = r.begin(phase="decode", tokens=1)
    assert second.index == 1 and r.phase == "decode" and r.serial == 2
    r.end(wall_s=0.1, logits_d2h_bytes=64)
    assert [c.phase for c in r.calls] == ["prefill", "decode"] and r.serial == 2
    with pytest.raises(AssertionError, match="^end\\(\\) without begin\\(\\)$"):
        r.end(wall_s=0.0, logits_d2h_bytes=0)


def test_nothing_is_charged_outside_a_call_or_with_recording_off():
    r = Recorder(1)
    r.add(0, rows=1, weight_bytes=8)  # between calls: dropped, no error
    off = Recorder(1, enabled=False)
    call = off.begin(phase="decode", tokens=1)
    off.add(0, active=3, rows=3, weight_bytes=24, index_bytes=24)
    settled = []
    off.defer(settled.append)
    off.end(wall_s=0.2, logits_d2h_bytes=4)
    assert call.to_dict() == CallLedger(index=0, phase="decode", tokens=1, layers=1, wall_s=0.2,
                                        logits_d2h_bytes=4).to_dict()
    assert settled == [] and off.calls == [call]  # calls are still timed and kept


def test_deferred_settlements_run_once_at_the_calls_end_before_it_is_kept():
    r = Recorder(2)
    r.defer(lambda c: pytest.fail("deferred outside a call"))  # nothing to settle: dropped
    r.begin(phase="decode", tokens=1)
    seen = []

    def settle(call):
        seen.append((call.wall_s, len(r.calls)))  # the wall is set; the call is not yet kept
        r.add(1, active=4, rows=4, weight_bytes=32)

    r.defer(settle)
    r.end(wall_s=0.3, logits_d2h_bytes=0)
    assert seen == [(0.3, 0)] and r.calls[0].active_rows == [None, 4] and r.calls[0].h2d_weight_bytes == [0, 32]
    r.begin(phase="decode", tokens=1)
    r.end(wall_s=0.1, logits_d2h_bytes=0)
    assert len(seen) == 1  # settled once, not again at the next call
    r.begin(phase="decode", tokens=1)
    r.defer(lambda c: seen.append("dropped"))
    r.begin(phase="decode", tokens=1)  # a new call drops what the abandoned one deferred
    r.end(wall_s=0.1, logits_d2h_bytes=0)
    assert len(seen) == 1
