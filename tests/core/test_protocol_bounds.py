"""The protocol's promises at their edges: every field that carries meaning is covered by the
hash (the frozen body), and the work bounds of docs/protocol.md ("Bounds") refuse a protocol
one past them and accept one at them."""

import copy

import pytest

from packbench.core.errors import ProtocolError
from packbench.core.protocol import freeze
from packbench.core.protocol.schema import MAX_PROMPT_TOKENS, MAX_PROMPTS


def base() -> dict:
    """A schema-3 protocol that spells every field a change of meaning can touch."""
    return {"schema": 3, "name": "meaning",
            "model": {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0}},
            "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 3}},
            "prefix_tokens": 32, "continuation_tokens": 8,
            "conditions": [{"name": "dense-stream", "policy": "dense-stream"},
                           {"name": "packet", "policy": "packet", "params": {"gather": "host"}},
                           {"name": "lru", "policy": "row-retention", "params": {"rows_per_layer": 1024}}],
            "reference": "dense-stream", "warmups": 1, "repetitions": 2, "allowance_mib": 4800,
            "gates": {"faithfulness": {"tolerance": 0.0},
                      "acquisition": {"control": "dense-stream", "max_ratio": 0.5},
                      "runtime": {"control": "dense-stream", "max_ratio": 0.8, "confidence": 0.95,
                                  "resamples": 10000, "seed": 0},
                      "useful_latency": {"max_first_episode_s": 30.0, "max_cold_start_s": 60.0}}}


def _set(path: tuple, value):
    def change(d: dict) -> None:
        node = d
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


# (what changes, how): each one a different meaning, so a different hash
CHANGES = [
    ("allowance_mib", _set(("allowance_mib",), 4801)),
    ("prefix_tokens", _set(("prefix_tokens",), 33)),
    ("continuation_tokens", _set(("continuation_tokens",), 9)),
    ("reference", _set(("reference",), "packet")),
    ("a condition's params", _set(("conditions", 2, "params", "rows_per_layer"), 1025)),
    ("a condition's gather", _set(("conditions", 1, "params", "gather"), "device")),
    ("a condition's policy", _set(("conditions", 2), {"name": "lru", "policy": "sparse-extents"})),
    ("faithfulness tolerance", _set(("gates", "faithfulness", "tolerance"), 1e-6)),
    ("runtime confidence", _set(("gates", "runtime", "confidence"), 0.9)),
    ("runtime resamples", _set(("gates", "runtime", "resamples"), 10001)),
    ("runtime seed", _set(("gates", "runtime", "seed"), 1)),
    ("runtime max_ratio", _set(("gates", "runtime", "max_ratio"), 0.81)),
    ("runtime phase", _set(("gates", "runtime", "phase"), "decode")),
    ("acquisition max_ratio", _set(("gates", "acquisition", "max_ratio"), 0.25)),
    ("acquisition control", _set(("gates", "acquisition", "control"), "packet")),
    ("first-episode bound", _set(("gates", "useful_latency", "max_first_episode_s"), 31.0)),
    ("cold-start bound", _set(("gates", "useful_latency", "max_cold_start_s"), 61.0)),
    ("prompt seed", _set(("prompts", "generator", "seed"), 1)),
    ("prompt count", _set(("prompts", "generator", "count"), 4)),
    ("model seed", _set(("model", "synth", "seed"), 1)),
    ("model sparsity", _set(("model", "synth", "sparsity"), 0.9)),
    ("dtype", _set(("dtype",), "bfloat16")),
    ("warmups", _set(("warmups",), 2)),
    ("repetitions", _set(("repetitions",), 3)),
    ("order", _set(("order",), "abba")),
    ("baseline_first", _set(("baseline_first",), False)),
    ("resources gate", _set(("gates", "resources"), {})),
    ("capacity gate", _set(("gates", "capacity"), {})),
]


def test_every_field_of_meaning_changes_the_hash():
    frozen = freeze(base())
    seen = {frozen.sha256: "base"}
    for what, change in CHANGES:
        data = copy.deepcopy(base())
        change(data)
        h = freeze(data).sha256
        assert h not in seen, f"{what} left the hash as {seen[h]} has it"
        seen[h] = what
    # and a spelling that means the same keeps it (defaults written out)
    data = base()
    data["gates"]["runtime"]["phase"] = "all"
    data["conditions"][0]["params"] = {}
    assert freeze(data).sha256 == frozen.sha256


def test_the_hash_is_the_sha256_of_the_whole_frozen_body():
    """Every key of the body is covered: the hash is of its canonical JSON, nothing left out."""
    import hashlib

    from packbench.core.canonical import canonical_json

    frozen = freeze(base())
    assert frozen.sha256 == hashlib.sha256(canonical_json(frozen.body)).hexdigest()
    assert frozen.body["allowance_mib"] == 4800 and frozen.body["prefix_tokens"] == 32
    assert frozen.body["gates"]["runtime"] == [{"control": "dense-stream", "max_ratio": 0.8, "phase": "all",
                                                "confidence": 0.95, "resamples": 10000, "seed": 0}]


# ----------------------------------------------------------------------------- bounds


def prompts(count: int, prefix: int) -> dict:
    data = base()
    data.update(prompts={"generator": {"seed": 0, "count": count}}, prefix_tokens=prefix, repetitions=1,
                warmups=0, conditions=data["conditions"][:2])
    data["gates"] = {"acquisition": {"control": "dense-stream", "max_ratio": 0.5}}
    return data


def test_prompts_x_prefix_tokens_is_bounded():
    assert MAX_PROMPT_TOKENS == 1 << 21
    # 40,000 prompts of 65,536 tokens: 2.6e9 token ids in plan.json; refused before any is made
    with pytest.raises(ProtocolError, match=r"`prompts`: 40000 prompts of 65536 tokens: more than 100000 prompts "
                                            r"or 2097152 prompt tokens; split the screen"):
        freeze(prompts(40_000, 65_536))
    # at the bound it freezes; one prompt or one token past it does not
    assert freeze(prompts(32, 65_536)).body["prefix_tokens"] == 65_536  # 32 x 65,536 = 2**21
    with pytest.raises(ProtocolError, match="33 prompts of 65536 tokens"):
        freeze(prompts(33, 65_536))
    assert freeze(prompts(64, 32_768)).body["prompts"]["generator"]["count"] == 64
    with pytest.raises(ProtocolError, match="64 prompts of 32769 tokens"):
        freeze(prompts(64, 32_769))


def test_the_prompt_count_is_bounded_on_its_own():
    # 100,001 one-token prompts hold few token ids, but more prompts than the bound
    with pytest.raises(ProtocolError, match=rf"`prompts.generator.count`: {MAX_PROMPTS + 1} is not an integer in "
                                            rf"\[1, {MAX_PROMPTS}\]"):
        freeze(prompts(MAX_PROMPTS + 1, 1))
