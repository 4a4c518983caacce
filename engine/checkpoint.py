"""Read a local Hugging Face OPT checkpoint into host memory and build the model on `meta`.

Nothing here touches an accelerator: the returned model lives entirely in host memory
(CPU-first). Placement is the policy's business (engine/model.py).
"""

from pathlib import Path

import torch
from safetensors import safe_open

from core.errors import CheckpointError
from engine.config import read_config

# Key remaps: some OPT exports omit the `model.` prefix (OPTModel state dicts).
KEY_PREFIXES = {"decoder.": "model.decoder."}


def read_state_dict(model_dir: Path, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, in host memory, cast to `dtype`."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors files; packbench reads safetensors only")
    sd: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = key
                for old, new in KEY_PREFIXES.items():
                    if name.startswith(old):
                        name = new + name[len(old):]
                sd[name] = f.get_tensor(key).to(dtype)
    return sd


def build_model(model_dir: Path, *, dtype: torch.dtype):
    """An OPTForCausalLM on the host: built on `meta`, then tensors assigned from safetensors.

    Eager attention: on CUDA the default SDPA path is not reproducible run to run in decode
    (shared/device/NOTES.md), and bit-identity is judged on logits.
    """
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(**{k: v for k, v in read_config(model_dir).items() if k != "packbench_synth"})
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = OPTForCausalLM(config)
    sd = read_state_dict(model_dir, dtype=dtype)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if "lm_head.weight" not in sd:  # tied to the token embedding in every OPT
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"{model_dir} lacks {len(missing)} tensors (first: {missing[0]}); the checkpoint is incomplete")
    for key, shape in expected.items():
        if tuple(sd[key].shape) != tuple(shape):
            raise CheckpointError(
                f"{model_dir}: tensor {key} has shape {tuple(sd[key].shape)}, config.json implies {tuple(shape)}"
            )
    model.load_state_dict({k: sd[k] for k in expected}, strict=False, assign=True)
    model.tie_weights()
    model.eval()
    return model.to(dtype)
