"""Episode totals recomputed from the per-call ledger, and the ledger's own shape checks."""

import copy

import pytest

from packbench.core.metrics import episode_totals, ledger_problems, stored_total_problems


def call(index, phase, *, rows=(3, 4), row_bytes=16, wall=0.25, extra=True):
    c = {"index": index, "phase": phase, "tokens": 8 if phase == "prefill" else 1, "layers": 2,
         "active_rows": list(rows), "rows_copied": list(rows), "h2d_weight_bytes": [r * row_bytes for r in rows],
         "h2d_index_bytes": [r * 8 for r in rows], "d2h_bytes": [r * 8 for r in rows],
         "logits_d2h_bytes": 2048, "wall_s": wall}
    if extra:
        c.update(rows_wasted=[1, 0], copy_wait_s=[0.001, 0.002])
    return c


def v01_totals(calls):
    """packbench 0.1's episode_totals, verbatim: its keys must keep their values."""
    totals = {"h2d_weight_bytes": 0, "h2d_index_bytes": 0, "d2h_bytes": 0, "call_s": 0.0,
              "phases": {ph: {"calls": 0, "h2d_bytes": 0, "call_s": 0.0} for ph in ("prefill", "decode")}}
    for c in calls:
        w, i = sum(c["h2d_weight_bytes"]), sum(c["h2d_index_bytes"])
        totals["h2d_weight_bytes"] += w
        totals["h2d_index_bytes"] += i
        totals["d2h_bytes"] += sum(c["d2h_bytes"])
        totals["call_s"] += c["wall_s"]
        phase = totals["phases"][c["phase"]]
        phase["calls"] += 1
        phase["h2d_bytes"] += w + i
        phase["call_s"] += c["wall_s"]
    return totals


LEDGER = [call(0, "prefill", rows=(30, 40), wall=0.1), call(1, "decode", wall=0.2), call(2, "decode", rows=(0, 1), wall=0.3)]


def test_totals_extend_the_v01_totals_without_changing_them():
    t = episode_totals(LEDGER)
    old = v01_totals(LEDGER)
    assert {k: t[k] for k in old if k != "phases"} == {k: v for k, v in old.items() if k != "phases"}
    for ph in ("prefill", "decode"):
        assert {k: t["phases"][ph][k] for k in old["phases"][ph]} == old["phases"][ph]
    assert t["h2d_weight_bytes"] == (70 + 7 + 1) * 16 and t["h2d_index_bytes"] == 78 * 8
    assert t["phases"]["decode"] == {"calls": 2, "h2d_bytes": 8 * 24, "call_s": 0.2 + 0.3}
    assert t["call_s"] == 0.1 + 0.2 + 0.3  # summed in call order, bit for bit
    assert (t["logits_d2h_bytes"], t["rows_copied"], t["rows_wasted"]) == (3 * 2048, 78, 3)
    assert t["copy_wait_s"] == sum([0.001, 0.002] * 3, 0.0)


def test_optional_ledger_lists_appear_only_when_recorded():
    t = episode_totals([call(0, "prefill", extra=False)])
    assert "rows_wasted" not in t and "copy_wait_s" not in t
    assert episode_totals([])["phases"]["prefill"] == {"calls": 0, "h2d_bytes": 0, "call_s": 0.0}


def test_stored_totals_are_compared_exactly_and_only_when_stored():
    t = episode_totals(LEDGER)
    record = copy.deepcopy(t)
    assert stored_total_problems(record, t) == []
    assert stored_total_problems({"h2d_weight_bytes": t["h2d_weight_bytes"]}, t) == []  # older records store fewer
    record["h2d_weight_bytes"] += 1
    record["call_s"] = float(record["call_s"]) + 1e-15
    record["phases"]["decode"]["h2d_bytes"] = 0
    record["phases"]["decode"]["wall_s"] = 9.0  # not derivable from the ledger: not compared
    problems = stored_total_problems(record, t)
    assert len(problems) == 3
    assert problems[0].startswith(f"stored h2d_weight_bytes {t['h2d_weight_bytes'] + 1} != {t['h2d_weight_bytes']}")
    assert any("stored phases.decode.h2d_bytes 0 != 192" in p for p in problems)
    assert stored_total_problems({**t, "rows_copied": float(t["rows_copied"])}, t) == [
        f"stored rows_copied {float(t['rows_copied'])!r} != {t['rows_copied']} recomputed from the call ledger"]
    assert stored_total_problems({"phases": []}, t) == ["stored phases [] is not a mapping"]


@pytest.mark.parametrize("damage, fragment", [
    (lambda c: c.update(phase="warm"), "phase 'warm' is not prefill or decode"),
    (lambda c: c.update(layers=0), "layers 0 is not an integer >= 1"),
    (lambda c: c.update(tokens="8"), "tokens '8' is not an integer >= 1"),
    (lambda c: c["h2d_weight_bytes"].append(1), "h2d_weight_bytes is not a list of 2 per-layer values"),
    (lambda c: c.update(d2h_bytes=None), "d2h_bytes is not a list"),
    (lambda c: c["rows_copied"].__setitem__(0, -1), "rows_copied holds a value that is not a count >= 0"),
    (lambda c: c["rows_copied"].__setitem__(0, True), "rows_copied holds a value"),
    (lambda c: c["h2d_index_bytes"].__setitem__(0, 1.5), "h2d_index_bytes holds a value"),
    (lambda c: c["copy_wait_s"].__setitem__(0, float("inf")), "copy_wait_s holds a value"),
    (lambda c: c.update(wall_s=-1.0), "wall_s -1.0 is not a finite time >= 0"),
    (lambda c: c.pop("logits_d2h_bytes"), "logits_d2h_bytes None is not an integer >= 0"),
])
def test_ledger_problems_name_the_call_and_field(damage, fragment):
    calls = copy.deepcopy(LEDGER)
    assert ledger_problems(calls) == []
    damage(calls[1])
    problems = ledger_problems(calls)
    assert problems and problems[0].startswith("call 1 ") and fragment in problems[0]


def test_ledger_problems_on_junk():
    assert ledger_problems(None) == ["calls is not a list"]
    assert ledger_problems(["x"]) == ["call 0 is not a mapping"]
    calls = copy.deepcopy(LEDGER)
    calls[0]["active_rows"] = [None, None]  # dense policies observe no activity: fine
    assert ledger_problems(calls) == []
