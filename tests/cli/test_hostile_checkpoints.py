"""Hostile checkpoint directories: a config.json or model.safetensors that is wrong in type, value
or kind of file is one line naming the file and the fix, exit 2; never a traceback (exit 70 with
torch's, transformers' or safetensors' own error) and never a hang.

Commands run in this process through the console entry point, as tests/cli/test_hostile_input.py's do.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from test_hostile_input import one_line_error, pb


def copy_of(tiny: Path, where: Path, **config) -> Path:
    shutil.copytree(tiny, where)
    if config:
        body = json.loads((where / "config.json").read_text())
        body.update(config)
        (where / "config.json").write_text(json.dumps(body))
    return where


@pytest.mark.parametrize("config, fragment", [
    # Each exited 70 before: transformers or torch raised on the value (or built a million layers).
    ({"num_attention_heads": 3}, "not a multiple of num_attention_heads 3"),
    ({"num_hidden_layers": -1}, "num_hidden_layers is -1"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000"),
    ({"max_position_embeddings": 2**62}, "max_position_embeddings is 4611686018427387904"),
    ({"torch_dtype": [1]}, "torch_dtype is [1]"),
    ({"pad_token_id": 10**6}, "pad_token_id is 1000000"),
    ({"model_type": ["opt"]}, "is a ['opt'] model"),  # unhashable: `in FAMILIES` raised TypeError
])
def test_config_values_torch_or_transformers_refuse_are_one_line(tmp_path, tiny, capsys, config, fragment):
    """Catches config.json values read_config let through to OPTConfig / OPTForCausalLM (hidden 64
    with 3 heads: ValueError; -1 layers: `__len__() should return >= 0`; 2^62 positions: storage
    overflow; a list as torch_dtype: IndexError; a list as model_type: unhashable)."""
    model = copy_of(tiny, tmp_path / "m", **config)
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"), fragment)


@pytest.mark.parametrize("text, fragment", [
    ("[]", "is not a JSON object"), ("null", "is not a JSON object"), ('"opt"', "is not a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "is not JSON"),
])
def test_a_config_json_that_is_no_object_is_one_line(tmp_path, tiny, capsys, text, fragment):
    """Catches `model stats`'s MoE probe (cli/model_moe.py is_moe_dir) calling `.get` on whatever
    config.json held: a list, null or a string was AttributeError, deep nesting RecursionError (exit 70)."""
    model = copy_of(tiny, tmp_path / "m")
    (model / "config.json").write_text(text)
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"),
                   f"{model / 'config.json'} {fragment}")


def test_a_broken_config_json_names_every_family_packbench_runs(tmp_path, tiny, capsys):
    """Catches the fix that said "the JSON object a Hugging Face OPT checkpoint has" to a user whose
    checkpoint is a Mixtral, Qwen3-MoE or OLMoE one (packbench runs those too)."""
    from packbench.core.moe import FAMILIES

    model = copy_of(tiny, tmp_path / "m")
    (model / "config.json").write_text('{"model_type": "mixtral", ')
    line = one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"), "is not JSON")
    assert all(family in line for family in FAMILIES) and "OPT" in line, line


def test_a_config_json_that_is_a_fifo_does_not_hang(tmp_path, tiny, capsys):
    """Catches is_moe_dir's `read_text()` of a config.json that is a FIFO: open() waited for a writer."""
    model = copy_of(tiny, tmp_path / "m")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"), "without config.json")


def _with_header(tiny: Path, where: Path, change) -> Path:
    model = copy_of(tiny, where)
    data = (tiny / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return model


def _first(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("change, fragment", [
    (lambda h: h[_first(h)].update(dtype="F64"), "is not the 66048 bytes its data_offsets span"),
    (lambda h: h[_first(h)].update(shape=[10**12, 10**12]), "is not the 66048 bytes"),
    (lambda h: h[_first(h)].update(shape=[-1]), "a shape lists sizes >= 0"),
    (lambda h: h.update(__metadata__={"a": [1]}), "expected a string"),
    (lambda h: h.pop(_first(h)), "invalid offset"),
])
def test_a_safetensors_header_the_reader_refuses_is_one_line(tmp_path, tiny, capsys, change, fragment):
    """Catches safetensors' own SafetensorError (exit 70) on a header packbench's check passed: a
    dtype or shape that does not make the tensor's byte length, a negative size, metadata that is
    not strings, a gap where a tensor's entry was removed."""
    model = _with_header(tiny, tmp_path / "m", change)
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"),
                   f"{model / 'model.safetensors'} is not a readable safetensors file", fragment)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_safetensors_path_that_is_no_file_is_one_line(tmp_path, tiny, capsys, kind):
    """Catches `open()` of a model.safetensors that is a FIFO (waited for a writer forever) or a
    directory (IsADirectoryError, exit 70)."""
    model = copy_of(tiny, tmp_path / "m")
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors") if kind == "fifo" else (model / "model.safetensors").mkdir()
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"),
                   "model.safetensors is not a readable safetensors file (it is not a regular file)")


# ----------------------------------------------------------------------------- MoE checkpoints


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    from packbench.engine.moe.synth import synth_moe

    return synth_moe(tmp_path_factory.mktemp("moe") / "mixtral", shape="mixtral-tiny", seed=0, dtype="float32",
                     layers=2)


@pytest.mark.parametrize("config, fragment", [
    # transformers built a random layer 2 (or dropped layer 1) and printed a report: exit 0, figures of noise
    ({"num_hidden_layers": 3}, "lacks 9 tensors a mixtral model as config.json describes it has"),
    ({"num_hidden_layers": 1}, "has no place for"),
    # RuntimeError, exit 70; 16 experts where the files hold 8 are refused from the headers, before transformers
    ({"num_local_experts": 16}, "lacks model.layers.0.block_sparse_moe.experts.8.w1.weight (8 of the 16 experts"),
    # transformers reads either name as the other: which count the model got depended on their order in the file
    ({"num_experts": 4}, "num_experts is 4 and num_local_experts 8, two names of one expert count; keep one "
                         "(num_local_experts)"),
    ({"intermediate_size": 100}, "holds 4 tensors in other shapes than config.json gives them (first: "
                                 "'model.layers.0.mlp.experts.down_proj')"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000, more than 4096"),  # built for minutes
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),  # topk's RuntimeError
    ({"head_dim": -1}, "head_dim is -1"),  # a tensor of negative size
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"hidden_act": "nope"}, "hidden_act 'nope' is not an activation"),  # KeyError in ACT2FN
    # StrictDataclassFieldValidationError; its message's lines joined by a space (was a literal "\n")
    ({"rope_parameters": [1]}, "transformers' mixtral config refuses it (Validation error for field "
                               "'rope_parameters': TypeError: Field 'rope_parameters'"),
])
def test_an_moe_checkpoint_its_config_does_not_describe_is_one_line(tmp_path, moe, capsys, config, fragment):
    """Catches `model stats` on an MoE checkpoint handing config.json straight to transformers'
    from_pretrained: tensors the files lack were initialised at random behind a many-line load
    report and the routing of noise printed with exit 0; other values raised transformers' or
    torch's own errors (exit 70) or built a million layers."""
    model = copy_of(moe, tmp_path / "m", **config)
    r = pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1")
    one_line_error(r, str(model), fragment)
    assert "LOAD REPORT" not in r.err and "Loading weights" not in r.err


@pytest.mark.parametrize("config, fragment", [
    # each reached transformers, which allocated the random init of the tensors config.json gave other shapes
    # than the files: petabytes, "DefaultCPUAllocator: can't allocate memory" or "Storage size calculation
    # overflowed" (exit 70); `protocol plan` said to raise allowance_mib to 27670116112900554753
    ({"num_local_experts": 2**40}, "num_local_experts is 1099511627776, more than 65536"),
    ({"hidden_size": 2**40}, "hidden_size is 1099511627776, more than 65536"),
    ({"vocab_size": 2**40}, "vocab_size is 1099511627776, more than 4194304"),
    ({"intermediate_size": 2**40}, "intermediate_size is 1099511627776, more than 1048576"),
    ({"num_attention_heads": 2**40}, "num_attention_heads is 1099511627776, more than 4096"),
    ({"num_experts_per_tok": 2**40}, "num_experts_per_tok is 1099511627776, more than 65536"),
    # head_dim null (transformers: hidden / heads) of 128 heads on 64 units: 0 (ZeroDivisionError, exit 70)
    ({"num_attention_heads": 128, "num_key_value_heads": 1, "head_dim": None},
     "hidden_size 64 is not a multiple of num_attention_heads 128, and no head_dim says the heads' width"),
    ({"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
     "hidden_size 64 is not a multiple of num_attention_heads 3, and no head_dim says the heads' width"),
    # a string, accepted by submit, refused by transformers' config class on the worker: a failed screen
    ({"max_position_embeddings": "256"}, "max_position_embeddings is '256', not a positive integer"),
    ({"max_position_embeddings": 0}, "max_position_embeddings is 0, not a positive integer"),
    ({"max_position_embeddings": 2**40}, "max_position_embeddings is 1099511627776, more than 1073741824"),
])
def test_moe_config_integers_out_of_bounds_are_one_line(tmp_path, moe, capsys, config, fragment):
    """Catches an MoE config.json whose shape integers were checked positive but not bounded, nor
    hidden_size against the heads when head_dim is null, nor max_position_embeddings at all
    (OPT's reader checks all three): exit 70 from torch's allocator or a division, or a screen
    queued to fail at load."""
    model = copy_of(moe, tmp_path / "m", **config)
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"),
                   f"{model / 'config.json'}: {fragment}; fix config.json")


def test_a_mixtral_head_dim_null_of_a_multiple_runs(tmp_path, moe, capsys):
    """transformers' Mixtral reads `head_dim: null` (what its save_pretrained writes) as hidden /
    heads: accepted when that is the checkpoint's width (the head_dim check must not refuse it)."""
    from packbench.engine.config import read_config

    model = copy_of(moe, tmp_path / "m", head_dim=None)
    assert read_config(model)["head_dim"] is None


def submitted(tmp_path, monkeypatch, capsys, model: Path):
    """`packbench submit` of a two-condition protocol on `model` into a fresh database: (its
    result, the screens queued)."""
    import yaml

    from test_hostile_input import ROOT, queued

    from packbench.db.store import Store

    url = f"sqlite:///{tmp_path / 'pb.db'}"
    monkeypatch.setenv("PACKBENCH_DB_URL", url)
    with Store(url) as store:
        store.upgrade()
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body.update(model={"path": str(model)}, prefix_tokens=8, continuation_tokens=2, allowance_mib=64)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    r = pb(capsys, "submit", str(tmp_path / "p.yaml"))
    return r, queued(url)


def test_an_moe_config_max_position_string_queues_nothing(tmp_path, moe, capsys, monkeypatch):
    """Catches `submit` of an MoE checkpoint whose max_position_embeddings is a string: check_positions
    skipped it, the screen was queued, and its worker failed it at load with transformers' refusal."""
    model = copy_of(moe, tmp_path / "m", max_position_embeddings="256")
    r, screens = submitted(tmp_path, monkeypatch, capsys, model)
    one_line_error(r, f"{model / 'config.json'}: max_position_embeddings is '256', not a positive integer")
    assert screens == []


@pytest.mark.parametrize("family", ["opt", "moe"])
@pytest.mark.parametrize("config, fragment", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a finite number (JSON has no NaN or Infinity)"),
    ({"rope_parameters": {"rope_theta": float("inf"), "rope_type": "default"}},
     "rope_parameters.rope_theta is inf, not a finite number (JSON has no NaN or Infinity)"),
    ({"eos_token_id": [2, float("-inf")]}, "eos_token_id[1] is -inf, not a finite number (JSON has no NaN or Infinity)"),
])
def test_a_non_finite_config_value_queues_nothing(tmp_path, tiny, moe, capsys, monkeypatch, family, config,
                                                  fragment):
    """Catches a config.json holding NaN or Infinity (not JSON; Python's reader took them): submit
    queued the screen, every episode ran to non-finite logits, and the faithfulness gate failed
    them all at the end."""
    model = copy_of(tiny if family == "opt" else moe, tmp_path / "m", **config)
    r, screens = submitted(tmp_path, monkeypatch, capsys, model)
    one_line_error(r, f"{model / 'config.json'}: {fragment}; fix config.json")
    assert screens == []


@pytest.fixture(scope="module")
def dense_qwen3(tmp_path_factory) -> Path:
    """A Qwen3-MoE checkpoint whose every layer is in mlp_only_layers (transformers' own save):
    config.json and tensors agree, and no layer has experts."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64, mlp_only_layers=[0, 1])
    out = tmp_path_factory.mktemp("qwen3") / "dense"
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.parametrize("config, fragment", [
    ({}, "no layer of the 2 has experts (mlp_only_layers [0, 1], decoder_sparse_step 1)"),
    ({"mlp_only_layers": [], "decoder_sparse_step": 3}, "no layer of the 2 has experts (mlp_only_layers [], "
                                                        "decoder_sparse_step 3)"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step is 0, not a positive integer"),  # ZeroDivisionError
    ({"mlp_only_layers": "0"}, "mlp_only_layers is '0', not a list of layer indices"),
])
def test_a_qwen3_moe_checkpoint_without_moe_layers_is_one_line(tmp_path, dense_qwen3, capsys, config, fragment):
    """Catches a Qwen3-MoE config.json whose mlp_only_layers / decoder_sparse_step leave no layer
    with experts (a screen failed with ExpertHost's bare `StopIteration:`, `model stats` exited 70
    with numpy's "need at least one array to stack") or whose step is 0 (transformers'
    ZeroDivisionError, exit 70)."""
    model = copy_of(dense_qwen3, tmp_path / "m", **config)
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"), str(model), fragment)


@pytest.mark.parametrize("config, fragment", [
    # a layer without experts is a dense MLP of intermediate_size: a string there was multiplied into the
    # device part's bytes (`protocol plan` and `submit`: TypeError, exit 70); one missing, transformers'
    # default (6144) disagreed with the tensors
    ({"mlp_only_layers": [0], "intermediate_size": "64"},
     "intermediate_size is '64', not an integer in 1..1048576 (the width of the dense MLP of layer 0, which has no "
     "experts)"),
    ({"mlp_only_layers": [1], "intermediate_size": None}, "intermediate_size is None, not an integer in 1..1048576 "
                                                          "(the width of the dense MLP of layer 1"),
    # transformers' Qwen3-MoE attention reads head_dim even when null: None ** -0.5, TypeError (exit 70)
    ({"mlp_only_layers": [], "head_dim": None}, "head_dim is None, not a positive integer"),
])
def test_a_qwen3_moe_config_its_model_cannot_build_is_refused_at_submit(tmp_path, dense_qwen3, capsys,
                                                                         monkeypatch, config, fragment):
    """Catches a Qwen3-MoE config.json whose dense layers' intermediate_size or whose head_dim
    was not checked: `submit` exited 70 (TypeError in the device part's bytes), or queued a
    screen that its worker failed at load."""
    model = copy_of(dense_qwen3, tmp_path / "m", **config)
    r, screens = submitted(tmp_path, monkeypatch, capsys, model)
    one_line_error(r, f"{model / 'config.json'}: {fragment}")
    assert screens == []


def _sharded(model: Path, where: Path) -> Path:
    """`model` re-saved as transformers saves a large checkpoint: one file per tensor and
    model.safetensors.index.json's weight_map naming each tensor's file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, where)
    sd = load_file(where / "model.safetensors")
    (where / "model.safetensors").unlink()
    names = {k: f"model-{i + 1:05d}-of-{len(sd):05d}.safetensors" for i, k in enumerate(sorted(sd))}
    for k, name in names.items():
        save_file({k: sd[k]}, where / name, metadata={"format": "pt"})
    (where / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return where


@pytest.mark.parametrize("family", ["opt", "moe"])
@pytest.mark.parametrize("damage, fragment", [
    ("no weights", "has no *.safetensors"),
    ("a shard", "lacks 1 of the"),
    ("bin only", None),
])
def test_a_checkpoint_without_its_weight_files_is_one_line(tmp_path, tiny, moe, capsys, family, damage, fragment):
    """Catches an MoE directory without weights, or without one shard of its index (transformers'
    OSError / FileNotFoundError: exit 70), and an OPT one without a shard (`lacks 13 tensors`,
    naming no file) or saved as pytorch_model.bin (no fix named). An MoE pytorch_model.bin runs."""
    import torch
    from safetensors.torch import load_file

    model = _sharded(tiny if family == "opt" else moe, tmp_path / "m")
    shards = sorted(model.glob("*.safetensors"))
    if damage == "no weights":
        for f in [*shards, model / "model.safetensors.index.json"]:
            f.unlink()
    elif damage == "a shard":
        shards[len(shards) // 2].unlink()
    else:
        torch.save({k: v for f in shards for k, v in load_file(f).items()}, model / "pytorch_model.bin")
        for f in [*shards, model / "model.safetensors.index.json"]:
            f.unlink()
    r = pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1")
    if family == "moe" and damage == "bin only":
        assert r.code == 0, r.err
        return
    if damage == "a shard":
        fragment += f" {len(shards)} shards model.safetensors.index.json lists (first: '{shards[len(shards) // 2].name}')"
    elif damage == "bin only":
        fragment = "holds pytorch_model.bin, packbench reads OPT from *.safetensors only; convert it"
    one_line_error(r, str(model), fragment)


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory) -> Path:
    """A Mixtral checkpoint as transformers' save_pretrained writes it, and as every published one
    is laid out: one tensor per expert (`...block_sparse_moe.experts.3.w1.weight`), which
    transformers stacks into a fused tensor per layer when it loads."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                           max_position_embeddings=64)
    out = tmp_path_factory.mktemp("mixtral") / "per-expert"
    MixtralForCausalLM(config).save_pretrained(out)
    return out


EXPERT = "model.layers.1.block_sparse_moe.experts.{}.w2.weight"


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("damage, fragment", [
    ("shape", f"tensor {EXPERT.format(2)} has shape [32, 40], expert 0's [32, 48]; a layer's experts share one "
              f"shape: regenerate the checkpoint"),
    ("lack", f"the checkpoint lacks {EXPERT.format(2)} (1 of the 4 experts config.json gives hold no w2.weight "
             f"there); copy the whole checkpoint again or fix config.json"),
    ("extra", f"the checkpoint holds {EXPERT.format(4)}, but config.json gives 4 experts (0..3); fix config.json "
              f"or regenerate the checkpoint"),
])
def test_a_per_expert_tensor_transformers_cannot_stack_is_refused_at_submit(tmp_path, per_expert, capsys,
                                                                            monkeypatch, sharded, damage, fragment):
    """Catches one expert's tensor of its own shape, one lacking, or one beyond config.json's
    experts in the published per-expert layout (one file, or shards of an index): transformers'
    stacking raised "We encountered some issues during automatic conversion of the weights"
    after its load report, naming no tensor (`model stats`: exit 70; `submit` queued a screen
    its worker failed at load). Read from the safetensors headers before anything is queued."""
    from safetensors.torch import load_file, save_file

    model = _sharded(per_expert, tmp_path / "m") if sharded else copy_of(per_expert, tmp_path / "m")
    file = next(f for f in model.glob("*.safetensors") if EXPERT.format(2) in load_file(f))
    sd = load_file(file)
    if damage == "shape":
        sd[EXPERT.format(2)] = sd[EXPERT.format(2)][:, :40].contiguous()
    elif damage == "lack":
        del sd[EXPERT.format(2)]
    else:
        sd[EXPERT.format(4)] = sd[EXPERT.format(2)].clone()
    save_file(sd, file, metadata={"format": "pt"}) if sd else file.unlink()
    if sharded and damage != "shape":  # the index lists what the shards hold
        index = json.loads((model / "model.safetensors.index.json").read_text())
        index["weight_map"].pop(EXPERT.format(2)) if damage == "lack" else \
            index["weight_map"].__setitem__(EXPERT.format(4), file.name)
        if not sd:
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file.name}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"), f"{model}: {fragment}")
    r, screens = submitted(tmp_path, monkeypatch, capsys, model)
    one_line_error(r, f"{model}: {fragment}")
    assert screens == []


def test_the_per_expert_layout_runs(tmp_path, per_expert, capsys):
    """The published layout, whole, in one file or in shards: `model stats` reads its routing (the
    per-expert check refuses nothing a real checkpoint holds)."""
    for model in (per_expert, _sharded(per_expert, tmp_path / "m")):
        r = pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1", "--continuation", "2")
        assert r.code == 0, r.err
        assert f"{model}: mixtral, 4 experts, top 2, float32; 1 prompt x 8 tokens" in r.out


@pytest.mark.parametrize("text, fragment", [
    ("{", "cannot read it as JSON"), ("[" * 100_000 + "]" * 100_000, "cannot read it as JSON"),
    ("[]", "is not a JSON object"), (None, "is a FIFO"),
])
def test_a_broken_moe_recipe_file_is_one_line(tmp_path, moe, capsys, text, fragment):
    """Catches packbench_synth.json read with `json.loads(read_text())` and `.get`: not JSON, too
    deep or a list exited 70, a FIFO waited forever."""
    model = copy_of(moe, tmp_path / "m")
    (model / "packbench_synth.json").unlink()
    os.mkfifo(model / "packbench_synth.json") if text is None else (model / "packbench_synth.json").write_text(text)
    one_line_error(pb(capsys, "model", "stats", str(model), "--prefix", "8", "--count", "1"),
                   f"{model / 'packbench_synth.json'}", fragment)


def test_protocol_plan_of_a_checkpoint_whose_config_json_is_a_fifo_does_not_hang(tmp_path, tiny, capsys):
    """Catches `protocol plan` reading config.json with read_bytes() for the recipe and the shape:
    a FIFO there waited for a writer forever. Both reads are bounded now, and plan says one line."""
    import yaml

    from test_hostile_input import ROOT

    model = copy_of(tiny, tmp_path / "m")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(model)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    one_line_error(pb(capsys, "protocol", "plan", str(tmp_path / "p.yaml")), "--sparsity")
    one_line_error(pb(capsys, "protocol", "plan", str(tmp_path / "p.yaml"), "--sparsity", "0.94"),
                   f"cannot read the model's shape from {model / 'config.json'} (is a FIFO")


def test_kv_heads_left_out_are_transformers_default_in_the_byte_arithmetic(tmp_path, moe, capsys):
    """A Mixtral or Qwen3-MoE config.json without num_key_value_heads loads with transformers' default
    (8, 4), while the plan and the allowance check priced the attention heads (catches the arithmetic
    and the model disagreeing, a default that drifts from the installed transformers, and a null
    that reached the worker)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    from packbench.core.moe import shape_of_config
    from packbench.engine.config import KV_HEADS_DEFAULT, read_config

    assert KV_HEADS_DEFAULT == {"mixtral": MixtralConfig().num_key_value_heads,
                                "qwen3_moe": Qwen3MoeConfig().num_key_value_heads}
    assert OlmoeConfig(num_attention_heads=16).num_key_value_heads == 16  # OLMoE's is the heads: nothing to add
    model = copy_of(moe, tmp_path / "m")
    body = json.loads((model / "config.json").read_text())
    assert body["num_attention_heads"] != 8 and body.pop("num_key_value_heads") is not None
    body["num_attention_heads"] = 16  # a multiple of 8, as transformers' default needs
    (model / "config.json").write_text(json.dumps(body))
    assert shape_of_config(read_config(model)).kv_heads == 8
    null = copy_of(moe, tmp_path / "n", num_key_value_heads=None)
    one_line_error(pb(capsys, "model", "stats", str(null), "--prefix", "8", "--count", "1"),
                   f"{null / 'config.json'}: num_key_value_heads is None, not a positive integer")
