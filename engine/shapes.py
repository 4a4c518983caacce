"""OPT shape presets and dtype names: plain dicts, as the checkpoints publish them."""

import torch

# Real OPT dimensions (config.json of facebook/opt-*), except `tiny`, which exists for tests.
# All are pre-LayerNorm models with word_embed_proj_dim == hidden (OPT-350m is neither: not here).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, ffn=256, layers=2, heads=4, vocab=512, max_positions=256),
    "opt-125m": dict(hidden=768, ffn=3072, layers=12, heads=12, vocab=50272, max_positions=2048),
    "opt-1.3b": dict(hidden=2048, ffn=8192, layers=24, heads=32, vocab=50272, max_positions=2048),
    "opt-2.7b": dict(hidden=2560, ffn=10240, layers=32, heads=32, vocab=50272, max_positions=2048),
    "opt-6.7b": dict(hidden=4096, ffn=16384, layers=32, heads=32, vocab=50272, max_positions=2048),
    "opt-13b": dict(hidden=5120, ffn=20480, layers=40, heads=40, vocab=50272, max_positions=2048),
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]
