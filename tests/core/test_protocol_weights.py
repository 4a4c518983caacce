"""Schema 6: `weights` (dtype | int8) of dense-stream and packet. A condition giving it freezes as
schema 6; no protocol that leaves it out changes its frozen body or hash, and an int8 loader's
faithfulness is judged against the int8 dense-stream, which its verdict names."""

import numpy as np
import pytest
import yaml

from packbench.core.errors import ProtocolError
from packbench.core.gates import compute_verdicts
from packbench.core.plan import plan
from packbench.core.protocol import expand, freeze, load, validate
from packbench.core.registry import exact_reference, resolved_params, weights_of
from tests.core.test_protocol_schema3 import ROOT
from tests.core.test_protocol_schema4 import TINY, protocol

DENSE8 = {"name": "dense-int8", "policy": "dense-stream", "params": {"weights": "int8"}}
PACKET8 = {"name": "packet-int8", "policy": "packet", "params": {"weights": "int8"}}


def int8(**changes) -> dict:
    return protocol(TINY, **{"conditions": [{"policy": "dense-stream"}, {"policy": "packet"}, DENSE8, PACKET8],
                             **changes})


# (int8-fidelity pins schema 5: read as 6, its competitor's mode would be written out.)
@pytest.mark.parametrize("name", ["quickstart", "seed-v040", "seed-v042"])
def test_every_protocol_without_weights_freezes_as_schema_5_froze_it(name):
    """Read as schema 5 or as 6 (the newest, what a YAML without `schema:` means): one body."""
    source = ROOT / "protocols" / f"{name}.yaml"
    raw = yaml.safe_load(source.read_text())
    raw.pop("schema", None)
    newest = freeze(raw, source=source)
    assert freeze({**raw, "schema": 5}, source=source).body == newest.body
    assert newest.body["schema"] in (1, 2, 5)


def test_the_quickstart_keeps_its_published_hash():
    assert load(ROOT / "protocols" / "quickstart.yaml").sha256.startswith("a5e99a22")  # README's compare example


def test_weights_freeze_as_schema_6_and_say_what_runs():
    frozen = freeze(int8())
    assert frozen.body["schema"] == 6
    assert frozen.body["conditions"][2] == DENSE8
    assert frozen.body["conditions"][3] == {**PACKET8, "params": {"gather": "device", "weights": "int8"}}
    assert frozen.body["conditions"][0] == {"name": "dense-stream", "policy": "dense-stream", "params": {}}
    assert validate(frozen.body) == frozen.body
    p = expand(frozen.body)
    assert [p.tier(n) for n in p.condition_names] == ["exact"] * 4  # exact against the int8 dense-stream
    assert p.condition("packet").resolved_params == {"gather": "device"}  # unchanged: weights not said
    assert p.condition("packet-int8").resolved_params == {"gather": "device", "weights": "int8"}
    explicit = freeze(int8(conditions=[{"policy": "dense-stream", "params": {"weights": "dtype"}}, {"policy": "packet"}]))
    assert explicit.body["schema"] == 6  # said, even as the default: the body holds it


def test_the_exact_reference_of_each_condition():
    conditions = {"ref": ("dense-stream", {}), "pk": ("packet", {"gather": "host"}),
                  "d8": ("dense-stream", {"weights": "int8"}), "p8": ("packet", {"weights": "int8"}),
                  "q": ("quantized", {"method": "nf4"})}
    assert {n: exact_reference(conditions, "ref", n) for n in conditions} == {
        "ref": "ref", "pk": "ref", "d8": "d8", "p8": "d8", "q": "ref"}
    assert exact_reference({"ref": ("dense-stream", {}), "p8": ("packet", {"weights": "int8"})}, "ref", "p8") is None
    assert weights_of("resident", {}) == "dtype" and weights_of("packet", {"weights": "int8"}) == "int8"
    assert resolved_params("dense-stream", {}) == {}


@pytest.mark.parametrize("changes, fragment", [
    ({"schema": 5}, "`conditions[2].params.weights`: needs schema 6; write schema: 6 or omit `schema:`"),
    ({"conditions": [{"policy": "dense-stream"}, {**PACKET8, "params": {"weights": "int4"}}]},
     "`conditions[1].params.weights`: 'int4' is not allowed; use one of dtype, int8"),
    ({"conditions": [{"policy": "dense-stream"}, PACKET8]},
     "`conditions[1].params.weights`: int8 has no dense-stream with weights int8 to be judged against"),
    ({"warmups": {"dense-stream": 1, "packet": 1, "dense-int8": 0, "packet-int8": 1}},
     "`warmups.dense-int8`: 0 leaves 'dense-int8', the reference of weights int8, nothing to reproduce itself"),
])
def test_refusals_name_the_field_and_the_fix(changes, fragment):
    with pytest.raises(ProtocolError) as e:
        validate(int8(**changes))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_without_faithfulness_an_int8_condition_needs_no_int8_reference():
    raw = int8(conditions=[{"policy": "dense-stream"}, PACKET8],
               gates={"acquisition": {"control": "dense-stream", "max_ratio": 0.5}})
    assert freeze(raw).body["schema"] == 6


def test_int8_loaders_are_judged_against_the_int8_dense_stream_and_say_so():
    raw = int8()
    raw["prompts"] = {"generator": {"seed": 0, "count": 1}}
    raw["continuation_tokens"] = 2
    body = freeze(raw).body
    fp, q8 = np.array([[0.0, 1.0], [1.0, 0.0]], dtype=np.float32), np.array([[0.0, 1.5], [1.5, 0.0]], dtype=np.float32)
    logits = {"dense-stream": fp, "packet": fp, "dense-int8": q8, "packet-int8": q8}
    eps = [{"status": "ok", "plan_index": i, "condition": e["condition"], "role": e["role"], "prompt": e["prompt"],
            "tokens": [1, 0], "logits": logits[e["condition"]]} for i, e in enumerate(plan(body))]
    v = {x["condition"]: x for x in compute_verdicts(body, eps) if x["gate"] == "faithfulness"}
    assert all(x["passed"] for x in v.values()), v
    assert v["packet-int8"]["detail"].startswith("against 'dense-int8' (weights int8): ")
    assert v["dense-int8"]["detail"].startswith("against 'dense-int8' (weights int8): ")
    assert not v["packet"]["detail"].startswith("against")
    for e in eps:  # an int8 packet that matched the fp reference instead fails
        if e["condition"] == "packet-int8":
            e["logits"] = fp
    v = {x["condition"]: x for x in compute_verdicts(body, eps) if x["gate"] == "faithfulness"}
    assert not v["packet-int8"]["passed"] and v["packet"]["passed"]


@pytest.mark.parametrize("weights", ["int4", "fp16"])
def test_the_cli_refuses_an_unknown_weight_format_in_one_line_with_exit_2(tmp_path, weights):
    import os
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text((ROOT / "protocols" / "int8-packets.yaml").read_text().replace(
        "{name: packet-int8, policy: packet, params: {weights: int8}}",
        f"{{name: packet-int8, policy: packet, params: {{weights: {weights}}}}}"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate", str(path)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip() == (f"error: protocol field `conditions[3].params.weights`: {weights!r} is not allowed; "
                                f"use one of dtype, int8")


def test_an_unbounded_resident_freezes_as_schema_6_and_runs_on_the_cpu(tmp_path):
    """`resident {allowance: unbounded}`: the speed reference beside loaders held to the allowance
    (on CUDA the worker lifts the allocator's cap for its episodes; on the CPU nothing changes)."""
    from packbench.engine.worker import Worker
    from packbench.core.plan import prompts

    raw = protocol(TINY, conditions=[{"policy": "dense-stream"},
                                     {"name": "resident", "policy": "resident", "params": {"allowance": "unbounded"}}])
    frozen = freeze(raw)
    assert frozen.body["schema"] == 6 and frozen.body["conditions"][1]["params"] == {"allowance": "unbounded"}
    plain = freeze(protocol(TINY, conditions=[{"policy": "dense-stream"}, {"policy": "resident"}]))
    assert plain.body["schema"] in (1, 2, 5) and plain.body["conditions"][1]["params"] == {}
    with pytest.raises(ProtocolError, match="allowance"):
        freeze(protocol(TINY, conditions=[{"policy": "dense-stream"},
                                          {"policy": "resident", "params": {"allowance": True}}]))
    body = frozen.body
    worker = Worker(device="cpu")
    start = worker.load(body, None)
    ids = prompts(body, vocab=start["vocab"])
    records = [worker.run(e, ids[e["prompt"]]) for e in plan(body)]
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    verdicts = compute_verdicts(body, records)
    assert {v["condition"]: v["passed"] for v in verdicts if v["gate"] == "faithfulness"}["resident"]


def test_each_exact_condition_needs_its_own_reference_and_an_approximate_one_none():
    """Every exact condition is checked, also after an approximate one (which is judged by the
    fidelity gate, so needs no dense-stream of its weights); an int8 dense-stream is the reference
    of its weights and must reproduce itself even with no int8 loader beside it."""
    from tests.core.test_protocol_schema5 import INT8, competitor

    with pytest.raises(ProtocolError) as e:
        validate(competitor(schema=6, conditions=[{"policy": "dense-stream"}, INT8, PACKET8]))
    assert str(e.value) == ("protocol field `conditions[2].params.weights`: int8 has no dense-stream with weights int8 "
                            "to be judged against (faithfulness); add one, e.g. {policy: dense-stream, params: "
                            "{weights: int8}}")
    # an int8 reference: the quantized competitor has dtype weights and no dense-stream of them
    frozen = validate(competitor(schema=6, reference="dense-int8", conditions=[DENSE8, INT8]))
    assert [c["name"] for c in frozen["conditions"]] == ["dense-int8", "int8"]
    with pytest.raises(ProtocolError) as e:
        validate(int8(conditions=[{"policy": "dense-stream"}, DENSE8], warmups={"dense-stream": 1, "dense-int8": 0}))
    assert str(e.value) == ("protocol field `warmups.dense-int8`: 0 leaves 'dense-int8', the reference of weights int8, "
                            "nothing to reproduce itself against; declare >= 1 warmup or repetitions >= 2")
