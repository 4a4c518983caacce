"""Gates on hand-built records: pass, fail, boundary and missing data."""

import numpy as np
import pytest

from core.gates import acquisition, compute_verdicts, faithfulness


def ep(i, cond, role, prompt, *, logits=None, tokens=(5, 6), h2d=100, status="ok"):
    return {"plan_index": i, "condition": cond, "role": role, "prompt": prompt, "status": status,
            "tokens": list(tokens), "logits": np.ones((2, 4), np.float32) if logits is None else logits,
            "h2d_weight_bytes": h2d, "h2d_index_bytes": 0}


def screen(packet_logits=None, packet_tokens=(5, 6), packet_h2d=10):
    return [ep(0, "dense", "warmup", 0, h2d=100), ep(1, "packet", "warmup", 0, h2d=packet_h2d),
            ep(2, "dense", "scored", 0, h2d=100), ep(3, "packet", "scored", 0, logits=packet_logits,
                                                     tokens=packet_tokens, h2d=packet_h2d)]


def test_faithfulness_passes_on_identical_logits_and_covers_warmups():
    v = faithfulness(screen(), reference="dense", condition="packet")
    assert v["passed"] and v["value"] == 0.0 and v["episodes"] == [1, 2, 3]


def test_faithfulness_fails_on_one_ulp():
    logits = np.ones((2, 4), np.float32)
    logits[1, 2] = np.nextafter(np.float32(1), np.float32(2))
    v = faithfulness(screen(packet_logits=logits), reference="dense", condition="packet")
    assert not v["passed"] and v["value"] == pytest.approx(1.1920929e-07)
    assert faithfulness(screen(packet_logits=logits), reference="dense", condition="packet", tolerance=1e-6)["passed"]


def test_faithfulness_fails_on_tokens_even_with_equal_logits():
    v = faithfulness(screen(packet_tokens=(5, 7)), reference="dense", condition="packet")
    assert not v["passed"] and "tokens differ" in v["detail"]


def test_faithfulness_fails_closed():
    eps = screen()
    eps[3]["logits"] = None
    assert not faithfulness(eps, reference="dense", condition="packet")["passed"]
    nan = np.full((2, 4), np.nan, np.float32)
    assert not faithfulness(screen(packet_logits=nan), reference="dense", condition="packet")["passed"]
    assert not faithfulness([e for e in screen() if e["condition"] == "dense"], reference="dense", condition="packet")["passed"]
    eps = screen()
    eps[2]["status"] = "failed"
    assert not faithfulness(eps, reference="dense", condition="packet")["passed"]


def test_reference_must_reproduce_itself():
    assert faithfulness(screen(), reference="dense", condition="dense")["passed"]
    eps = screen()
    eps[0]["logits"] = np.zeros((2, 4), np.float32)
    assert not faithfulness(eps, reference="dense", condition="dense")["passed"]
    no_warmup = [e for e in screen() if e["role"] == "scored"]
    v = faithfulness(no_warmup, reference="dense", condition="dense")
    assert not v["passed"] and "no reference warmup" in v["detail"]


def test_acquisition_ratio_and_exact_boundary():
    assert acquisition(screen(packet_h2d=10), condition="packet", control="dense", max_ratio=0.1)["passed"]
    v = acquisition(screen(packet_h2d=11), condition="packet", control="dense", max_ratio=0.1)
    assert not v["passed"] and v["value"] == pytest.approx(0.11) and v["episodes"] == [2, 3]
    # 0.1 * 30 is 3.0000000000000004 in floats; 3 B out of 30 B must pass a 0.1 gate.
    eps = [ep(0, "dense", "scored", 0, h2d=30), ep(1, "packet", "scored", 0, h2d=3)]
    assert acquisition(eps, condition="packet", control="dense", max_ratio=0.1)["passed"]


def test_acquisition_fails_closed():
    eps = screen()
    eps[3]["status"] = "failed"
    assert not acquisition(eps, condition="packet", control="dense", max_ratio=1.0)["passed"]
    assert not acquisition([ep(0, "dense", "scored", 0, h2d=0), ep(1, "packet", "scored", 0, h2d=0)],
                           condition="packet", control="dense", max_ratio=1.0)["passed"]
    assert not acquisition([], condition="packet", control="dense", max_ratio=1.0)["passed"]


def test_compute_verdicts_follows_the_protocol():
    body = {"reference": "dense", "conditions": [{"name": "dense"}, {"name": "packet"}],
            "gates": {"faithfulness": {"tolerance": 0.0}, "acquisition": {"control": "dense", "max_ratio": 0.5}}}
    vs = compute_verdicts(body, screen())
    assert [(v["gate"], v["condition"]) for v in vs] == [("acquisition", "packet"), ("faithfulness", "dense"),
                                                         ("faithfulness", "packet")]
    assert all(v["passed"] for v in vs)
