"""A protocol's `model.synth` may name an MoE shape (core/moe.py MOE_SHAPES): {shape, dtype, seed,
layers, routing}, every field written out, and the schema refuses what cannot run on it in one
line naming the field: an OPT policy, an allowance below the device part plus one layer's routed
experts, an unknown routing profile, layers out of range; gather mapped on an OPT model."""

import pytest

from packbench.core.errors import ProtocolError
from packbench.core.moe import MOE_SHAPES, ROUTING_OF
from packbench.core.protocol import freeze, validate


def body(synth=None, **changes):
    return {"name": "moe-synth", "model": {"synth": {"shape": "qwen3-moe-tiny", "dtype": "bfloat16", "seed": 2,
                                                      **(synth or {})}},
            "dtype": "bfloat16", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 16,
            "continuation_tokens": 4, "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}},
            **changes}


def test_an_moe_shape_freezes_with_every_field_written_out():
    frozen = freeze(body())
    # Would catch a default left implicit (a later change of ROUTING_OF or the depth would change
    # what an old hash means).
    assert frozen.body["model"]["synth"] == {"shape": "qwen3-moe-tiny", "dtype": "bfloat16", "seed": 2,
                                             "layers": MOE_SHAPES["qwen3-moe-tiny"]["layers"],
                                             "routing": ROUTING_OF["qwen3-moe-tiny"]}
    s = frozen.protocol.model.synth
    assert (s.shape, s.layers, s.routing, s.is_moe) == ("qwen3-moe-tiny", 3, "olmoe", True)
    assert s.as_dict() == frozen.body["model"]["synth"]
    # The default written out and the same spec given in full are one protocol (one hash).
    assert freeze(body({"layers": 3, "routing": "olmoe"})).sha256 == frozen.sha256
    assert freeze(body({"layers": 2})).sha256 != frozen.sha256


def test_fewer_layers_and_each_routing_profile_are_valid():
    for routing in ("mixtral", "olmoe", "uniform"):
        assert validate(body({"layers": 1, "routing": routing}))["model"]["synth"]["routing"] == routing
    big = body({"shape": "qwen3-30b-a3b", "layers": 12, "dtype": "float16"}, dtype="float16", allowance_mib=24 * 1024)
    assert validate(big)["model"]["synth"]["layers"] == 12


@pytest.mark.parametrize("synth, changes, field, words", [
    ({"routing": "zipf"}, {}, "model.synth.routing", "'zipf' is not allowed; use one of mixtral, olmoe, uniform"),
    ({"layers": 0}, {}, "model.synth.layers", "an integer in [1, 3]"),
    ({"layers": 4}, {}, "model.synth.layers", "an integer in [1, 3]"),
    ({"layers": True}, {}, "model.synth.layers", "an integer in [1, 3]"),
    ({"profile": "opt"}, {}, "model.synth.profile", "allowed fields are dtype, layers, routing, seed, shape"),
    ({}, {"conditions": [{"policy": "dense-stream"}, {"policy": "row-retention", "params": {"rows_per_layer": 8}}]},
     "conditions[1].policy", "'row-retention' does not fit the synthetic qwen3-moe-tiny shape, a qwen3_moe MoE model; "),
    ({"shape": "mixtral-tiny"}, {"conditions": [{"policy": "dense-stream"}, {"policy": "row-retention",
                                                                             "params": {"rows_per_layer": 8}}]},
     "conditions[1].policy", "'row-retention' does not fit the synthetic mixtral-tiny shape, a mixtral MoE model; "),
    ({"shape": "qwen3-30b-a3b", "layers": 2}, {"allowance_mib": 1024}, "allowance_mib", "one layer's routed experts"),
])
def test_refusals_name_the_field(synth, changes, field, words):
    with pytest.raises(ProtocolError) as e:
        validate(body(synth, **changes))
    assert f"`{field}`" in str(e.value) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_the_allowance_is_judged_at_the_stated_depth():
    """Qwen3-30B-A3B fp16: resident holds every layer's experts (1.125 GiB each): 12 layers fit an
    allowance that 48 do not (would catch the refusal using the shape's full depth)."""
    common = dict(dtype="float16", allowance_mib=24 * 1024,
                  conditions=[{"policy": "dense-stream"}, {"policy": "resident"}])
    validate(body({"shape": "qwen3-30b-a3b", "dtype": "float16", "layers": 12}, **common))
    with pytest.raises(ProtocolError, match="condition 'resident'"):
        validate(body({"shape": "qwen3-30b-a3b", "dtype": "float16"}, **common))


def test_mode_graph_takes_the_mapped_gather_and_opt_refuses_it():
    ok = body(engine={"mode": "graph"}, conditions=[
        {"policy": "dense-stream"}, {"policy": "resident"}, {"policy": "packet", "params": {"gather": "mapped"}},
        {"policy": "phase-switched", "params": {"gather": "mapped"}}])
    assert validate(ok)["conditions"][2]["params"]["gather"] == "mapped"
    opt = dict(ok, model={"synth": {"shape": "tiny", "dtype": "float32", "seed": 0}}, dtype="float32")
    with pytest.raises(ProtocolError, match=r"`conditions\[2\].params.gather`: mapped gathers an MoE model's experts"):
        validate(opt)


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize("synth, changes, words", [
    ({"routing": "zipf"}, {}, "model.synth.routing"),
    ({"layers": 49, "shape": "qwen3-30b-a3b"}, {}, "model.synth.layers"),
    ({"shape": "qwen3-30b-a3b", "layers": 2}, {"allowance_mib": 1024}, "allowance_mib"),
    ({}, {"conditions": [{"policy": "dense-stream"}, {"policy": "sparse-extents"}]}, "conditions[1].policy"),
])
def test_validate_and_plan_refuse_in_one_line_exit_2(tmp_path, command, synth, changes, words):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(body(synth, **changes)))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", command, str(f)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_plan_prints_the_expert_bytes_of_the_stated_depth(tmp_path):
    """`protocol plan` of a synthetic MoE shape: its bytes per call at the stated layers, no
    checkpoint needed (would catch the plan reading OPT's shape table, or the full depth)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(body({"shape": "qwen3-30b-a3b", "layers": 12, "dtype": "float16"}, dtype="float16",
                                     allowance_mib=24 * 1024, conditions=[
                                         {"policy": "dense-stream"}, {"policy": "packet", "params": {"gather": "mapped"}}])))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "plan", str(f), "--json"], capture_output=True,
                       text=True, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    rows = {row["condition"]: row for row in json.loads(r.stdout)["moe"]}
    expert = 3 * 2048 * 768 * 2
    assert rows["dense-stream"]["decode_bytes"] == 12 * 128 * expert
    assert rows["packet"]["decode_bytes"] == 12 * 8 * expert  # k experts a layer, no index


@pytest.mark.parametrize("missing", ["dtype", "seed"])
def test_an_moe_synth_without_dtype_or_seed_is_refused_naming_it(missing):
    # Would catch the MoE branch taking dtype or seed as optional: the spec builder then fails
    # with a TypeError (a traceback, not a line), or a default nobody wrote would be frozen.
    # (shape cannot be left out here: without it the synth is not recognised as MoE at all.)
    b = body()
    del b["model"]["synth"][missing]
    with pytest.raises(ProtocolError) as e:
        validate(b)
    assert str(e.value) == f"protocol field `model.synth.{missing}`: is required"


def test_an_expert_caches_bare_forecast_on_in_yaml_is_the_choice_on(tmp_path):
    """docs/protocol.md writes `forecast: on` (or `off`); YAML reads a bare on/off as a boolean,
    so the file as written was refused: "True is not allowed; use one of off, on". A bare on/off
    is the choice it spells, one protocol (one hash) with the quoted one."""
    from packbench.core.protocol import load

    def saved(name: str, forecast: str):
        path = tmp_path / name
        path.write_text("name: moe-cache\nmodel: {synth: {shape: qwen3-moe-tiny, dtype: bfloat16, seed: 2}}\n"
                        "dtype: bfloat16\nprompts: {generator: {seed: 0, count: 1}}\nprefix_tokens: 16\n"
                        "continuation_tokens: 4\nreference: dense-stream\nwarmups: 1\nallowance_mib: 64\n"
                        "gates: {faithfulness: {}}\nconditions:\n  - {policy: dense-stream}\n"
                        f"  - {{policy: expert-cache, params: {{capacity: 2, forecast: {forecast}}}}}\n")
        return load(path)

    for word in ("on", "off"):
        bare, quoted = saved(f"bare-{word}.yaml", word), saved(f"quoted-{word}.yaml", f'"{word}"')
        assert bare.body["conditions"][1]["params"]["forecast"] == word
        assert bare.sha256 == quoted.sha256
    with pytest.raises(ProtocolError, match="use one of off, on"):
        saved("maybe.yaml", "maybe")
