"""config.json of a local OPT checkpoint, checked without importing torch (submit reads it)."""

import json
from pathlib import Path

from core.errors import CheckpointError


def read_config(model_dir: Path) -> dict:
    """config.json of an OPT checkpoint, or a one-line CheckpointError naming the fix."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(
            f"model directory {model_dir} does not exist; create one with "
            f"`packbench model synth --out {model_dir}` or set model.path to a local OPT checkpoint"
        )
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; point model.path at a Hugging Face OPT directory")
    config = json.loads(path.read_text())
    if config.get("model_type") != "opt":
        raise CheckpointError(
            f"{model_dir} is a {config.get('model_type')!r} model; packbench supports OPT (model_type 'opt') only"
        )
    if not config.get("do_layer_norm_before", True):
        raise CheckpointError(
            f"{model_dir} is a post-LayerNorm OPT (do_layer_norm_before=false, like OPT-350m); only pre-LN OPT is supported"
        )
    if config.get("activation_function", "relu") != "relu":
        raise CheckpointError(
            f"{model_dir} uses activation {config.get('activation_function')!r}; exact packets need ReLU"
        )
    if config.get("word_embed_proj_dim", config["hidden_size"]) != config["hidden_size"]:
        raise CheckpointError(f"{model_dir} projects embeddings (word_embed_proj_dim != hidden_size); unsupported")
    return config
