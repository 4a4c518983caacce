"""Synthetic checkpoints: deterministic, real shapes, the sparsity they promise."""

import hashlib

import torch

from engine.checkpoint import build_model, read_config
from engine.shapes import SHAPES
from engine.synth import fc1_bias_for, synth_checkpoint


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def post_relu_zero_fraction(path, *, tokens=64) -> list[float]:
    model = build_model(path, dtype=torch.float32)
    fractions = []
    for layer in model.model.decoder.layers:
        layer.fc2.register_forward_hook(lambda m, args, out: fractions.append(float((args[0] == 0).float().mean())))
    ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(input_ids=ids)
    return fractions


def test_deterministic_for_a_seed(tmp_path):
    a = synth_checkpoint(tmp_path / "a", shape="tiny", dtype="float16", sparsity=0.9, seed=3)
    b = synth_checkpoint(tmp_path / "b", shape="tiny", dtype="float16", sparsity=0.9, seed=3)
    c = synth_checkpoint(tmp_path / "c", shape="tiny", dtype="float16", sparsity=0.9, seed=4)
    assert digest(a) == digest(b) != digest(c)


def test_real_opt_shapes_in_config(tmp_path):
    path = synth_checkpoint(tmp_path / "m", shape="opt-125m", dtype="bfloat16", sparsity=0.94, seed=0)
    config = read_config(path)
    assert (config["hidden_size"], config["ffn_dim"], config["num_hidden_layers"], config["vocab_size"]) == (768, 3072, 12, 50272)
    assert SHAPES["opt-2.7b"] == dict(hidden=2560, ffn=10240, layers=32, heads=32, vocab=50272, max_positions=2048)


def test_sparsity_is_what_was_asked(tmp_path):
    for target in (0.5, 0.94):
        path = synth_checkpoint(tmp_path / str(target), shape="opt-125m", dtype="float32", sparsity=target, seed=0)
        fractions = post_relu_zero_fraction(path)
        assert abs(sum(fractions) / len(fractions) - target) < 0.01, (target, fractions)
    assert abs(fc1_bias_for(0.94, hidden=2560) + 1.5549 * 0.02 * 2560 ** 0.5) < 1e-3


def test_hot_neurons_fire_more_often(tmp_path):
    path = synth_checkpoint(tmp_path / "hot", shape="tiny", dtype="float32", sparsity=0.94, seed=0,
                            hot_fraction=0.1, hot_bias=0.0)
    bias = build_model(path, dtype=torch.float32).model.decoder.layers[0].fc1.bias
    assert int((bias == 0).sum()) == round(0.1 * SHAPES["tiny"]["ffn"])
    overall = sum(post_relu_zero_fraction(path)) / SHAPES["tiny"]["layers"]
    assert 0.94 - 0.1 * 0.44 - 0.03 < overall < 0.94 - 0.1 * 0.44 + 0.03  # hot ones ~50 % active
