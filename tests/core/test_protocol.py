"""Protocol schema: validation, freezing, schema-1 stability, prompt sources."""

import copy
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from packbench.core.errors import ProtocolError
from packbench.core.plan import prompts
from packbench.core.protocol import (
    SYNTH_SHAPES,
    expand,
    freeze,
    load,
    prompt_count,
    split_texts,
    validate,
)

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "protocols" / "quickstart.yaml"
# Recorded when schema 2 arrived: schema-1 protocols keep the hash packbench 0.1 gave them.
QUICKSTART_SHA256 = "a5e99a22153b3b16b0bc19775063c0b8c27cf0ad76952a072d4b438d5a539fdb"


def raw() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


def v2(**changes) -> dict:
    """A schema-2 protocol mapping (quickstart plus `changes` at top level)."""
    data = raw()
    data["model"] = {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0}}
    data.update(changes)
    return data


def set_path(data: dict, path: tuple, value) -> dict:
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


# ----------------------------------------------------------------------------- freezing


def refusal_of(data) -> str:
    """The one line `freeze` refuses `data` with."""
    with pytest.raises(ProtocolError) as e:
        freeze(data)
    return str(e.value)


def test_quickstart_freezes_with_its_schema1_hash():
    p = load(QUICKSTART)
    assert p.sha256 == QUICKSTART_SHA256 and p.name == "quickstart" and p.body["schema"] == 1
    assert p.model_dir() == (QUICKSTART.parent / "../.packbench/models/tiny").resolve()
    assert p.prompt_file() is None


def test_freeze_hash_is_stable_across_key_order_and_whitespace(tmp_path):
    data = raw()
    reordered = dict(reversed(list(data.items())))
    reordered["gates"] = dict(reversed(list(data["gates"].items())))
    f = tmp_path / "p.yaml"
    f.write_text("# a comment\n\n" + yaml.safe_dump(reordered, indent=8, default_flow_style=False))
    assert load(f).sha256 == load(QUICKSTART).sha256 == freeze(data).sha256


def test_defaults_are_part_of_the_frozen_form():
    data = raw()
    explicit = freeze(data)
    data.pop("warmups")
    assert freeze(data).body["warmups"] == 1 and freeze(data).sha256 == explicit.sha256


def test_schema2_spelling_of_a_schema1_meaning_keeps_the_schema1_hash():
    data = raw()
    data.update(schema=2, repetitions=1, order="alternating", baseline_first=True, recording=True,
                warmups={"dense-stream": 1, "packet": 1})
    for c in data["conditions"]:
        c["params"] = {}
    data["gates"]["acquisition"] = [{"control": "dense-stream", "max_ratio": 0.5, "phase": "all"}]
    assert freeze(data).sha256 == QUICKSTART_SHA256


def test_any_change_of_meaning_changes_the_hash():
    base = freeze(raw()).sha256
    changes = [
        (("continuation_tokens",), 9), (("dtype",), "bfloat16"), (("gates", "acquisition", "max_ratio"), 0.25),
        (("prompts", "generator", "seed"), 1), (("repetitions",), 2), (("order",), "abba"),
        (("baseline_first",), False), (("warmups",), {"dense-stream": 1, "packet": 2}),
        (("gates", "acquisition", "phase"), "decode"), (("gates", "resources"), {}),
        (("model",), {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0}}),
    ]
    hashes = {base}
    for path, value in changes:
        h = freeze(set_path(raw(), path, value)).sha256
        assert h not in hashes, path
        hashes.add(h)


def test_schema2_frozen_form_fills_every_default():
    data = v2(conditions=[{"policy": "dense-stream"}, {"policy": "sparse-extents"},
                          {"name": "lru", "policy": "row-retention", "params": {"rows_per_layer": 1024}}],
              warmups={"dense-stream": 2, "sparse-extents": 1, "lru": 0})
    data["gates"] = {"faithfulness": None, "resources": None, "capacity": {},
                     "acquisition": [{"control": "dense-stream", "max_ratio": 0.5, "phase": "decode"},
                                     {"control": "dense-stream", "max_ratio": 0.9, "phase": "prefill"}],
                     "runtime": {"control": "dense-stream", "max_ratio": 0.8},
                     "useful_latency": {"max_first_episode_s": 5, "max_cold_start_s": 20}}
    body = freeze(data).body
    assert body["schema"] == 2
    assert body["model"]["synth"] == {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0,
                                      "hot_fraction": 0.0, "hot_bias": 0.0}
    assert body["conditions"] == [
        {"name": "dense-stream", "policy": "dense-stream", "params": {}},
        {"name": "sparse-extents", "policy": "sparse-extents", "params": {"block_rows": 128}},
        {"name": "lru", "policy": "row-retention", "params": {"rows_per_layer": 1024}}]
    assert body["warmups"] == {"dense-stream": 2, "sparse-extents": 1, "lru": 0}
    assert (body["repetitions"], body["order"], body["baseline_first"], body["recording"]) == (1, "alternating", True, True)
    assert body["gates"] == {
        "faithfulness": {"tolerance": 0.0}, "resources": {}, "capacity": {},
        "acquisition": [{"control": "dense-stream", "max_ratio": 0.9, "phase": "prefill"},  # sorted by phase
                        {"control": "dense-stream", "max_ratio": 0.5, "phase": "decode"}],
        "runtime": [{"control": "dense-stream", "max_ratio": 0.8, "phase": "all", "confidence": 0.95,
                     "resamples": 10000, "seed": 0}],
        "useful_latency": {"max_first_episode_s": 5.0, "max_cold_start_s": 20.0}}
    assert validate(body) == body  # a frozen body re-validates to itself
    assert freeze(body).sha256 == freeze(data).sha256


def test_expand_upgrades_schema1_to_the_full_form():
    v1 = freeze(raw()).body
    proto = expand(v1)
    full = proto.full_dict()
    assert full["schema"] == 2 and validate(v1) == v1
    assert full["warmups"] == {"dense-stream": 1, "packet": 1}
    assert full["gates"]["acquisition"] == [{"control": "dense-stream", "max_ratio": 0.5, "phase": "all"}]
    assert all(c["params"] == {} for c in full["conditions"])
    assert validate(proto.full_dict()) == v1  # the lowest schema that says it
    assert expand(proto.full_dict()) == proto and expand(proto) is proto
    assert proto.body_dict() == v1 and proto.sha256 == freeze(raw()).sha256


def test_synth_shapes_match_the_engine():
    from packbench.core.registry import SHAPES

    assert set(SYNTH_SHAPES) == set(SHAPES)


def test_synthetic_model_has_no_directory():
    p = freeze(v2())
    assert p.model_dir() is None and p.body["schema"] == 2


# ----------------------------------------------------------------------------- errors


def _runtime(d, **kw):
    d["gates"]["runtime"] = {"control": "dense-stream", "max_ratio": 0.8, **kw}


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.update(colour="blue"), "`colour`: unknown field"),
    (lambda d: d["conditions"][1].update(policy="pakcet"),
     ("`conditions[1].policy`: 'pakcet' is not allowed; use one of resident, dense-stream, sparse-extents, "
      "packet, phase-switched, row-retention, early-forecast")),
    (lambda d: d.update(dtype="float8"), "`dtype`: 'float8' is not allowed; use one of float32, float16, bfloat16"),
    (lambda d: d.update(reference="nope"), "`reference`: 'nope' is not allowed; use one of dense-stream, packet"),
    (lambda d: d.pop("gates"), "`gates`: is required"),
    (lambda d: d.update(prefix_tokens=0), "`prefix_tokens`: 0 is not an integer in [1, 65536]"),
    (lambda d: d.update(continuation_tokens=10**9), "`continuation_tokens`: 1000000000 is not an integer in [1, 8192]"),
    (lambda d: d.update(repetitions=10**9), "`repetitions`: 1000000000 is not an integer in [1, 100000]"),
    (lambda d: d.update(repetitions=40_000), "`repetitions`: the plan would hold 240002 episodes, more than 100000"),
    (lambda d: d["prompts"]["generator"].update(count=10**6), "`prompts.generator.count`: 1000000 is not an integer in [1, 100000]"),
    (lambda d: d["prompts"]["generator"].update(count=60_000), "the plan would hold 120002 episodes"),
    (lambda d: _runtime(d, resamples=100_001), "`gates.runtime.resamples`: 100001 is not an integer in [100, 100000]"),
    (lambda d: d.update(conditions=[{"name": f"c{i}", "policy": "packet"} for i in range(17)]), "`conditions`: 17 conditions, more than 16"),
    (lambda d: d["gates"].update(acquisition={"control": "dense-stream"}), "`gates.acquisition.max_ratio`: is required"),
    (lambda d: d["gates"]["faithfulness"].update(tol=1), "`gates.faithfulness.tol`: unknown field"),
    (lambda d: d.update(prompts={"token_ids": [[2, 3]]}), "has 2 ids, fewer than prefix_tokens=32"),
    (lambda d: d.update(prompts={"token_ids": [[2] * 32], "generator": {"seed": 0, "count": 1}}),
     "`prompts`: give exactly one of token_ids, token_file, text_file, generator"),
    (lambda d: d.update(model={"path": "x", "synth": {}}), "`model`: give exactly one of path"),
    (lambda d: d.update(model={"synth": {"shape": "opt-66b", "dtype": "float16", "sparsity": 0.9, "seed": 0}}),
     "`model.synth.shape`: 'opt-66b' is not allowed; use one of tiny, opt-125m, opt-1.3b, opt-2.7b, opt-6.7b, opt-13b"),
    (lambda d: d.update(model={"synth": {"shape": "tiny", "dtype": "float16", "sparsity": 1.0, "seed": 0}}),
     "`model.synth.sparsity`: 1.0 is not a finite number > 0.0 and < 1.0"),
    (lambda d: d.update(model={"synth": {"shape": "tiny", "dtype": "float16", "sparsity": 0.9, "seed": 0,
                                         "hot": 1}}), "`model.synth.hot`: unknown field"),
    (lambda d: d.update(model={"synth": {"shape": "tiny", "dtype": "float16", "sparsity": 0.9, "seed": 0,
                                         "hot_fraction": 1.0}}), "`model.synth.hot_fraction`: 1.0 is not"),
    (lambda d: d["conditions"][1].update(params={"block_rows": 64}),
     "`conditions[1].params.block_rows`: unknown param; policy packet takes gather"),
    (lambda d: d["conditions"].append({"policy": "sparse-extents", "params": {"block_rows": 0}}),
     "`conditions[2].params.block_rows`: 0 is not an integer in [1, 2147483647]"),
    (lambda d: d["conditions"].append({"policy": "sparse-extents", "params": {"rows": 8}}),
     "`conditions[2].params.rows`: unknown param; policy sparse-extents takes block_rows"),
    (lambda d: d["conditions"].append({"policy": "row-retention"}),
     "`conditions[2].params.rows_per_layer`: is required by policy row-retention"),
    (lambda d: d["conditions"].append({"policy": "packet"}), "`conditions[2].name`: 'packet' is already used"),
    (lambda d: d["conditions"].append({"name": "a b", "policy": "packet"}), "`conditions[2].name`: 'a b' is not allowed"),
    (lambda d: d.update(order="random"), "`order`: 'random' is not allowed; use one of alternating, abba, latin-square"),
    (lambda d: d.update(baseline_first="yes"), "`baseline_first`: 'yes' is not allowed; use true or false"),
    (lambda d: d.update(repetitions=0), "`repetitions`: 0 is not an integer in [1, 100000]"),
    (lambda d: d.update(warmups={"dense-stream": 1}), "`warmups.packet`: is required; list every condition"),
    (lambda d: d.update(warmups={"dense-stream": 1, "packet": 1, "lru": 1}),
     "`warmups.lru`: unknown condition; use one of dense-stream, packet"),
    (lambda d: d.update(warmups={"dense-stream": 0, "packet": 1}),
     "`warmups.dense-stream`: 0 leaves the reference 'dense-stream' nothing to reproduce itself against"),
    (lambda d: d.update(recording=False), "`gates.acquisition`: needs recording: true"),
    (lambda d: d["gates"].update(acquisition={"control": "dense-stream", "max_ratio": 0.5, "phase": "warm"}),
     "`gates.acquisition.phase`: 'warm' is not allowed; use one of all, prefill, decode"),
    (lambda d: d["gates"].update(acquisition=[{"control": "dense-stream", "max_ratio": 0.5, "phase": "decode"},
                                              {"control": "packet", "max_ratio": 0.5, "phase": "decode"}]),
     "`gates.acquisition[1].phase`: 'decode' is already gated; give one entry per phase"),
    (lambda d: d["gates"].update(acquisition=[]), "`gates.acquisition`: expected a mapping or a non-empty list"),
    (lambda d: _runtime(d, confidence=1.0), "`gates.runtime.confidence`: 1.0 is not a finite number > 0.0 and < 1.0"),
    (lambda d: _runtime(d, resamples=10), "`gates.runtime.resamples`: 10 is not an integer in [100, 100000]"),
    (lambda d: _runtime(d, max_ratio=0), "`gates.runtime.max_ratio`: 0 is not a finite number > 0.0"),
    (lambda d: _runtime(d, control="lru"), "`gates.runtime.control`: 'lru' is not allowed; use one of dense-stream, packet"),
    (lambda d: d["gates"].update(useful_latency={"max_first_episode_s": 5}),
     "`gates.useful_latency.max_cold_start_s`: is required"),
    (lambda d: d["gates"].update(resources={"max": 1}), "`gates.resources.max`: unknown field"),
    (lambda d: d["gates"]["faithfulness"].update(tolerance=float("nan")),
     "`gates.faithfulness.tolerance`: nan is not a finite number >= 0.0"),
    (lambda d: d.update(gates={}), "`gates`: declare at least one gate"),
    (lambda d: d.update(gates={"speed": {}}), "`gates.speed`: unknown field; allowed fields are acquisition, capacity"),
    (lambda d: d.update(schema=12), "`schema`: 12 is not supported; this packbench reads schema 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 11"),
    (lambda d: d.update(schema=1, repetitions=2), "`schema`: 1 cannot express this protocol"),
    (lambda d: d.update(prompts={"text_file": "t.txt"}, model={"synth": {"shape": "tiny", "dtype": "float32",
                                                                         "sparsity": 0.9, "seed": 0}}),
     "`prompts.text_file`: needs the protocol file's folder"),
    (lambda d: d.update(prompts={"token_file": "ids.json"}), "`prompts.token_file`: needs the protocol file's folder"),
])
def test_bad_fields_name_the_path_the_value_and_the_fix(mutate, fragment):
    data = raw()
    mutate(data)
    with pytest.raises(ProtocolError) as e:
        freeze(data)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_text_file_needs_a_tokenizer_checkpoint(tmp_path):
    (tmp_path / "t.txt").write_text("hello world\n")
    data = v2(prompts={"text_file": "t.txt"})
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ProtocolError, match=r"`prompts.text_file`: needs model.path"):
        load(f)


def test_malformed_yaml_and_duplicate_keys_are_one_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: [unclosed\n")
    with pytest.raises(ProtocolError, match="not valid YAML at line"):
        load(f)
    with pytest.raises(ProtocolError, match="no protocol file"):
        load(tmp_path / "missing.yaml")
    f.write_text(QUICKSTART.read_text() + "gates:\n  faithfulness: {}\n")
    with pytest.raises(ProtocolError, match=r"line \d+: key `gates` is given twice; keep one"):
        load(f)


# ----------------------------------------------------------------------------- prompt sources


def test_generated_prompts_are_deterministic_and_in_vocab():
    body = freeze(raw()).body
    a, b = prompts(body, vocab=512), prompts(body, vocab=512)
    assert a == b and len(a) == 3 and all(len(p) == 32 and p[0] == 2 for p in a)
    assert all(4 <= t < 512 for p in a for t in p[1:])
    # Golden value recorded once: numpy promises PCG64 streams stay the same across versions.
    assert a[0][:8] == [2, 436, 327, 263, 141, 160, 24, 42]


def write_protocol(tmp_path: Path, **changes) -> Path:
    data = v2(prefix_tokens=4, **changes)
    f = tmp_path / "proto" / "p.yaml"
    f.parent.mkdir(exist_ok=True)
    f.write_text(yaml.safe_dump(data))
    return f


def test_token_file_is_frozen_by_hash_and_read_back(tmp_path):
    ids = [[2, 10, 11, 12, 13], [2, 20, 21, 22]]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    f = write_protocol(tmp_path, prompts={"token_file": "../ids.json"})
    p = load(f)
    digest = hashlib.sha256((tmp_path / "ids.json").read_bytes()).hexdigest()
    assert p.body["prompts"] == {"token_file": {"path": "../ids.json", "sha256": digest, "count": 2}}
    assert p.prompt_file() == (tmp_path / "ids.json").resolve()
    assert prompt_count(p.body) == 2 and validate(p.body) == p.body  # no file needed once frozen
    assert prompts(p.body, vocab=512, prompt_file=p.prompt_file()) == [[2, 10, 11, 12], [2, 20, 21, 22]]
    # Same ids, other bytes: another protocol. A changed file after freezing is refused.
    (tmp_path / "ids.json").write_text(json.dumps(ids, indent=1))
    assert load(f).sha256 != p.sha256
    with pytest.raises(ProtocolError, match="restore the file the protocol was frozen with"):
        prompts(p.body, vocab=512, prompt_file=p.prompt_file())
    with pytest.raises(ProtocolError, match="pass the file"):
        prompts(p.body, vocab=512)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 16"):
        prompts(load(f).body, vocab=16, prompt_file=p.prompt_file())


def test_token_file_pins_and_errors(tmp_path):
    (tmp_path / "ids.json").write_text("[[2, 3, 4, 5]]")
    good = hashlib.sha256(b"[[2, 3, 4, 5]]").hexdigest()
    assert load(write_protocol(tmp_path, prompts={"token_file": {"path": "../ids.json", "sha256": good}})).body
    cases = [
        ({"path": "../ids.json", "sha256": "0" * 64}, "`prompts.token_file.sha256`: " + "0" * 64 + " does not match"),
        ({"path": "../ids.json", "count": 2}, "`prompts.token_file.count`: 2 does not match the 1 prompts"),
        ({"path": "../nope.json"}, "`prompts.token_file`: cannot read"),
        ({"path": "../ids.json", "sha256": "XYZ"}, "`prompts.token_file.sha256`: 'XYZ' is not allowed"),
    ]
    for spec, fragment in cases:
        with pytest.raises(ProtocolError) as e:
            load(write_protocol(tmp_path, prompts={"token_file": spec}))
        assert fragment in str(e.value), (spec, str(e.value))
    (tmp_path / "ids.json").write_text("[[2, 3]]")
    with pytest.raises(ProtocolError, match="prompt 0 of ../ids.json has 2 ids, fewer than prefix_tokens=4"):
        load(write_protocol(tmp_path, prompts={"token_file": "../ids.json"}))
    (tmp_path / "ids.json").write_text("{not json")
    with pytest.raises(ProtocolError, match="is not JSON"):
        load(write_protocol(tmp_path, prompts={"token_file": "../ids.json"}))
    (tmp_path / "ids.json").write_text('[[2, 3, "x", 5]]')
    with pytest.raises(ProtocolError, match=r"ids.json\)\[0\]\[2\]`: 'x' is not an integer in \[0, 2147483647\]"):
        load(write_protocol(tmp_path, prompts={"token_file": "../ids.json"}))


def test_text_file_prompts_split_and_tokenize(tmp_path):
    text = "The first prompt\nspans two lines.\n---\n\nThe second one.\n---\n"
    (tmp_path / "texts.txt").write_text(text)
    assert split_texts(text) == ["The first prompt\nspans two lines.", "The second one."]
    f = write_protocol(tmp_path, model={"path": "model"}, prompts={"text_file": "../texts.txt"})
    p = load(f)
    assert p.body["prompts"]["text_file"]["count"] == 2 and prompt_count(p.body) == 2
    fake = lambda texts: [[2] + [len(w) + 4 for w in t.split()] for t in texts]
    assert prompts(p.body, vocab=512, prompt_file=p.prompt_file(), tokenize=fake) == [[2, 7, 9, 10], [2, 7, 10, 8]]
    with pytest.raises(ProtocolError, match="need the checkpoint's tokenizer"):
        prompts(p.body, vocab=512, prompt_file=p.prompt_file())
    short = lambda texts: [[2, 5] for _ in texts]
    with pytest.raises(ProtocolError, match="prompt 0 has 2 tokens, fewer than prefix_tokens=4"):
        prompts(p.body, vocab=512, prompt_file=p.prompt_file(), tokenize=short)


def test_text_file_with_a_real_local_tokenizer(tmp_path):
    """engine.prompts loads the checkpoint's own tokenizer files, offline."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from packbench.core.errors import CheckpointError
    from packbench.engine.prompts import tokenizer_for

    words = ["<s>", "<pad>", "</s>", "<unk>", "the", "cat", "sat", "on", "a", "mat", "dog"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    model_dir = tmp_path / "model"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(model_dir)
    (tmp_path / "texts.txt").write_text("the cat sat on a mat\n---\nthe dog sat on the cat\n")
    p = load(write_protocol(tmp_path, model={"path": "../model"}, prompts={"text_file": "../texts.txt"}))
    ids = prompts(p.body, vocab=len(words), prompt_file=p.prompt_file(), tokenize=tokenizer_for(p.model_dir()))
    assert ids == [[2, 4, 5, 6], [2, 4, 10, 6]]
    with pytest.raises(CheckpointError, match="has no tokenizer files"):
        tokenizer_for(tmp_path / "proto")


def test_expand_refuses_a_damaged_body():
    body = copy.deepcopy(freeze(raw()).body)
    body["gates"]["acquisition"]["max_ratio"] = "half"
    with pytest.raises(ProtocolError, match="`gates.acquisition.max_ratio`: 'half' is not a finite number"):
        expand(body)


def test_placement_is_frozen_only_when_given():
    """placement (schema 2) keeps every older hash: absent or empty, it is left out."""
    base = freeze(v2())
    assert freeze(v2(placement={})).sha256 == base.sha256 == freeze(v2(placement={"exclusive_node": False})).sha256
    pinned = freeze(v2(placement={"accelerator_type": "H200", "exclusive_node": True}))
    assert pinned.sha256 != base.sha256 and pinned.body["placement"] == {"accelerator_type": "H200", "exclusive_node": True}
    p = expand(pinned.body)
    assert (p.placement.accelerator_type, p.placement.node, p.placement.exclusive_node) == ("H200", None, True)
    assert expand(base.body).placement.accelerator_type is None
    with_v1 = raw()
    with_v1["placement"] = {"node": "abc"}
    assert freeze(with_v1).body["schema"] == 2  # schema 1 cannot say where to run
    with pytest.raises(ProtocolError, match="`placement.exclusive_node`: 'yes' is not allowed; use true or false"):
        freeze(v2(placement={"exclusive_node": "yes"}))
    with pytest.raises(ProtocolError, match="`placement.gpu`: unknown field"):
        freeze(v2(placement={"gpu": "H200"}))


def test_placement_resources_are_frozen_only_when_given():
    """placement.resources: absent or empty keeps the hash; whole amounts freeze as integers;
    Ray's own resources and non-positive amounts are refused with the field named."""
    base = freeze(v2())
    assert freeze(v2(placement={"resources": {}})).sha256 == base.sha256
    one = freeze(v2(placement={"resources": {"fast_nvme": 1}}))
    assert one.sha256 != base.sha256 and one.body["placement"] == {"resources": {"fast_nvme": 1}}
    assert freeze(v2(placement={"resources": {"fast_nvme": 1.0}})).sha256 == one.sha256
    p = expand(one.body)
    assert p.placement.resources_dict == {"fast_nvme": 1} and expand(base.body).placement.resources == ()
    assert expand(freeze(v2(placement={"resources": {"b": 0.5, "a": 2}})).body).placement.resources == (
        ("a", 2), ("b", 0.5))
    with pytest.raises(ProtocolError, match="`placement.resources.GPU`: GPU is Ray's own resource"):
        freeze(v2(placement={"resources": {"GPU": 1}}))
    with pytest.raises(ProtocolError, match="`placement.resources.fast_nvme`: 0 is not a finite number > 0"):
        freeze(v2(placement={"resources": {"fast_nvme": 0}}))
    with pytest.raises(ProtocolError, match="`placement.resources`: \\['fast_nvme'\\] is not a mapping"):
        freeze(v2(placement={"resources": ["fast_nvme"]}))


def test_engine_mode_is_frozen_only_when_not_eager():
    """engine.mode: eager (or absent) keeps every older hash; graph is a new meaning."""
    base = freeze(v2())
    assert freeze(v2(engine={"mode": "eager"})).sha256 == base.sha256 == freeze(v2(engine={})).sha256
    graph = freeze(v2(engine={"mode": "graph"}))
    assert graph.sha256 != base.sha256 and graph.body["engine"] == {"mode": "graph"}
    assert expand(graph.body).engine_mode == "graph" and expand(base.body).engine_mode == "eager"
    v1 = raw()
    v1["engine"] = {"mode": "graph"}
    assert freeze(v1).body["schema"] == 2
    with pytest.raises(ProtocolError, match="`engine.mode`: 'fast' is not allowed; use one of eager, graph"):
        freeze(v2(engine={"mode": "fast"}))


def test_the_protocol_and_the_engine_name_the_same_modes():
    from packbench.core.protocol import ENGINE_MODES
    from packbench.engine.graph import MODES

    assert MODES is ENGINE_MODES  # one tuple, not two copies kept equal


def test_placement_resources_refusals_word_for_word_and_whole_amounts_freeze_as_integers():
    """A name that is not a non-empty string, and an amount at Ray's fixed-point bound (1e9), are
    refused naming the field; a whole amount is frozen as the integer (its canonical JSON says 1,
    as the bodies frozen before resources took floats)."""
    from packbench.core.canonical import canonical_json

    for resources, refusal in (
            ({1: 1}, "`placement.resources`: 1 is not a resource name; use the name a node declares with "
                     "`ray start --resources`"),
            ({" ": 1}, "`placement.resources`: ' ' is not a resource name; use the name a node declares with "
                       "`ray start --resources`"),
            ({"fast_nvme": 1e9}, "`placement.resources.fast_nvme`: 1000000000.0 is not a finite number > 0.0 and "
                                 "< 1000000000.0")):
        assert refusal_of(v2(placement={"resources": resources})) == f"protocol field {refusal}"
    assert freeze(v2(placement={"resources": {"a": 999_999_999.5}})).body["placement"] == {"resources": {"a": 999_999_999.5}}
    for amount in (1, 1.0):
        assert b'"resources":{"fast_nvme":1}' in canonical_json(freeze(v2(placement={"resources": {"fast_nvme": amount}})).body)


def test_resources_fit_when_every_need_is_free_in_full():
    from packbench.core.protocol import resources_fit

    assert resources_fit({"a": 1}, {"a": 1}) and resources_fit({}, {}) and resources_fit({"a": 0.5}, {"a": 2, "b": 1})
    assert not resources_fit({"a": 1.5}, {"a": 1}) and not resources_fit({"b": 0.5}, {"a": 2})  # an undeclared one is 0


def test_protocols_are_equal_hashed_and_pickled_by_their_identity():
    """Equality and hashing go by the sha256; a pickled protocol is re-validated from its body."""
    import pickle

    a, same, other = freeze(raw()).protocol, expand(freeze(raw()).body), freeze(v2()).protocol
    assert a == same and a is not same and hash(a) == hash(same) == hash(a.sha256)
    assert a != other and a != a.sha256 and len({a, same, other}) == 2
    back = pickle.loads(pickle.dumps(other))
    assert back == other and back.body_dict() == other.body_dict() and back is not other


def test_token_file_refusals_word_for_word(tmp_path):
    """Each refusal of a prompt file's spec names its field, the value and what to write;
    a frozen body must carry the path, the sha256 and the count (the file is not at hand)."""
    (tmp_path / "ids.json").write_text("[[2, 3, 4, 5]]")
    digest = hashlib.sha256(b"[[2, 3, 4, 5]]").hexdigest()

    def refusal(spec, *, frozen=False):
        with pytest.raises(ProtocolError) as e:
            if frozen:
                validate(v2(prefix_tokens=4, prompts={"token_file": spec}))
            else:
                load(write_protocol(tmp_path, prompts={"token_file": spec}))
        return str(e.value).removeprefix("protocol field ")

    assert refusal({"path": "../ids.json", "lines": 1}) == (
        "`prompts.token_file.lines`: unknown field; allowed fields are count, path, sha256")
    assert refusal({"sha256": digest, "count": 1}) == "`prompts.token_file.path`: is required"
    assert refusal({"path": " "}) == "`prompts.token_file.path`: ' ' is not allowed; expected a path relative to the protocol file"
    for count in (0, 100_001):
        assert refusal({"path": "../ids.json", "count": count}) == (
            f"`prompts.token_file.count`: {count} is not an integer in [1, 100000]")
    for spec in ({"path": "ids.json", "sha256": digest}, {"path": "ids.json", "count": 1}, {"path": "ids.json"}):
        assert refusal(spec, frozen=True) == (
            "`prompts.token_file`: needs the protocol file's folder to read the file; load the protocol from its file "
            "(a frozen body carries path, sha256 and count)")
    assert load(write_protocol(tmp_path, prompts={"token_file": {"path": "../ids.json", "count": 1}})).body["prompts"] == {
        "token_file": {"path": "../ids.json", "sha256": digest, "count": 1}}
    (tmp_path / "ids.json").write_text("[[2, 3, 4, 5], [2, 3]]")
    assert refusal("../ids.json") == "`prompts.token_file`: prompt 1 of ../ids.json has 2 ids, fewer than prefix_tokens=4"


def test_a_synth_spec_gives_back_the_frozen_model_synth():
    """`SynthSpec.as_dict` is what the worker generates the checkpoint from: the frozen
    `model.synth` as it stands, for the uniform recipe and for a profile."""
    for synth in ({"shape": "tiny", "dtype": "float32", "sparsity": 0.9, "seed": 3, "hot_fraction": 0.1, "hot_bias": 2.0},
                  {"shape": "tiny", "dtype": "float16", "seed": 4, "profile": "opt"}):
        frozen = freeze(v2(model={"synth": synth}))
        assert frozen.body["model"]["synth"] == synth
        assert frozen.protocol.model.synth.as_dict() == synth and not frozen.protocol.model.synth.is_moe


def test_the_typed_protocol_carries_every_frozen_field():
    """`expand` is what the plan, the gates, the worker and the auditor read: each typed field is
    the frozen one (a field dropped or read under another key would go unnoticed by the hash)."""
    from packbench.core.protocol import Comparison, UsefulLatency

    sha = "ab" * 32
    data = raw()
    data.update(model={"path": "m", "sha256": sha}, baseline_first=False, recording=False,
                prompts={"token_ids": [[2] * 32, [3] * 32]})
    data["gates"] = {"resources": {}, "runtime": [{"control": "dense-stream", "max_ratio": 0.8, "phase": "decode",
                                                    "confidence": 0.9, "resamples": 200, "seed": 7}],
                     "useful_latency": {"max_first_episode_s": 5, "max_cold_start_s": 20}}
    p = expand(freeze(data).body)
    assert (p.model.path, p.model.sha256, p.model.synth) == ("m", sha, None)
    assert (p.baseline_first, p.recording) == (False, False)
    assert (p.prompts.source, p.prompts.count, p.prompts.token_ids) == ("token_ids", 2, ((2,) * 32, (3,) * 32))
    g = p.gates
    assert (g.faithfulness_tolerance, g.resources, g.capacity, g.acquisition, g.fidelity) == (None, True, False, (), ())
    assert g.runtime == (Comparison(control="dense-stream", phase="decode", max_ratio=0.8, confidence=0.9,
                                    resamples=200, seed=7),)
    assert g.useful_latency == UsefulLatency(max_first_episode_s=5.0, max_cold_start_s=20.0)
    q = expand(freeze(raw()).body).gates  # the quickstart's: faithfulness and acquisition only
    assert (q.faithfulness_tolerance, q.resources, q.capacity, q.runtime, q.useful_latency) == (0.0, False, False, (), None)
    assert q.acquisition == (Comparison(control="dense-stream", phase="all", max_ratio=0.5),)
    d = raw()
    d["gates"] = {"capacity": {}}
    assert (expand(freeze(d).body).gates.capacity, expand(freeze(d).body).gates.resources) == (True, False)
    with pytest.raises(KeyError, match="no condition 'lru' in protocol 'quickstart'"):
        p.condition("lru")


def test_a_prompt_files_typed_spec_keeps_its_path_and_digest():
    sha = "cd" * 32
    p = expand(validate(v2(prompts={"token_file": {"path": "ids.json", "sha256": sha, "count": 3}})))
    assert (p.prompts.source, p.prompts.count, p.prompts.path, p.prompts.sha256, p.prompts.token_ids) == (
        "token_file", 3, "ids.json", sha, None)


@pytest.mark.parametrize("change, refusal", [
    (lambda d: d["gates"].update(acquisition={"max_ratio": 0.5}), "`gates.acquisition.control`: is required"),
    (lambda d: d.update(conditions=[{"policy": "dense-stream"}],
                        gates={"acquisition": {"control": "dense-stream", "max_ratio": 0.5}}),
     "`gates.acquisition.control`: 'dense-stream' has no other condition to compare with"),
    (lambda d: _runtime(d, seed=2**63), "`gates.runtime.seed`: 9223372036854775808 is not an integer in "
                                        "[0, 9223372036854775807]"),
    (lambda d: d.update(engine={"turbo": 1}), "`engine.turbo`: unknown field; allowed fields are mode"),
    (lambda d: d.update(engine="graph"), "`engine`: expected a mapping, got 'graph'"),
    (lambda d: d.update(placement={"accelerator_type": ""}),
     "`placement.accelerator_type`: '' is not allowed; expected a GPU type, e.g. H200"),
    (lambda d: d.update(placement={"node": 5}), "`placement.node`: 5 is not allowed; expected a Ray node id (`ray list nodes`)"),
    (lambda d: d.update(model=v2()["model"], conditions=[{"policy": "dense-stream"},
                                                         {"policy": "packet", "params": {"gather": "mapped"}}]),
     "`conditions[1].params.gather`: mapped gathers an MoE model's experts; the synthetic tiny shape is OPT, whose "
     "device gather already reads mapped host memory: use gather device"),
    (lambda d: d.update(model=v2()["model"], prefix_tokens=250),
     "`prefix_tokens`: prefix_tokens 250 + continuation_tokens 8 - 1 = 257 positions, but the synthetic tiny shape "
     "has 256; lower prefix_tokens or continuation_tokens"),
])
def test_refusals_word_for_word(change, refusal):
    data = raw()
    change(data)
    assert refusal_of(data) == f"protocol field {refusal}"


def test_an_episode_may_reach_the_last_position_of_a_synthetic_shape_and_a_node_is_kept():
    """tiny has 256 positions: 249 prompt tokens and 8 generated (the last never fed back) fit."""
    assert freeze(v2(prefix_tokens=249)).body["prefix_tokens"] == 249
    pinned = freeze(v2(placement={"node": "n1"}))
    assert pinned.body["placement"] == {"node": "n1"} and expand(pinned.body).placement.node == "n1"


@pytest.mark.parametrize("change, refusal", [
    (lambda d: d["gates"].update(useful_latency={"max_cold_start_s": 20}),
     "`gates.useful_latency.max_first_episode_s`: is required"),
    (lambda d: d["gates"].update(useful_latency={"max_first_episode_s": 0, "max_cold_start_s": 20}),
     "`gates.useful_latency.max_first_episode_s`: 0 is not a finite number > 0.0"),
    (lambda d: d.update(gates={}),
     "`gates`: declare at least one gate: faithfulness, resources, capacity, acquisition, runtime, useful_latency, fidelity"),
    (lambda d: d.update(prompts={"seeds": 1}),
     "`prompts.seeds`: unknown field; allowed fields are generator, text_file, token_file, token_ids"),
    (lambda d: d.update(prompts={}), "`prompts`: give exactly one of token_ids, token_file, text_file, generator; got none"),
    (lambda d: d.update(prompts={"token_ids": [[2] * 32], "generator": {"seed": 0, "count": 1}}),
     "`prompts`: give exactly one of token_ids, token_file, text_file, generator; got token_ids, generator"),
    (lambda d: d.update(prompts={"generator": {"seed": 0, "count": 1, "n": 2}}),
     "`prompts.generator.n`: unknown field; allowed fields are count, seed"),
    (lambda d: d.update(prompts={"generator": {"count": 1}}), "`prompts.generator.seed`: is required"),
    (lambda d: d.update(prompts={"generator": {"seed": 0}}), "`prompts.generator.count`: is required"),
    (lambda d: d.update(prompts={"generator": {"seed": 2**63, "count": 1}}),
     "`prompts.generator.seed`: 9223372036854775808 is not an integer in [0, 9223372036854775807]"),
    (lambda d: d.update(prompts={"token_ids": []}),
     "`prompts.token_ids`: [] is not allowed; expected a non-empty list of token-id lists"),
    (lambda d: d.update(prompts={"token_ids": [[2] * 32, [2, 3]]}),
     "`prompts.token_ids[1]`: has 2 ids, fewer than prefix_tokens=32"),
    (lambda d: d.update(prompts={"token_ids": [[2] * 65_537]}), "`prompts.token_ids[0]`: has 65537 ids, more than 65536"),
    (lambda d: d.update(prefix_tokens=1, prompts={"token_ids": [[2]] * 100_001}),
     "`prompts.token_ids`: 100001 prompts, more than 100000"),
    (lambda d: d.update(warmups=100_001), "`warmups`: 100001 is not an integer in [0, 100000]"),
    (lambda d: d.update(warmups={"dense-stream": 1, "packet": 100_001}),
     "`warmups.packet`: 100001 is not an integer in [0, 100000]"),
])
def test_gate_prompt_and_warmup_refusals_word_for_word(change, refusal):
    data = raw()
    change(data)
    assert refusal_of(data) == f"protocol field {refusal}"


def test_prompt_lists_and_latency_bounds_at_their_edges():
    """65,536 ids in a prompt and 100,000 prompts are allowed; a latency bound only needs to be
    above 0."""
    from tests.core.test_protocol_schema4 import TINY, protocol

    data = raw()
    data["prompts"] = {"token_ids": [[2] * 65_536]}
    assert len(freeze(data).body["prompts"]["token_ids"][0]) == 65_536
    many = protocol(TINY, prefix_tokens=1, prompts={"token_ids": [[2]] * 100_000}, scored_prompts=1)
    assert len(freeze(many).body["prompts"]["token_ids"]) == 100_000
    data = raw()
    data["gates"]["useful_latency"] = {"max_first_episode_s": 0.5, "max_cold_start_s": 0.25}
    assert freeze(data).body["gates"]["useful_latency"] == {"max_first_episode_s": 0.5, "max_cold_start_s": 0.25}


UNIFORM = {"shape": "tiny", "dtype": "float32", "seed": 0, "sparsity": 0.9}


@pytest.mark.parametrize("model, refusal", [
    ({"path": "m", "x": 1}, "`model.x`: unknown field; allowed fields are path, sha256, synth"),
    ({"synth": UNIFORM, "sha256": "ab" * 32},
     "`model.sha256`: pins a model.path checkpoint's content (a synthetic model is pinned by its spec)"),
    ({"path": ""}, "`model.path`: '' is not allowed; expected a path to a local Hugging Face OPT directory"),
    ({"path": "m", "sha256": "AB" * 32}, f"`model.sha256`: '{'AB' * 28}... is not allowed; expected 64 lowercase hex digits"),
    ({"path": "m", "sha256": 5}, "`model.sha256`: 5 is not allowed; expected 64 lowercase hex digits"),
    ({"synth": 5}, "`model.synth`: expected a mapping, got 5"),
    *[({"synth": {k: v for k, v in UNIFORM.items() if k != key}}, f"`model.synth.{key}`: is required")
      for key in ("shape", "dtype", "seed")],
])
def test_model_refusals_word_for_word(model, refusal):
    assert refusal_of(v2(model=model)) == f"protocol field {refusal}"


@pytest.mark.parametrize("conditions, refusal", [
    ("dense-stream", "`conditions`: 'dense-stream' is not allowed; expected a non-empty list of {name, policy, params}"),
    ([], "`conditions`: [] is not allowed; expected a non-empty list of {name, policy, params}"),
    ([{"policy": "dense-stream"}, {"policy": "packet", "x": 1}],
     "`conditions[1].x`: unknown field; allowed fields are name, params, policy"),
    ([{"policy": "dense-stream"}, {"name": "p"}], "`conditions[1].policy`: is required"),
    ([{"policy": "dense-stream"}, {"policy": "packet", "name": "p" * 201}],
     "`conditions[1].name`: 201 characters, more than 200; give a shorter name"),
    ([{"policy": "dense-stream"}, {"policy": "packet", "params": "x"}], "`conditions[1].params`: expected a mapping, got 'x'"),
    ([{"policy": "dense-stream"}, {"policy": "packet", "params": {"rows": 1}}],
     "`conditions[1].params.rows`: unknown param; policy packet takes gather, weights"),
    ([{"policy": "dense-stream"}, {"policy": "expert-forecast", "params": {"x": 1}}],
     "`conditions[1].params.x`: unknown param; policy expert-forecast takes no params"),
])
def test_condition_refusals_word_for_word(conditions, refusal):
    assert refusal_of(v2(conditions=conditions, reference="dense-stream")) == f"protocol field {refusal}"


def test_conditions_at_their_bounds_and_every_integer_default_written_out():
    """16 conditions and a 200-character name are allowed; an integer parameter's default is
    written into the body even after an optional one left to the worker (flexgen's)."""
    from tests.core.test_protocol_schema4 import TINY, protocol

    sixteen = [{"policy": "dense-stream"}] + [{"name": f"p{i}", "policy": "packet"} for i in range(15)]
    assert len(freeze(v2(conditions=sixteen, warmups=1)).body["conditions"]) == 16
    named = freeze(v2(conditions=[{"policy": "dense-stream"}, {"policy": "packet", "name": "p" * 200}], warmups=1))
    assert named.body["conditions"][1]["name"] == "p" * 200
    flexgen = freeze(protocol(TINY, conditions=[{"policy": "dense-stream"}, {"policy": "flexgen"}]))
    assert flexgen.body["conditions"][1]["params"] == {"cache_gpu_percent": 100, "mode": "eager"}


REQUIRED = ("name", "model", "dtype", "prompts", "prefix_tokens", "continuation_tokens", "conditions", "reference",
            "allowance_mib")


@pytest.mark.parametrize("change, refusal", [
    *[(lambda d, key=key: d.pop(key), f"`{key}`: is required") for key in REQUIRED],
    (lambda d: d.update(name=""), "`name`: '' is not allowed; expected a non-empty string of at most 200 characters"),
    (lambda d: d.update(name="n" * 201),
     "`name`: 201 characters, more than 200; expected a non-empty string of at most 200 characters"),
    (lambda d: d.update(allowance_mib=2**24 + 1), "`allowance_mib`: 16777217 is not an integer in [1, 16777216]"),
    (lambda d: d.update(recording="yes"), "`recording`: 'yes' is not allowed; use true or false"),
    (lambda d: d.update(trace="yes"), "`trace`: 'yes' is not allowed; use true or false"),
    (lambda d: d.update(trace=True, recording=False),
     "`trace`: needs recording: true (a trace is recorded with the ledger); drop recording: false or trace"),
    (lambda d: d.update(trace=True, engine={"mode": "graph"}),
     "`trace`: needs engine mode eager (a captured graph step runs no hooks to read the active sets); drop "
     "engine.mode or trace"),
])
def test_top_level_refusals_word_for_word(change, refusal):
    data = v2()
    change(data)
    assert refusal_of(data) == f"protocol field {refusal}"


def test_trace_is_frozen_only_when_true():
    """trace: true (recording on, eager) is a meaning of its own; false or absent keeps the body."""
    base = freeze(v2())
    traced = freeze(v2(trace=True))
    assert traced.body["trace"] is True and traced.sha256 != base.sha256 and expand(traced.body).traced
    assert freeze(v2(trace=True, recording=True)).sha256 == traced.sha256
    assert freeze(v2(trace=False)).sha256 == base.sha256 and "trace" not in base.body and not expand(base.body).traced


def test_schema_1_refuses_a_condition_parameter_as_a_schema_2_field():
    data = raw()
    data["schema"] = 1
    data["conditions"].append({"policy": "sparse-extents", "params": {"block_rows": 64}})
    with pytest.raises(ProtocolError) as e:
        freeze(data)
    assert str(e.value) == ("protocol field `schema`: 1 cannot express this protocol (it uses schema-2 fields); write "
                            "schema: 2 or drop the field")


def test_a_field_schema_1_cannot_say_moves_the_body_out_of_schema_1():
    """schema1_form must refuse every field schema 1 has no word for (the field would be dropped
    from the frozen body, and the hash with it); a protocol with only the faithfulness gate is
    still schema 1 (its acquisition gate is absent, not `phase: all`)."""
    def frozen(**changes) -> dict:
        data = raw()
        data.update(changes)
        return freeze(data).body

    only_faithfulness = frozen(gates={"faithfulness": {"tolerance": 0.0}})
    assert only_faithfulness["schema"] == 1 and only_faithfulness["gates"] == {"faithfulness": {"tolerance": 0.0}}
    pinned = frozen(model={"path": "m", "sha256": "ab" * 32})
    assert (pinned["schema"], pinned["model"]) == (2, {"path": "m", "sha256": "ab" * 32})
    assert (frozen(trace=True)["schema"], frozen(trace=True)["trace"]) == (2, True)
    # conditions whose params stay empty in schemas 6 and 7 (packet's gather is written out there)
    plain = [{"policy": "dense-stream"}, {"policy": "resident"}]
    batched = frozen(schema=6, batch=2, conditions=plain)
    assert (batched["schema"], batched["batch"]) == (6, 2)
    separate = frozen(schema=7, passes="separate", conditions=plain)
    assert (separate["schema"], separate["passes"]) == (7, "separate")


def test_a_frozen_protocol_says_which_schema_it_was_read_as():
    """`protocol validate` prints "read as schema N, frozen as schema M": N is the file's `schema:`,
    or the newest when it has none."""
    from packbench.core.protocol import SCHEMA_VERSION

    assert (freeze(raw()).read_as, freeze(raw()).body["schema"]) == (2, 1)
    unsaid = raw()
    unsaid.pop("schema")
    assert freeze(unsaid).read_as == SCHEMA_VERSION


def test_a_float_schema_is_refused_as_no_schema():
    """The bug caught: `schema: 2.0` (and 5.0) passed, since 2.0 == 2 made it one of the schemas
    read, and `protocol validate` said "read as schema 2.0"; every other integer field refuses a
    float."""
    for value in (2.0, 5.0, 11.0):
        assert refusal_of(v2(schema=value)) == (
            f"protocol field `schema`: {value} is not supported; this packbench reads schema 1, 2, 3, 4, 5, 6, 7, 8, "
            f"9, 10 and 11 (omit `schema:` for the newest, 11)")
