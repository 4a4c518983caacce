"""`batch` (schema 6): the sequences an episode decodes together. A protocol without it, or with
batch 1, freezes to the body and hash it always had; a batch above 1 freezes as schema 6 and
plans consecutive prompts; a bad value is one line naming the field, exit 2 through the CLI."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from packbench.core.errors import ProtocolError
from packbench.core.plan import batch_prompts, episode_input, plan
from packbench.core.protocol import expand, freeze, validate
from tests.core.test_protocol_schema4 import TINY, protocol

ROOT = Path(__file__).resolve().parents[2]


def test_without_batch_or_at_batch_1_a_protocol_freezes_as_it_always_did():
    raw = protocol(TINY)
    before = freeze(raw)
    assert "batch" not in before.body and before.body["schema"] == 2
    assert freeze({**raw, "batch": 1}).body == before.body  # batch 1 is left out: one meaning, one hash
    assert freeze({**raw, "batch": 1}).sha256 == before.sha256
    assert expand(before.body).batch == 1
    assert all("prompts" not in e for e in plan(before.body))


def test_a_batch_freezes_as_schema_6_and_validates_to_itself():
    frozen = freeze(protocol(TINY, batch=2))
    assert frozen.body["schema"] == 6 and frozen.body["batch"] == 2
    assert validate(frozen.body) == frozen.body and expand(frozen.body).batch == 2
    assert frozen.sha256 != freeze(protocol(TINY)).sha256
    # the quickstart freezes as schema 1 (packbench 0.1's body), which cannot say a batch
    quick = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    assert freeze(quick).body["schema"] == 1
    assert freeze({**quick, "schema": 6, "batch": 3}).body["schema"] == 6


def test_a_batch_keeps_the_higher_schema_a_later_kind_needs():
    """A batch says schema 6 at least, not at most: a screen of a schema-7 kind (zero-inference) at
    batch 2 must freeze as 7 and validate to itself (a freeze that lowered it to 6 refused its own
    body: "'zero-inference' needs schema 7")."""
    conditions = [{"policy": "dense-stream"}, {"policy": "zero-inference"}]
    frozen = freeze(protocol(TINY, batch=2, conditions=conditions))
    assert frozen.body["schema"] == 7 and frozen.body["batch"] == 2
    assert validate(frozen.body) == frozen.body and expand(frozen.body).batch == 2
    assert freeze(protocol(TINY, conditions=conditions)).body["schema"] == 7  # the kind alone, at batch 1


def test_the_plan_decodes_consecutive_prompts_wrapping_round():
    body = freeze(protocol(TINY, batch=2)).body  # quickstart: 3 prompts, 1 warmup each
    entries = plan(body)
    assert [e["prompts"] for e in entries if e["role"] == "scored"][::2] == [[0, 1], [1, 2], [2, 0]]
    assert [e["prompts"] for e in entries if e["role"] == "warmup"] == [[0, 1], [0, 1]]
    assert [{k: v for k, v in e.items() if k != "prompts"} for e in entries] == plan(freeze(protocol(TINY)).body)
    assert batch_prompts(3, batch=4, count=5) == [3, 4, 0, 1]
    ids = [[10], [11], [12]]
    assert episode_input(ids, entries[0]) == [[10], [11]] and episode_input(ids, {"prompt": 2}) == [12]


def test_competitors_at_a_batch_run_eager_unless_asked():
    conditions = [{"policy": "dense-stream"}, {"name": "q", "policy": "quantized",
                                               "params": {"method": "int8-weight-only"}}]
    frozen = freeze(protocol(TINY, batch=2, conditions=conditions))
    assert frozen.body["conditions"][1]["params"]["mode"] == "eager"  # at batch 1 torchao's fastest: compile
    assert freeze(protocol(TINY, conditions=conditions)).body["conditions"][1]["params"]["mode"] == "compile"
    # asked for, a batch is captured or compiled like one sequence (engine/quantized.py)
    for mode in ("graph", "compile"):
        conditions[1]["params"]["mode"] = mode
        assert freeze(protocol(TINY, batch=2, conditions=conditions)).body["conditions"][1]["params"]["mode"] == mode


def test_the_plan_says_a_competitor_left_eager_at_a_batch_is_not_in_its_fastest_mode(tmp_path):
    conditions = [{"policy": "dense-stream"}, {"name": "q", "policy": "quantized", "params": {"method": "int8-weight-only"}},
                  {"name": "l", "policy": "quantized", "params": {"method": "llm-int8"}}]
    path = tmp_path / "p.yaml"
    lines = {}
    for batch, mode in ((2, None), (2, "compile"), (1, None)):
        if mode:
            conditions[1]["params"]["mode"] = mode
        path.write_text(yaml.safe_dump(protocol(TINY, batch=batch, conditions=conditions)))
        r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "plan", str(path)], capture_output=True,
                           text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        lines[batch, mode] = [x for x in r.stdout.splitlines() if x.lstrip().startswith(("q (", "l ("))]
    (q, l), = [lines[2, None]]
    assert "q (torchao): mode eager; at batch 1 its fastest mode is compile" in q and "write mode: compile" in q
    assert "fastest mode" not in l  # llm-int8's only mode is eager
    assert all("fastest mode" not in x for x in lines[2, "compile"] + lines[1, None])


@pytest.mark.parametrize("changes, fragment", [
    ({"batch": 0}, "protocol field `batch`: 0 is not an integer in [1, 64]"),
    ({"batch": 65}, "protocol field `batch`: 65 is not an integer in [1, 64]"),
    ({"batch": "4"}, "protocol field `batch`: '4' is not an integer in [1, 64]"),
    ({"batch": True}, "protocol field `batch`: True is not an integer in [1, 64]"),
    ({"batch": 4}, "protocol field `batch`: 4 sequences need at least 4 prompts, the protocol declares 3"),
    ({"batch": 2, "schema": 5}, "protocol field `batch`: needs schema 6; write schema: 6 or omit `schema:`"),
    ({"batch": 2, "continuation_tokens": 8000},
     "protocol field `batch`: 2 x 8000 continuation tokens keep 16000 logits rows an episode, more than 8192"),
    ({"batch": 2, "conditions": [{"policy": "dense-stream"}, {"name": "q", "policy": "quantized", "params": {
        "method": "llm-int8", "mode": "graph"}}]},
     "`conditions[1].params.mode`: graph is not possible for llm-int8 (cannot be captured"),
])
def test_bad_batches_are_one_line_naming_the_field(changes, fragment):
    with pytest.raises(ProtocolError) as e:
        validate(protocol(TINY, **changes))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_a_bad_batch_in_one_line_exit_2(tmp_path):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(protocol(TINY, batch=-2)))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate", str(tmp_path / "p.yaml")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "protocol field `batch`: -2 is not an integer in [1, 64]" in lines[0]


def test_the_plan_estimate_charges_a_batch_the_union_of_its_sequences():
    from packbench.core.estimate import Activity, ModelShape, estimate

    shape, activity = ModelShape.of("tiny"), Activity(0.94)
    one = {c["condition"]: c for c in estimate(freeze(protocol(TINY)).body, shape=shape,
                                               activity=activity)["conditions"]}
    two = {c["condition"]: c for c in estimate(freeze(protocol(TINY, batch=2)).body, shape=shape,
                                               activity=activity)["conditions"]}
    assert one["packet"]["decode_call_bytes"] < two["packet"]["decode_call_bytes"] < 2 * one["packet"]["decode_call_bytes"]
    assert two["dense-stream"]["decode_call_bytes"] == one["dense-stream"]["decode_call_bytes"]


def test_the_plan_weighs_what_the_loaders_hold_on_the_device_against_the_allowance():
    """core/estimate.py loader_device, hand-computed at the tiny shape (hidden 64, ffn 256, 2 layers,
    vocab 512, 256 positions, float32): 149,376 parameters, 597,504 B; the outgoing rows 2 x 256 x
    64 x 4 = 131,072 B stay on the host, so a loader holds 466,432 B; the KV cache is 2 (K and V) x
    2 layers x 64 x (32 + 8 tokens) x 4 B = 40,960 B a sequence. Bug caught: a plan that said
    nothing while OPT-13B at batch 64 could not fit its loaders' resident weights and KV cache
    under 20480 MiB, and every such episode ran out of memory on the GPU."""
    from packbench.core.estimate import (TYPICAL_CONTEXT_BYTES, Activity, ModelShape, estimate, loader_device,
                                         loader_device_warning)

    shape = ModelShape.of("tiny")
    room = loader_device(freeze(protocol(TINY, batch=2, allowance_mib=1)).body, shape=shape)
    # the prefill's working set: two layers' outgoing rows, 2 x 65,536 B, three (hidden + ffn)
    # activations for each of 2 x 32 prefill tokens, 3 x 64 x 320 x 4 B, and the fixed 192 MiB
    assert room == {"conditions": ["dense-stream", "packet"], "device_bytes": 466_432, "kv_bytes": 81_920,
                    "activation_bytes": 131_072 + 245_760 + (192 << 20),
                    "allowance_bytes": 1 << 20, "left_bytes": (1 << 20) - 466_432 - 81_920}
    # An allowance no larger than a CUDA context is a CPU screen's (recorded, not imposed): no warning,
    # or every CPU screen of the tiny model (the quickstart's 64 MiB) would carry one.
    assert loader_device_warning(room, batch=2) is None
    assert loader_device_warning({**room, "allowance_bytes": TYPICAL_CONTEXT_BYTES}, batch=2) is None
    # Above a context: room for a context and the working set, no warning; one byte short, the warning.
    big = {**room, "allowance_bytes": 2 * TYPICAL_CONTEXT_BYTES, "activation_bytes": 100 << 20}
    assert loader_device_warning({**big, "left_bytes": TYPICAL_CONTEXT_BYTES + (100 << 20)}, batch=2) is None
    line = loader_device_warning({**big, "left_bytes": TYPICAL_CONTEXT_BYTES + (100 << 20) - 1}, batch=2)
    assert line.startswith("dense-stream, packet hold 0 MiB on the device") and "KV cache of batch 2" in line
    assert "850 MiB of the 1,500 MiB allowance is left" in line and "activations (about 100 MiB)" in line
    assert line.endswith("so expect them to run out of memory; raise allowance_mib or lower the batch")
    # resident under the allowance holds every weight (the tightest); unbounded, and competitors, size their own.
    with_resident = protocol(TINY, conditions=[{"policy": "dense-stream"}, {"policy": "resident"},
                                               {"policy": "accelerate"}])
    r = loader_device(freeze(with_resident).body, shape=shape)
    assert (r["conditions"], r["device_bytes"], r["kv_bytes"]) == (["resident"], 597_504, 40_960)
    unbounded = protocol(TINY, conditions=[{"policy": "dense-stream"},
                                           {"name": "r", "policy": "resident", "params": {"allowance": "unbounded"}}])
    assert loader_device(freeze(unbounded).body, shape=shape)["conditions"] == ["dense-stream"]
    assert estimate(freeze(protocol(TINY)).body, shape=shape, activity=Activity(0.94))["loader_device"]["kv_bytes"] == 40_960


@pytest.mark.parametrize("shape, allowance, batch, continuation, warned", [
    ("opt-2.7b", 5700, 64, 5, True), ("opt-2.7b", 5700, 32, 7, False), ("opt-2.7b", 5700, 8, 7, False),
    ("opt-2.7b", 4800, 16, 16, True), ("opt-2.7b", 4800, 8, 16, False),
    ("opt-13b", 20480, 64, 5, True), ("opt-13b", 20480, 32, 7, False), ("opt-13b", 20480, 8, 7, False)])
def test_the_loader_warning_matches_what_the_gpu_ran(shape, allowance, batch, continuation, warned):
    """Every OPT loader screen run on a GPU at 64-token prefixes (docs/experiments/competitors.md,
    batched.md): OPT-2.7B at batch 64 under 5700 MiB ran out of memory with 862 MiB left after its
    weights and KV cache, more than a context, so a context alone did not warn; with the prefill's
    working set (592 MiB there) it does. At batch 16 under 4800 MiB it ran out of memory too, and
    OPT-13B at 64; the others ran and must not warn. Bug caught: a plan that promised room to a
    screen whose loaders then all failed."""
    from packbench.core.estimate import ModelShape, loader_device, loader_device_warning

    body = {"name": "room", "model": {"synth": {"shape": shape, "dtype": "float16", "seed": 0}},
            "dtype": "float16", "prompts": {"generator": {"seed": 0, "count": batch}}, "prefix_tokens": 64,
            "continuation_tokens": continuation, "batch": batch, "scored_prompts": 1, "warmups": 1,
            "reference": "dense-stream", "allowance_mib": allowance,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}], "gates": {"faithfulness": {}}}
    room = loader_device(freeze(body).body, shape=ModelShape.of(shape))
    assert (loader_device_warning(room, batch=batch) is not None) is warned, room
