"""The protocol's promises at their edges: every field that carries meaning is covered by the
hash (the frozen body), and the work bounds of docs/protocol.md ("Bounds") refuse a protocol
one past them and accept one at them."""

import copy
import importlib

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
    # A checkpoint by path: its positions are its config.json's, checked at submit, so the bound
    # tested here is the only one (a synthetic shape's 256 positions would refuse first).
    data.update(model={"path": "checkpoints/long-context"}, prompts={"generator": {"seed": 0, "count": count}},
                prefix_tokens=prefix, repetitions=1, warmups=0, conditions=data["conditions"][:2])
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


# ----------------------------------------------------------------------------- the YAML file's own bounds (freeze.load)


def _parsed(text: str):
    from packbench.core.protocol.freeze import _parse
    return _parse(text, "p.yaml")


def _refusal(text: str) -> str:
    with pytest.raises(ProtocolError) as e:
        _parsed(text)
    return str(e.value)


def test_nesting_is_refused_one_level_past_32_with_its_line():
    """Lists and mappings nested 32 deep parse; 33 are refused, naming the line. Catches the
    depth compared with >= or counted from another level."""
    nested: list = []
    for _ in range(31):
        nested = [nested]
    assert _parsed("[" * 32 + "]" * 32) == nested
    deep = "\n" * 2 + "[" * 33 + "]" * 33
    assert _refusal(deep) == ("protocol line 3: values nest deeper than 32 levels, the limit; a protocol nests 4 "
                              "(see docs/protocol.md)")
    assert _parsed("a: " + "{b: " * 31 + "1" + "}" * 31) is not None  # 32 mappings
    assert "nest deeper than 32 levels" in _refusal("a: " + "{b: " * 32 + "1" + "}" * 32)


def test_an_alias_nests_as_deep_as_what_it_repeats():
    """An alias counts the levels of the collection it repeats, where it stands. Catches the
    anchor's levels lost, counted from the wrong depth, or not kept per open collection."""
    anchored = "[" * 30 + "]" * 30  # 30 levels
    ok = f"a: &x {anchored}\nb: *x\n"  # 1 (mapping) + 30
    assert _parsed(ok)["b"] == _parsed(ok)["a"]
    assert _parsed(f"a: &x {anchored}\nb: [*x]\n") is not None  # 1 + 1 + 30 = 32
    assert _refusal(f"a: &x {anchored}\nb: [[*x]]\n") == (
        "protocol line 2: values nest deeper than 32 levels, the limit; a protocol nests 4 (see docs/protocol.md)")
    # the anchor's depth is its own, not that of what came before it at its level
    inner = "[" * 28 + "]" * 28
    assert _parsed(f"a: [{inner}, &y [1]]\nb: [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[*y]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n") \
        is not None  # y is 1 level: 1 + 30 + 1 = 32


def test_values_are_counted_with_what_each_alias_repeats(monkeypatch):
    """Every collection and scalar counts one, an alias what its anchor holds (a scalar one).
    At the limit the file parses; one past it is refused at the line that passes it."""
    freeze_module = importlib.import_module("packbench.core.protocol.freeze")
    text = "a: &x [1, 2, 3]\nb: [*x, *x]\nc: &y 5\nd: [*y]\n"
    # mapping 1, a 1, [1,2,3] 4, b 1, [..] 1, 2 x 4, c 1, 5 1, d 1, [..] 1, *y 1 = 21
    monkeypatch.setattr(freeze_module, "MAX_VALUES", 21)
    assert _parsed(text) == {"a": [1, 2, 3], "b": [[1, 2, 3], [1, 2, 3]], "c": 5, "d": [5]}
    monkeypatch.setattr(freeze_module, "MAX_VALUES", 20)
    assert _refusal(text) == ("protocol line 4: the file expands to more than 20 values, the limit (YAML aliases "
                              "count as what they repeat); write the values out, or put a large prompt set in "
                              "prompts.token_file")
    monkeypatch.setattr(freeze_module, "MAX_VALUES", 15)
    assert "line 2: the file expands to more than 15 values" in _refusal(text)  # the second *x passes 15


def test_integers_have_at_most_100_digits():
    assert _parsed("a: " + "9" * 100) == {"a": int("9" * 100)}
    assert _refusal("\na: " + "9" * 101) == ("protocol line 2: an integer written with 101 characters; integers "
                                             "have at most 100 digits")


def test_a_key_given_twice_is_named_shown_bounded():
    assert _refusal("x: 1\n\nx: 2\n") == "protocol line 3: key `x` is given twice; keep one"
    long = "k" * 61  # over 60 characters a key is shown cut, quoted
    assert _refusal(f"{long}: 1\n{long}: 2\n") == f"protocol line 2: key `'{'k' * 56}...` is given twice; keep one"
    assert _refusal(f"{long[1:]}: 1\n{long[1:]}: 2\n") == f"protocol line 2: key `{long[1:]}` is given twice; keep one"
    assert _refusal("1: a\n1: b\n") == "protocol line 2: key `1` is given twice; keep one"
    assert _parsed("k" * 60 + ": 1\n" + "k" * 59 + ": 2\n") == {"k" * 60: 1, "k" * 59: 2}


def test_a_protocol_file_that_cannot_be_read_as_yaml_says_why(tmp_path, monkeypatch):
    from packbench.core.protocol import load
    freeze_module = importlib.import_module("packbench.core.protocol.freeze")
    missing = tmp_path / "none.yaml"
    with pytest.raises(ProtocolError) as e:
        load(missing)
    assert str(e.value) == (f"no protocol file at {missing}; pass the path of a protocol YAML (see "
                            f"protocols/quickstart.yaml)")
    p = tmp_path / "p.yaml"
    for text, why in (("# only a comment\n", f"{p} holds no protocol (it is empty or only comments); write its "
                                             f"fields, see protocols/quickstart.yaml"),
                      ("- a\n- b\n", f"{p} holds a YAML list, not a protocol; a protocol is a mapping of fields "
                                     f"(name:, model:, ...), see protocols/quickstart.yaml"),
                      ("a: [1, 2\nb: 3\n", f"{p} is not valid YAML at line 2; fix the syntax")):
        p.write_text(text)
        with pytest.raises(ProtocolError) as e:
            load(p)
        assert str(e.value) == why, text
    p.write_bytes(b"a: \xff\n")
    with pytest.raises(ProtocolError) as e:
        load(p)
    assert str(e.value) == f"{p} is not UTF-8 text (byte 0xff at offset 3); save it as UTF-8"
    with pytest.raises(ProtocolError) as e:
        load(tmp_path)
    assert str(e.value) == (f"the protocol {tmp_path} is a directory, not a regular file; pass the path of a "
                            f"protocol YAML file (see protocols/quickstart.yaml)")
    monkeypatch.setattr(freeze_module, "MAX_PROTOCOL_BYTES", 1 << 20)
    p.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(ProtocolError) as e:
        load(p)
    assert str(e.value) == (f"{p} is {(1 << 20) + 1} bytes; a protocol file is at most 1 MiB (put a large prompt "
                            f"set in prompts.token_file)")


def test_a_protocol_file_the_os_will_not_read_names_the_os_reason(tmp_path, monkeypatch):
    """An OSError other than the bounded read's own (permission denied, an I/O error) is one line
    with the OS's words. The tests run as root, whom permissions do not stop, so the read is made
    to fail. Would catch the reason left out or the error escaping as a traceback."""
    freeze_module = importlib.import_module("packbench.core.protocol.freeze")
    p = tmp_path / "p.yaml"
    p.write_text("name: x\n")

    def denied(path, limit):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(freeze_module, "read_bounded", denied)
    with pytest.raises(ProtocolError) as e:
        freeze_module.load(p)
    assert str(e.value) == f"cannot read the protocol file {p} (Permission denied); check its permissions"


def test_a_relative_model_path_of_a_protocol_without_a_file_is_read_from_the_working_directory(tmp_path,
                                                                                              monkeypatch):
    """A protocol frozen from data (no source file) resolves a relative model.path against the
    working directory; with a source file, against the file's folder; an absolute path stays
    itself. Would catch the source file's folder used when there is none (a crash)."""
    import dataclasses

    def frozen_with(model_path: str):
        return freeze({"name": "rel", "model": {"path": model_path}, "dtype": "float32",
                       "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 4,
                       "continuation_tokens": 2, "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}],
                       "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}})

    monkeypatch.chdir(tmp_path)
    here = tmp_path.resolve()
    elsewhere = tmp_path / "protocols" / "p.yaml"
    assert frozen_with("ckpt").model_dir() == here / "ckpt"
    assert dataclasses.replace(frozen_with("ckpt"), source=elsewhere).model_dir() == here / "protocols" / "ckpt"
    assert dataclasses.replace(frozen_with(str(here / "abs")), source=elsewhere).model_dir() == here / "abs"


def test_an_unknown_alias_or_a_character_yaml_refuses_is_invalid_yaml():
    """Catches the alias count crashing on an alias with no anchor, and the message crashing on
    a YAML error without a position."""
    assert _refusal("a: 1\nb: *nope\n") == "p.yaml is not valid YAML at line 2; fix the syntax"
    assert _refusal("a: \x07\n") == "p.yaml is not valid YAML; fix the syntax"


def test_an_alias_of_a_scalar_nests_no_deeper_than_where_it_stands():
    assert _parsed("a: &s 1\nb: " + "[" * 31 + "*s" + "]" * 31 + "\n") is not None  # 1 + 31 levels


def test_an_anchors_levels_are_its_own_whatever_nested_before_it():
    """A two-level anchor after a deeper collection elsewhere: its alias adds two levels, no more
    and no fewer. Catches a collection's depth passed to the wrong parent or read from a deeper
    collection that ended before it."""
    for before in ("", "p: [[[[[[[1]]]]]]]\n"):
        text = before + "a: &x [[1]]\nb: " + "[" * 29 + "*x" + "]" * 29 + "\n"  # 1 + 29 + 2 = 32
        assert _parsed(text)["b"] is not None
        deeper = before + "a: &x [[1]]\nb: " + "[" * 30 + "*x" + "]" * 30 + "\n"
        assert "nest deeper than 32 levels" in _refusal(deeper)


def test_a_collection_as_a_key_is_refused_on_one_line():
    """YAML allows a list or a mapping as a key (`? [1, 2]`); the loader refused it with a
    TypeError from the duplicate check, a crash. Found by a mutant of that check."""
    assert _refusal("a: 1\n? [1, 2]\n: x\n") == "protocol line 2: key `[1, 2]` is a list; a protocol's keys are names"
    assert _refusal("{{a: 1}: 2}\n") == "protocol line 1: key `{'a': 1}` is a dict; a protocol's keys are names"


# ----------------------------------------------------------------------------- prompt files and token lists


def test_prompt_file_refusals_name_the_field_the_file_and_the_fix(tmp_path):
    """A directory, a missing file, lists nested too deep, bytes that are not UTF-8: each named
    by its field (a command's option as given, a protocol's field quoted), the path and the fix.
    Catches any of them losing its words."""
    from packbench.core.protocol import read_prompt_file

    def refusal(kind, path, field):
        with pytest.raises(ProtocolError) as e:
            read_prompt_file(kind, path, field=field)
        return str(e.value)

    assert refusal("token_file", tmp_path, "prompts.token_file") == (
        f"protocol field `prompts.token_file`: {tmp_path} is a directory, not a regular file; give a token file of "
        f"prompts (a regular file of at most 64 MiB)")
    assert refusal("text_file", tmp_path, "--prompts") == (
        f"--prompts: {tmp_path} is a directory, not a regular file; give a text file of prompts (a regular file of "
        f"at most 64 MiB)")
    missing = tmp_path / "missing.txt"
    assert refusal("text_file", missing, "--prompts") == f"--prompts: cannot read {missing} (No such file or directory)"
    assert refusal("text_file", missing, "prompts.text_file") == (
        f"protocol field `prompts.text_file`: cannot read {missing} (No such file or directory); paths are relative "
        f"to the protocol file")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert refusal("token_file", deep, "prompts.token_file") == (
        f"protocol field `prompts.token_file`: {deep} nests its lists too deeply; write a list of token-id lists")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a\xffb")
    assert refusal("text_file", bad, "prompts.text_file") == f"protocol field `prompts.text_file`: {bad} is not UTF-8 text"


def test_token_lists_are_non_empty_lists_of_non_empty_lists():
    from packbench.core.protocol.fields import token_lists_field
    for ids, why in (([], "protocol field `p`: [] is not allowed; expected a non-empty list of token-id lists"),
                     ("x", "protocol field `p`: 'x' is not allowed; expected a non-empty list of token-id lists"),
                     ([[1], []], "protocol field `p[1]`: [] is not allowed; expected a non-empty list of token ids"),
                     ([[1], "a"], "protocol field `p[1]`: 'a' is not allowed; expected a non-empty list of token ids")):
        with pytest.raises(ProtocolError) as e:
            token_lists_field(ids, "p")
        assert str(e.value) == why
    assert token_lists_field([[1, 2], [3]], "p") == [[1, 2], [3]]


def test_a_text_file_splits_on_separator_lines_keeping_each_prompts_lines():
    from packbench.core.protocol import split_texts
    assert split_texts("a\nb\n---\nc\n  ---  \n\n---\nd\ne") == ["a\nb", "c", "d\ne"]


def test_a_text_file_without_text_is_refused_by_its_field(tmp_path):
    from packbench.core.protocol import read_prompt_file
    empty = tmp_path / "empty.txt"
    empty.write_text("\n---\n  \n---\n")
    with pytest.raises(ProtocolError) as e:
        read_prompt_file("text_file", empty, field="prompts.text_file")
    assert str(e.value) == (f"protocol field `prompts.text_file`: {empty} holds no text; write prompts separated by "
                            f"`---` lines")


# ----------------------------------------------------------------------------- the cross-checks' bounds, at their edges


def _quickstart(**changes) -> dict:
    from tests.core.test_protocol import v2
    return v2(**changes)


def _refusal_of(data: dict) -> str:
    with pytest.raises(ProtocolError) as e:
        freeze(data)
    return str(e.value).removeprefix("protocol field ")


ONE_PROMPT = {"generator": {"seed": 0, "count": 1}}


def test_episodes_are_bounded_at_100000_and_traced_ones_at_75000():
    # 2 warmups + 49,999 repetitions x 1 prompt x 2 conditions = 100,000: at the bound
    assert freeze(_quickstart(prompts=ONE_PROMPT, repetitions=49_999)).body["repetitions"] == 49_999
    assert _refusal_of(_quickstart(prompts=ONE_PROMPT, repetitions=50_000)) == (
        "`repetitions`: the plan would hold 100002 episodes, more than 100000; split the screen into shorter protocols")
    assert freeze(_quickstart(prompts=ONE_PROMPT, repetitions=37_500, warmups=0, trace=True)).body["trace"] is True
    assert _refusal_of(_quickstart(prompts=ONE_PROMPT, repetitions=37_500, warmups={"dense-stream": 1, "packet": 0},
                                   trace=True)) == (
        "`trace`: the plan would hold 75001 episodes; a traced screen archives 4 members an episode and an archive "
        "holds at most 3 x 100000 + 5, so at most 75000: split the screen")


def test_100000_prompts_are_allowed_when_few_are_scored():
    from tests.core.test_protocol_schema4 import TINY, protocol
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": MAX_PROMPTS}}, prefix_tokens=20, scored_prompts=1)
    assert freeze(raw).body["prompts"]["generator"]["count"] == MAX_PROMPTS  # 2,000,000 prompt tokens


def test_batch_times_continuation_is_bounded_at_8192_logits_rows():
    from tests.core.test_protocol import raw
    data = raw()
    data.update(schema=6, batch=2, continuation_tokens=4096)
    assert freeze(data).body["batch"] == 2
    data.update(continuation_tokens=4097)
    assert _refusal_of(data) == ("`batch`: 2 x 4097 continuation tokens keep 8194 logits rows an episode, more than "
                                 "8192; lower batch or continuation_tokens")


def test_runtime_bootstrap_draws_are_bounded_at_2_to_the_27():
    """resamples x pairs (repetitions x scored prompts) x compared conditions: 65,536 x (512 x 2) x 2
    is 2**27 and freezes; one repetition more does not."""
    def screen(repetitions: int) -> dict:
        data = _quickstart(prompts={"generator": {"seed": 0, "count": 2}}, repetitions=repetitions,
                           conditions=[{"policy": "dense-stream"}, {"policy": "packet"}, {"policy": "sparse-extents"}])
        data["gates"] = {"runtime": {"control": "dense-stream", "max_ratio": 0.9, "resamples": 65_536}}
        return data
    assert freeze(screen(512)).body["repetitions"] == 512
    assert _refusal_of(screen(513)) == (
        "`gates.runtime`: the runtime bootstraps would draw 134479872 pair indices (resamples x pairs x compared "
        "conditions), more than 134217728; lower resamples")


def test_cross_check_refusals_word_for_word():
    from tests.core.test_protocol_schema4 import TINY, protocol
    from tests.core.test_protocol_schema5 import competitor
    assert _refusal_of(protocol(TINY, prompts={"generator": {"seed": 0, "count": 4}}, scored_prompts=5)) == (
        "`scored_prompts`: 5 scored prompts, but the protocol declares 4 prompts; declare more prompts or lower "
        "scored_prompts")
    assert _refusal_of(competitor(baseline_first=False)) == (
        "`gates.fidelity`: needs baseline_first: true (each approximate episode is teacher-forced on the tokens of "
        "its block's reference episode, which must run first)")
    assert _refusal_of(_quickstart(conditions=[{"policy": "dense-stream"},
                                               {"policy": "expert-cache", "params": {"capacity": 1}}])) == (
        "`conditions[1].policy`: 'expert-cache' does not fit the synthetic tiny shape, an OPT model; use one of "
        "resident, dense-stream, sparse-extents, packet, phase-switched, row-retention, early-forecast, quantized, "
        "accelerate, zero-inference, flexgen")


def test_text_prompts_need_a_checkpoints_tokenizer_word_for_word(tmp_path):
    import yaml

    from packbench.core.protocol import load
    (tmp_path / "t.txt").write_text("hello world\n")
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(_quickstart(prompts={"text_file": "t.txt"})))
    with pytest.raises(ProtocolError) as e:
        load(f)
    assert str(e.value) == ("protocol field `prompts.text_file`: needs model.path: the checkpoint's tokenizer encodes "
                            "the text (a synthetic model has none); use token_file or generator")


def test_field_checks_show_values_and_choices_bounded():
    """A refusal shows at most 40 choices and says how many more, a choice or a value over 60
    characters cut to 60; a string at its length bound is allowed, one holding NUL is not."""
    from packbench.core.protocol.fields import choice_field, int_field, string_field

    def refusal(check, *args, **kwargs) -> str:
        with pytest.raises(ProtocolError) as e:
            check(*args, **kwargs)
        return str(e.value).removeprefix("protocol field ")

    forty = ", ".join(f"c{i}" for i in range(40))
    assert refusal(choice_field, "x", "p", tuple(f"c{i}" for i in range(41))) == (
        f"`p`: 'x' is not allowed; use one of {forty} (and 1 more)")
    assert refusal(choice_field, "x", "p", tuple(f"c{i}" for i in range(40))) == f"`p`: 'x' is not allowed; use one of {forty}"
    assert refusal(choice_field, "x", "p", ("a" * 60, "b" * 61)) == (
        f"`p`: 'x' is not allowed; use one of {'a' * 60}, '{'b' * 56}...")
    assert refusal(int_field, "x", "p", minimum=0) == "`p`: 'x' is not an integer >= 0"
    assert refusal(int_field, "y" * 100, "p", minimum=0, maximum=3) == f"`p`: '{'y' * 56}... is not an integer in [0, 3]"
    assert string_field("a" * 10, "p", "a name", max_chars=10) == "a" * 10
    assert refusal(string_field, "a\x00b", "p", "a name") == "`p`: 'a\\x00b' holds a NUL character; expected a name"


def test_mapping_field_refusals_name_the_key_bounded_and_the_fix():
    from packbench.core.protocol.fields import mapping_field

    def refusal(value, path, allowed) -> str:
        with pytest.raises(ProtocolError) as e:
            mapping_field(value, path, allowed=allowed)
        return str(e.value)

    assert refusal([1], "", {"a": True}) == "a protocol is a mapping of fields (name:, model:, ...), got [1]"
    assert refusal({"k" * 60: 1}, "p", {"a": False}) == f"protocol field `p.{'k' * 60}`: unknown field; allowed fields are a"
    assert refusal({"k" * 61: 1}, "p", {"a": False}) == (
        f"protocol field `p.'{'k' * 56}...`: unknown field; allowed fields are a")
    assert refusal({5: 1}, "p", {"a": False}) == "protocol field `p.5`: unknown field; allowed fields are a"
    assert refusal({"x": 1}, "gates.resources", {}) == (
        "protocol field `gates.resources.x`: unknown field; `gates.resources` takes none (write `resources: {}`)")
    assert refusal({"x": 1}, "a.b.c", {}) == "protocol field `a.b.c.x`: unknown field; `a.b.c` takes none (write `c: {}`)"
