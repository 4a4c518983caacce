"""Schema 5: competitor conditions (`quantized`, tier approximate) and the fidelity gate. A
protocol using either freezes as schema 5; every other freezes as it did, so old hashes hold."""

import numpy as np
import pytest

from packbench.core.errors import ProtocolError
from packbench.core.gates import compute_verdicts
from packbench.core.protocol import expand, freeze, validate
from tests.core.test_protocol_schema4 import TINY, protocol

INT8 = {"name": "int8", "policy": "quantized", "params": {"method": "int8-weight-only"}}


def competitor(**changes) -> dict:
    fields = {"conditions": [{"policy": "dense-stream"}, INT8],
              "gates": {"faithfulness": None, "fidelity": {"max_mean_kl": 0.002, "min_top1": 0.98}}, **changes}
    return protocol(TINY, **{"schema": 5, **fields})


def test_a_protocol_without_competitors_freezes_as_schema_4_froze_it():
    for raw in (protocol(TINY), protocol({**TINY, "sparsity": 0.9})):
        # schema 7, not the newest: 8 and 9 make the profile opt2, opt3
        assert freeze({**raw, "schema": 5}).body == freeze({**raw, "schema": 4}).body == freeze({**raw, "schema": 7}).body


def test_a_competitor_freezes_as_schema_5_with_its_tier_and_fidelity_entries():
    frozen = freeze(competitor())
    assert frozen.body["schema"] == 5
    assert frozen.body["conditions"][1] == INT8
    # The mapping form judges every approximate condition: frozen as one entry per condition.
    assert frozen.body["gates"]["fidelity"] == [{"condition": "int8", "max_mean_kl": 0.002, "min_top1": 0.98}]
    assert validate(frozen.body) == frozen.body  # a frozen body validates to itself
    p = expand(frozen.body)
    assert [p.tier(n) for n in p.condition_names] == ["exact", "approximate"]
    assert p.gates.fidelity[0].min_top1 == 0.98 and p.gates.fidelity[0].max_p99_kl is None
    listed = competitor(gates={"faithfulness": None, "fidelity": [{"condition": "int8", "min_top1": 0.98,
                                                                    "max_mean_kl": 0.002}]})
    assert freeze(listed).sha256 == frozen.sha256  # one meaning, one hash


@pytest.mark.parametrize("changes, fragment", [
    ({"schema": 4}, "`conditions[1].policy`: 'quantized' needs schema 5; write schema: 5 or omit `schema:`"),
    ({"conditions": [{"policy": "dense-stream"}, {"policy": "quantized"}]},
     "`conditions[1].params.method`: is required by policy quantized (one of int8-weight-only, int4-weight-only, "
     "nf4, llm-int8)"),
    ({"conditions": [{"policy": "dense-stream"}, {"policy": "quantized", "params": {"method": "int3"}}]},
     "`conditions[1].params.method`: 'int3' is not allowed; use one of int8-weight-only"),
    ({"gates": {"fidelity": {"condition": "dense-stream", "min_top1": 0.9}}},
     "`gates.fidelity.condition`: 'dense-stream' is the reference: fidelity compares another condition with it"),
    ({"conditions": [{"policy": "dense-stream"}, {"policy": "packet"}, INT8],
      "gates": {"fidelity": [{"condition": "packet", "min_top1": 0.9}]}},
     "`gates.fidelity[0].condition`: 'packet' is exact: the faithfulness gate judges it bit for bit"),
    ({"conditions": [{"policy": "dense-stream"}, {"policy": "packet"}], "gates": {"fidelity": {"min_top1": 0.9}}},
     "`gates.fidelity`: no approximate condition to judge; add a quantized condition or drop the gate"),
    ({"reference": "int8", "gates": {"fidelity": [{"condition": "int8", "min_top1": 0.9}]}},
     "`gates.fidelity[0].condition`: 'int8' is the reference"),
    ({"reference": "int8", "warmups": 1, "gates": {"runtime": {"control": "int8", "max_ratio": 2}, "fidelity": {"min_top1": 0.9}}},
     "`reference`: 'int8' is approximate: fidelity is judged against an exact reference"),
    ({"baseline_first": False}, "`gates.fidelity`: needs baseline_first: true"),
    ({"engine": {"mode": "graph"}}, "`conditions[1].policy`: 'quantized' runs in engine mode eager only"),
    ({"gates": {"fidelity": {"min_top1": 1.5}}}, "`gates.fidelity.min_top1`: 1.5 is not a fraction in [0, 1]"),
    ({"gates": {"fidelity": {"max_mean_kl": -1}}}, "`gates.fidelity.max_mean_kl`: -1 is not a finite number >= 0.0"),
    ({"gates": {"fidelity": {"min_divergence_step": 1.5}}}, "`gates.fidelity.min_divergence_step`"),
    ({"gates": {"fidelity": {}}}, "`gates.fidelity`: give at least one threshold: max_mean_kl, max_p99_kl, min_top1"),
    ({"gates": {"fidelity": [{"condition": "int8", "min_top1": 0.9}, {"condition": "int8", "min_top1": 0.8}]}},
     "`gates.fidelity[1]`: 'int8' is already gated; give one entry per condition"),
])
def test_refusals_name_the_field_and_the_fix(changes, fragment):
    with pytest.raises(ProtocolError) as e:
        validate(competitor(**changes))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_the_fidelity_gate_needs_schema_5():
    raw = protocol(TINY, schema=4, gates={"fidelity": {"min_top1": 0.9}})
    with pytest.raises(ProtocolError, match=r"`gates.fidelity`: needs schema 5"):
        validate(raw)


# ----------------------------------------------------------------------------- the gate

REF = np.array([[0.0, 0.0, 4.0], [4.0, 0.0, 0.0], [0.0, 4.0, 0.0]], dtype=np.float32)


def episodes(forced: np.ndarray, *, tokens=(2, 0, 1), ref_tokens=(2, 0, 1)) -> list[dict]:
    """A screen of prompt 0: reference warmup 0, int8 warmup 1 (never forced), reference 2, int8 3."""
    ok = {"status": "ok", "prompt": 0}
    return [
        {**ok, "plan_index": 0, "condition": "dense-stream", "role": "warmup", "tokens": list(ref_tokens), "logits": REF},
        {**ok, "plan_index": 1, "condition": "int8", "role": "warmup", "tokens": list(tokens), "logits": forced},
        {**ok, "plan_index": 2, "condition": "dense-stream", "role": "scored", "tokens": list(ref_tokens), "logits": REF},
        {**ok, "plan_index": 3, "condition": "int8", "role": "scored", "tokens": list(tokens), "logits": forced,
         "forced_logits": forced, "forced_from": 2},
    ]


def body(**bounds) -> dict:
    raw = competitor(gates={"faithfulness": None, "fidelity": bounds})
    raw["prompts"] = {"generator": {"seed": 0, "count": 1}}
    raw["continuation_tokens"] = 3
    return freeze(raw).body


def verdicts(b: dict, eps: list[dict]) -> dict:
    return {(v["gate"], v["condition"]): v for v in compute_verdicts(b, eps)}


def test_faithfulness_judges_exact_conditions_only_and_fidelity_the_approximate_ones():
    v = verdicts(body(max_abs_logit=0.0), episodes(REF.copy()))
    assert set(v) == {("faithfulness", "dense-stream"), ("fidelity", "int8")}
    assert v["fidelity", "int8"]["passed"] and v["fidelity", "int8"]["value"] == 0.0
    assert v["fidelity", "int8"]["episodes"] == [2, 3]  # the scored episode and its reference


def test_each_threshold_decides():
    # Row 2's argmax moves from 1 to 0; every other row is unchanged: top-1 = 2/3.
    forced = REF.copy()
    forced[2] = [4.5, 4.0, 0.0]
    eps = episodes(forced, tokens=(2, 0, 0))  # the free run's third token diverges: step 2
    assert verdicts(body(min_top1=0.66), eps)["fidelity", "int8"]["passed"]
    failed = verdicts(body(min_top1=0.67), eps)["fidelity", "int8"]
    assert not failed["passed"] and failed["value"] == pytest.approx(2 / 3) and "episode 3 top1" in failed["detail"]
    assert verdicts(body(min_divergence_step=2), eps)["fidelity", "int8"]["passed"]
    assert not verdicts(body(min_divergence_step=3), eps)["fidelity", "int8"]["passed"]
    assert verdicts(body(max_abs_logit=4.5), eps)["fidelity", "int8"]["passed"]
    assert not verdicts(body(max_abs_logit=4.49), eps)["fidelity", "int8"]["passed"]
    kl = verdicts(body(max_mean_kl=10.0, max_p99_kl=10.0), eps)["fidelity", "int8"]
    assert kl["passed"] and kl["threshold"] == 10.0 and "p99_kl worst" in kl["detail"]


def test_a_never_diverging_run_meets_every_divergence_bound():
    v = verdicts(body(min_divergence_step=3), episodes(REF.copy()))["fidelity", "int8"]
    assert v["passed"] and v["value"] is None and "divergence_step worst never (bound >= 3)" in v["detail"]


@pytest.mark.parametrize("damage, why", [
    (lambda eps: eps[3].pop("forced_logits"), "no teacher-forced logits"),
    (lambda eps: eps[3].pop("forced_from"), "was not teacher-forced"),
    (lambda eps: eps[3].update(forced_from=1), "forced_from 1 is not a dense-stream episode of prompt 0"),
    (lambda eps: eps[2].update(status="failed"), "reference episode 2 did not finish"),
    (lambda eps: eps[3].update(status="failed"), "did not finish"),
    (lambda eps: eps[3].update(forced_logits=np.zeros((2, 3), np.float32)), "cannot be compared"),
])
def test_the_fidelity_gate_fails_closed(damage, why):
    eps = episodes(REF.copy())
    damage(eps)
    v = verdicts(body(min_top1=0.0), eps)["fidelity", "int8"]
    assert not v["passed"] and v["value"] is None and why in v["detail"] and v["detail"].startswith("fail closed")


def test_the_shipped_int8_protocol_freezes_as_schema_5():
    from packbench.core.protocol import load
    from tests.core.test_protocol_schema3 import ROOT

    frozen = load(ROOT / "protocols" / "int8-fidelity.yaml")
    p = frozen.protocol
    assert frozen.body["schema"] == 5 and [p.tier(n) for n in p.condition_names] == ["exact", "exact", "approximate"]
    assert p.condition("packet").params == {"gather": "device"}  # schema 3's default, written out
    assert [b.condition for b in p.gates.fidelity] == ["int8"]


EXACT_AND_TWO_APPROXIMATE = [{"policy": "dense-stream"}, {"policy": "packet"}, INT8,
                             {"name": "nf4", "policy": "quantized", "params": {"method": "nf4"}}]


@pytest.mark.parametrize("conditions, fidelity, refusal", [
    (EXACT_AND_TWO_APPROXIMATE, {"condition": "dense-stream", "min_top1": 0.9},
     "`gates.fidelity.condition`: 'dense-stream' is the reference: fidelity compares another condition with it; "
     "name an approximate condition (int8, nf4)"),
    (EXACT_AND_TWO_APPROXIMATE[:2], {"condition": "dense-stream", "min_top1": 0.9},
     "`gates.fidelity.condition`: 'dense-stream' is the reference: fidelity compares another condition with it; "
     "name an approximate condition (none here)"),
    (EXACT_AND_TWO_APPROXIMATE, {"condition": "packet", "min_top1": 0.9},
     "`gates.fidelity.condition`: 'packet' is exact: the faithfulness gate judges it bit for bit; name an "
     "approximate condition (int8, nf4)"),
    (EXACT_AND_TWO_APPROXIMATE[:2], {"condition": "packet", "min_top1": 0.9},
     "`gates.fidelity.condition`: 'packet' is exact: the faithfulness gate judges it bit for bit; name an "
     "approximate condition (none here)"),
    (EXACT_AND_TWO_APPROXIMATE, {"condition": "nope", "min_top1": 0.9},
     "`gates.fidelity.condition`: 'nope' is not allowed; use one of dense-stream, packet, int8, nf4"),
    (EXACT_AND_TWO_APPROXIMATE, [], "`gates.fidelity`: expected a mapping or a non-empty list of mappings "
                                    "(one per condition)"),
    (EXACT_AND_TWO_APPROXIMATE, {"min_top1": 0.9, "foo": 1},
     "`gates.fidelity.foo`: unknown field; allowed fields are condition, max_abs_logit, max_mean_kl, max_p99_kl, "
     "min_divergence_step, min_top1"),
    (EXACT_AND_TWO_APPROXIMATE, {"min_divergence_step": 8193},
     "`gates.fidelity.min_divergence_step`: 8193 is not an integer in [0, 8192]"),
])
def test_fidelity_refusals_word_for_word(conditions, fidelity, refusal):
    """Each names the field, the value and what to write instead (the approximate conditions
    there are, or none). Catches a refusal losing its field, its words or its list."""
    with pytest.raises(ProtocolError) as e:
        validate(competitor(conditions=conditions, gates={"faithfulness": None, "fidelity": fidelity}))
    assert str(e.value) == f"protocol field {refusal}"


def test_fidelity_bounds_at_their_edges_are_accepted():
    """A top-1 agreement of exactly 1 and a divergence step of 0 or 8192 (MAX_CONTINUATION) are
    bounds a screen can be judged by."""
    for top1, step in ((1.0, 0), (0.0, 8192)):
        frozen = validate(competitor(gates={"faithfulness": None,
                                            "fidelity": {"min_top1": top1, "min_divergence_step": step}}))
        assert frozen["gates"]["fidelity"] == [{"condition": "int8", "min_top1": top1, "min_divergence_step": step}]
