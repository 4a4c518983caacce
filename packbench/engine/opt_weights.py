"""OPT's parameters in plain torch modules, named exactly as transformers names them.

Why: importing transformers' OPT took ~9 s on the H200 machine (it pulls in
torch.distributed.tensor and torch._dynamo), longer than reading OPT-2.7B. Mode "graph"
(engine/static_opt.py) needs only the parameters, so a worker in that mode never imports
transformers; mode "eager" gets a stock `OPTForCausalLM` built over these very modules
(`stock_model`), sharing every tensor, so both modes compute with the same parameters.
"""

from contextlib import contextmanager
from types import SimpleNamespace

import torch
from torch import nn

# OPTConfig's defaults for the keys below (transformers' configuration_opt.py).
CONFIG_DEFAULTS = dict(enable_bias=True, layer_norm_elementwise_affine=True, pad_token_id=1,
                       max_position_embeddings=2048)


class Attention(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        h = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.head_dim = h // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(h, h, bias=c.enable_bias)
        self.v_proj = nn.Linear(h, h, bias=c.enable_bias)
        self.q_proj = nn.Linear(h, h, bias=c.enable_bias)
        self.out_proj = nn.Linear(h, h, bias=c.enable_bias)


class Layer(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        h, affine = c.hidden_size, c.layer_norm_elementwise_affine
        self.self_attn = Attention(c)
        self.self_attn_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.fc1 = nn.Linear(h, c.ffn_dim, bias=c.enable_bias)
        self.fc2 = nn.Linear(c.ffn_dim, h, bias=c.enable_bias)
        self.final_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)


class Positions(nn.Embedding):
    """OPTLearnedPositionalEmbedding's table: position p is row p + offset."""

    def __init__(self, positions: int, hidden: int) -> None:
        self.offset = 2
        super().__init__(positions + self.offset, hidden)


class Decoder(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.embed_positions = Positions(c.max_position_embeddings, c.hidden_size)
        self.project_in = self.project_out = None  # read_config refuses projecting checkpoints
        self.final_layer_norm = nn.LayerNorm(c.hidden_size, elementwise_affine=c.layer_norm_elementwise_affine)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))


class Body(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.decoder = Decoder(c)


_INITIALISED = (nn.Linear, nn.Embedding, nn.LayerNorm)


@contextmanager
def _without_init():
    """Module constructors that skip their random initialisation (every tensor is assigned from
    the checkpoint right after). On `meta`, Embedding's normal_ alone took 2.15 s of a cold start:
    its first call imports torch._refs/_prims (~800 modules) to decompose a no-op."""
    saved = {cls: cls.__dict__["reset_parameters"] for cls in _INITIALISED}
    for cls in _INITIALISED:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


class OPTWeights(nn.Module):
    """`model.decoder.*` and `lm_head` with transformers' names and shapes; no forward.

    Built without initialising anything: build it on `meta` and assign every tensor
    (engine/checkpoint.py build_weights); values before that are undefined."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = SimpleNamespace(**{**CONFIG_DEFAULTS, **config})
        with _without_init():
            self.model = Body(self.config)
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def tie_weights(self) -> None:
        # Tied in every published OPT (OPTConfig's default); a config.json with
        # tie_word_embeddings false keeps the lm_head.weight its files hold, as transformers does.
        if getattr(self.config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.decoder.embed_tokens.weight


def stock_model(weights: OPTWeights, config: dict):
    """transformers' OPTForCausalLM (eager attention) whose modules ARE `weights`' modules.

    Built on `meta`, then every parameterised module is replaced by the one of `weights`, so
    nothing is copied and a policy's OutgoingLinear (already in weights' layers) serves both.
    """
    from transformers import OPTConfig, OPTForCausalLM

    hf_config = OPTConfig(**{k: v for k, v in config.items() if k != "packbench_synth"})
    hf_config._attn_implementation = "eager"  # SDPA is not reproducible in decode on CUDA (docs/engine.md)
    with torch.device("meta"):
        model = OPTForCausalLM(hf_config)
    ours, theirs = weights.model.decoder, model.model.decoder
    theirs.embed_tokens = ours.embed_tokens
    theirs.embed_positions.weight = ours.embed_positions.weight
    theirs.final_layer_norm = ours.final_layer_norm
    for mine, stock in zip(ours.layers, theirs.layers, strict=True):
        for name in ("self_attn_layer_norm", "fc1", "fc2", "final_layer_norm"):
            setattr(stock, name, getattr(mine, name))
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(stock.self_attn, name, getattr(mine.self_attn, name))
    model.lm_head = weights.lm_head
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    assert not left, f"stock OPT kept meta tensors: {left[:3]}"
    return model.eval()
