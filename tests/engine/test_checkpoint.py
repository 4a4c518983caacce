"""Checkpoints that are not pre-LN ReLU OPT are refused with one line naming what is unsupported."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.errors import CheckpointError
from engine.checkpoint import build_model, read_config


def variant(tiny, tmp_path, name, *, config=None, drop=None, reshape=None):
    out = tmp_path / name
    out.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(config or {})
    (out / "config.json").write_text(json.dumps(cfg))
    sd = load_file(tiny / "model.safetensors")
    if drop:
        sd.pop(drop)
    if reshape:
        sd[reshape] = sd[reshape][:-1].contiguous()
    save_file(sd, out / "model.safetensors")
    return out


@pytest.mark.parametrize("change, fragment", [
    ({"model_type": "llama"}, "is a 'llama' model; packbench supports OPT"),
    ({"do_layer_norm_before": False}, "post-LayerNorm OPT"),
    ({"activation_function": "gelu"}, "uses activation 'gelu'; exact packets need ReLU"),
    ({"word_embed_proj_dim": 32}, "projects embeddings"),
])
def test_unsupported_architectures(tiny, tmp_path, change, fragment):
    path = variant(tiny, tmp_path, "m", config=change)
    with pytest.raises(CheckpointError, match=fragment) as e:
        read_config(path)
    assert "\n" not in str(e.value)


def test_missing_and_misshapen_tensors(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="lacks 1 tensors"):
        build_model(variant(tiny, tmp_path, "a", drop="model.decoder.layers.0.fc1.bias"), dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"tensor model.decoder.layers.1.fc2.weight has shape \(63, 256\)"):
        build_model(variant(tiny, tmp_path, "b", reshape="model.decoder.layers.1.fc2.weight"), dtype=torch.float32)


def test_missing_directory_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="packbench model synth --out"):
        read_config(tmp_path / "nope")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_placed_read_equals_the_stock_read(checkpoints, dtype):
    """read_placed (parallel preads into the final tensors) gives the stock reader's bytes; a
    checkpoint stored in another dtype is left to the converting stock path (None)."""
    from engine.checkpoint import read_placed, read_state_dict

    torch_dtype = getattr(torch, dtype)
    stock = read_state_dict(checkpoints[dtype], dtype=torch_dtype)
    placed = read_placed(checkpoints[dtype], dtype=torch_dtype, device=torch.device("cpu"),
                         host_keys=lambda name: True, threads=3)
    assert placed.keys() == stock.keys()
    for key, t in stock.items():
        assert placed[key].dtype == t.dtype and torch.equal(placed[key].view(torch.uint8), t.view(torch.uint8)), key
    other = "float16" if dtype != "float16" else "float32"
    assert read_placed(checkpoints[other], dtype=torch_dtype, device=torch.device("cpu"), host_keys=lambda n: True) is None


def test_build_weights_needs_no_transformers_and_stock_shares_its_tensors(checkpoints):
    """Mode graph's model is plain torch; the stock OPTForCausalLM built over it shares every
    tensor (no copy) and computes what build_model's does."""
    from engine.checkpoint import build_weights
    from engine.opt_weights import stock_model

    weights = build_weights(checkpoints["float32"], dtype=torch.float32)
    assert type(weights).__module__ == "engine.opt_weights"
    stock = stock_model(weights, vars(weights.config))
    ours = {id(p) for p in weights.parameters()}
    assert all(id(p) in ours for p in stock.parameters())
    ref = build_model(checkpoints["float32"], dtype=torch.float32)
    ids = torch.tensor([[2, 11, 17, 5, 99]])
    with torch.inference_mode():
        assert torch.equal(stock(input_ids=ids).logits, ref(input_ids=ids).logits)
