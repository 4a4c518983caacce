"""Synthetic OPT checkpoints with real shapes and a chosen activation sparsity.

Why the fc1 bias sets sparsity: in a pre-LN OPT layer, fc1 sees LayerNorm output x with unit
weight and zero bias, so every token has mean 0 and variance 1 across `hidden`. With fc1 rows
w_j ~ N(0, std^2) iid, the pre-activation z_j = w_j . x + b is N(b, std^2 * hidden) for every
neuron. Choosing b = -std * sqrt(hidden) * Phi^-1(sparsity) makes P(z_j <= 0), the fraction of
exact zeros after ReLU, equal `sparsity` (0.94 gives about -1.555 * std * sqrt(hidden), the
-1.6 the design notes measured against pretrained OPT).
"""

import json
import math
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist

import torch
from safetensors.torch import save_file

from core.errors import CheckpointError
from core.registry import SHAPES, synth_spec
from engine.shapes import dtype_of

INIT_STD = 0.02  # OPT's initializer_range


def fc1_bias_for(sparsity: float, *, hidden: int, std: float = INIT_STD) -> float:
    """The fc1 bias that makes `sparsity` of post-ReLU activations exactly zero (see module doc)."""
    if not 0.0 < sparsity < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity}")
    return -std * math.sqrt(hidden) * NormalDist().inv_cdf(sparsity)


def opt_config(shape: str, dtype: str) -> dict:
    """A Hugging Face OPTConfig dict for a preset shape."""
    s = SHAPES[shape]
    return {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": s["hidden"],
        "ffn_dim": s["ffn"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": s["max_positions"],
        "word_embed_proj_dim": s["hidden"],
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "layerdrop": 0.0,
        "init_std": INIT_STD,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def synth_checkpoint(
    out: Path, *, shape: str, dtype: str, sparsity: float, seed: int, hot_fraction: float = 0.0,
    hot_bias: float = 0.0, force: bool = False, progress: Callable[[int, int], None] | None = None
) -> Path:
    """Write config.json + model.safetensors for `shape` into `out`. Deterministic for a seed.

    Tensors are drawn in float32 from one seeded generator in a fixed order, then cast, so a
    seed gives the same weights whatever the output dtype.

    Hot neurons: real OPT activity is heavy-tailed (a minority of neurons fire far more often),
    which decides whether retention and forecasts can pay. A `hot_fraction` of each layer's
    neurons (chosen by the seed) gets fc1 bias `hot_bias` x std x sqrt(hidden) instead: 0.0
    makes them fire for about half the tokens, against 1 - sparsity for the rest.

    `progress(done, total)` is called once per decoder layer drawn (total = the shape's
    layers); after the last one the file is written, which for a large shape takes a while too.
    """
    # The arguments a protocol's model.synth allows, no others: a SynthArgumentError (a
    # ValueError) names the bad one. The values are used as given, so config.json stays as it was.
    synth_spec(shape=shape, dtype=dtype, sparsity=sparsity, seed=seed, hot_fraction=hot_fraction, hot_bias=hot_bias)
    torch_dtype = dtype_of(dtype)
    out = Path(out)
    if (out / "config.json").exists() and not force:
        raise CheckpointError(
            f"{out} already holds a checkpoint; choose another --out or pass --force to replace it"
        )
    s = SHAPES[shape]
    h, f = s["hidden"], s["ffn"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * INIT_STD).to(torch_dtype)

    def const(value: float, n: int) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch_dtype)

    bias = fc1_bias_for(sparsity, hidden=h)
    hot_gen = torch.Generator().manual_seed(seed + 1)  # separate stream: weights stay the same
    n_hot = int(round(hot_fraction * f))
    sd: dict[str, torch.Tensor] = {
        "model.decoder.embed_tokens.weight": normal(s["vocab"], h),
        # OPT's learned positions carry an offset of 2 rows.
        "model.decoder.embed_positions.weight": normal(s["max_positions"] + 2, h),
        "model.decoder.final_layer_norm.weight": const(1.0, h),
        "model.decoder.final_layer_norm.bias": const(0.0, h),
    }
    for i in range(s["layers"]):
        p = f"model.decoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            sd[p + f"self_attn.{proj}.weight"] = normal(h, h)
            sd[p + f"self_attn.{proj}.bias"] = const(0.0, h)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            sd[p + f"{norm}.weight"] = const(1.0, h)
            sd[p + f"{norm}.bias"] = const(0.0, h)
        sd[p + "fc1.weight"] = normal(f, h)
        fc1_bias = torch.full((f,), bias)
        if n_hot:
            fc1_bias[torch.randperm(f, generator=hot_gen)[:n_hot]] = hot_bias * INIT_STD * math.sqrt(h)
        sd[p + "fc1.bias"] = fc1_bias.to(torch_dtype)
        sd[p + "fc2.weight"] = normal(h, f)
        sd[p + "fc2.bias"] = const(0.0, h)
        if progress is not None:
            progress(i + 1, s["layers"])

    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = opt_config(shape, dtype)
    config["packbench_synth"] = {"shape": shape, "sparsity": sparsity, "seed": seed, "fc1_bias": bias,
                                 "hot_fraction": hot_fraction, "hot_bias": hot_bias}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
