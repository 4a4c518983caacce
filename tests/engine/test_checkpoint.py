"""Checkpoints that are not pre-LN ReLU OPT are refused with one line naming what is unsupported."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from packbench.core.errors import CheckpointError
from packbench.engine.checkpoint import build_model, build_weights, read_config


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
    # OPT-350m's two departures: each names the fix (both once ended at "unsupported")
    ({"do_layer_norm_before": False}, "post-LayerNorm OPT .* only pre-LN OPT is supported: use another OPT size"),
    ({"activation_function": "gelu"}, "uses activation 'gelu'; exact packets need ReLU"),
    ({"word_embed_proj_dim": 32}, r"projects embeddings \(word_embed_proj_dim 32 != hidden_size 64, like OPT-350m\); "
                                  r"unsupported: use another OPT size"),
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


@pytest.mark.parametrize("damage, fragment", [
    (lambda raw: raw[:4], "shorter than the 8-byte header length"),
    (lambda raw: raw[:64], "the header claims"),
    (lambda raw: raw[:-100], "past the end of the file: truncated"),
    (lambda raw: raw[:8] + b"\xff" * (len(raw) - 8), "its header is not JSON"),
    (lambda raw: (2).to_bytes(8, "little") + b"[]" + raw[10:], "not a JSON object"),
])
def test_a_damaged_safetensors_file_is_one_line_naming_the_file(tiny, tmp_path, damage, fragment):
    """Truncated or foreign files: the reader names the file and the fix, before placing anything
    (a truncated file used to surface as a bare JSONDecodeError)."""
    out = variant(tiny, tmp_path, "damaged")
    weights = out / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    for build in (build_model, build_weights):  # the stock read and the worker's placed read
        with pytest.raises(CheckpointError, match=fragment) as e:
            build(out, dtype=torch.float32)
        assert str(weights) in str(e.value) and "packbench model synth" in str(e.value) and "\n" not in str(e.value)


def test_missing_directory_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="packbench model synth --out"):
        read_config(tmp_path / "nope")


@pytest.mark.parametrize("pin", ["tensors", "blocks", "register", "map"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_placed_read_equals_the_stock_read(checkpoints, dtype, pin, monkeypatch):
    """read_placed (parallel preads into the final tensors) gives the stock reader's bytes in
    every host layout (the CPU twins of the pinned ones); a checkpoint stored in another dtype
    is left to the converting stock path (None)."""
    from packbench.engine.checkpoint import read_placed, read_state_dict

    monkeypatch.setattr("packbench.engine.checkpoint.CHUNK", 4096)  # several chunks per tensor
    torch_dtype = getattr(torch, dtype)
    stock = read_state_dict(checkpoints[dtype], dtype=torch_dtype)
    timings = {}
    placed = read_placed(checkpoints[dtype], dtype=torch_dtype, device=torch.device("cpu"),
                         host_keys=lambda name: True, threads=3, pin=pin, timings=timings)
    assert list(placed) == list(stock) and "read_host" in timings or "map_host" in timings
    for key, t in stock.items():
        p = placed[key]
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous(), key
        assert torch.equal(p.view(torch.uint8), t.view(torch.uint8)), key
    del placed  # the mappings go with their last tensor
    other = "float16" if dtype != "float16" else "float32"
    assert read_placed(checkpoints[other], dtype=torch_dtype, device=torch.device("cpu"), host_keys=lambda n: True) is None


def test_build_weights_needs_no_transformers_and_stock_shares_its_tensors(checkpoints):
    """Mode graph's model is plain torch; the stock OPTForCausalLM built over it shares every
    tensor (no copy) and computes what build_model's does."""
    from packbench.engine.checkpoint import build_weights
    from packbench.engine.opt_weights import stock_model

    weights = build_weights(checkpoints["float32"], dtype=torch.float32)
    assert type(weights).__module__ == "packbench.engine.opt_weights"
    stock = stock_model(weights, vars(weights.config))
    ours = {id(p) for p in weights.parameters()}
    assert all(id(p) in ours for p in stock.parameters())
    ref = build_model(checkpoints["float32"], dtype=torch.float32)
    ids = torch.tensor([[2, 11, 17, 5, 99]])
    with torch.inference_mode():
        assert torch.equal(stock(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_pinned_blocks_waste_little():
    """PyTorch's pinned allocator rounds each allocation up to a power of two: 32 OPT-2.7B fc2
    weights took 2.15 GB for 1.68 GB one by one; grouped, 1.74 GB (<= 4 % over)."""
    from packbench.engine.checkpoint import _aligned, _blocks

    def pinned(sizes):
        groups = _blocks(sizes)
        assert [i for g in groups for i in g] == list(range(len(sizes)))
        return sum(1 << (sum(_aligned(sizes[i]) for i in g) - 1).bit_length() for g in groups)

    assert pinned([2560 * 10240 * 2] * 32) == (1 << 30) + (1 << 29) + 2 * (1 << 26)  # 1.745 GB
    for sizes in ([768 * 3072 * 2] * 12, [5, 4096, 3, 1 << 20, 7], [1 << 30], [3] * 5, [2048 * 8192 * 2] * 24):
        need = sum(_aligned(n) for n in sizes)
        assert pinned(sizes) <= 1.05 * need + 2 * max(_aligned(n) for n in sizes), sizes


@pytest.mark.parametrize("pin", ["tensors", "register", "map"])
def test_model_logits_do_not_depend_on_the_host_layout(checkpoints, pin, monkeypatch):
    from packbench.engine.episode import run_episode
    from packbench.engine.model import CpuFirstModel

    def logits():
        model = CpuFirstModel(checkpoints["float16"], dtype=torch.float16, device=torch.device("cpu"), mode="graph")
        model.use("dense-stream")
        return run_episode(model, [2] + list(range(10, 30)), continuation=3).logits

    reference = logits()  # the default layout
    monkeypatch.setattr("packbench.engine.checkpoint.PIN", pin)
    assert (logits() == reference).all()


def test_an_untied_opt_keeps_its_own_lm_head_as_transformers_does(tiny, tmp_path):
    """config.json's tie_word_embeddings false with an lm_head.weight of its own: the engine's
    logits are transformers' on the same directory (the head used to be tied to the embedding
    whatever config.json said, its lm_head.weight silently dropped); an untied checkpoint
    without that tensor is refused as incomplete."""
    from transformers import OPTForCausalLM

    from packbench.engine.episode import run_episode
    from packbench.engine.model import CpuFirstModel

    out = variant(tiny, tmp_path, "untied", config={"tie_word_embeddings": False})
    sd = load_file(out / "model.safetensors")
    sd["lm_head.weight"] = torch.randn_like(sd["model.decoder.embed_tokens.weight"], generator=torch.Generator().manual_seed(0))
    save_file(sd, out / "model.safetensors")
    prompt = list(range(3, 19))
    model = CpuFirstModel(out, dtype=torch.float32, device=torch.device("cpu"))
    model.use("dense-stream")
    ours = torch.from_numpy(run_episode(model, prompt, continuation=1).logits[0])
    stock = OPTForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        theirs = stock(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    assert torch.equal(build_model(out, dtype=torch.float32).lm_head.weight, sd["lm_head.weight"])

    missing = variant(tiny, tmp_path, "untied-headless", config={"tie_word_embeddings": False})
    with pytest.raises(CheckpointError, match="lacks 1 tensors .first: lm_head.weight"):
        build_weights(missing, dtype=torch.float32)
