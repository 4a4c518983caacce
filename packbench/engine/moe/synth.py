"""Routing-calibrated synthetic MoE checkpoints (Mixtral, Qwen3-MoE, OLMoE layouts), written by
transformers' own `save_pretrained`, so any transformers >= 5 reads them as it reads a real one.

A random router routes almost uniformly and independently, which would make every caching or
forecasting verdict an artifact. The recipe makes the model's own arithmetic route like the
published figures (docs/workloads.md, "MoE routing"); no expert choice is injected anywhere:

- **a shared direction** `u`: every token embedding carries `shared x u` beside its own random
  part, so after each RMSNorm every token has a like-signed component along `u`;
- **load skew**: router row e gets `bias_e x u` with `bias_e ~ N(0, skew)`: a per-expert offset
  that every token sees, the busiest expert's lift over the mean grows with `skew`;
- **temporal locality**: the attention's queries and keys read only `u` (`q = k = const`), placed
  on rotary pairs whose angles sum to a score that falls with distance, so each head averages a
  window of recent tokens (`window` tokens wide); values and the output projection carry that
  window's content into the residual stream, where the router sees it: consecutive tokens share
  most of their context, shuffled ones do not;
- **cross-layer predictability**: layer l+1's router is `rho x P(router_l) + sqrt(1-rho^2) x noise`
  with P a random permutation of experts, and the experts' outputs are small, so the residual
  stream that reaches layer l+1 is the one layer l routed: its choice predicts the next, through a
  map that is not the identity;
- **peaked next tokens**: lm_head rows scaled by `readout` (as OPT's profile's readout gain).

Everything is drawn from one seeded generator, in a fixed order, in float32 on `device`, then cast:
the same seed, shape and device give the same bytes.
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from packbench.core.moe import MOE_SHAPES, ROUTING_OF, moe_config
from packbench.engine.moe.model import model_class
from packbench.engine.synth import one_thread, os_errors

INIT_STD = 0.02


@dataclass(frozen=True)
class RoutingProfile:
    """The recipe's knobs (module doc). `window` in tokens; the rest are dimensionless."""

    shared: float  # the shared direction's weight in every embedding, against the random part's norm
    skew: float  # std of the per-expert router offset along u, in units of the router rows' scale
    window: float  # tokens of context each attention head averages (sets the rotary pairs used)
    sharpness: float  # the attention score's scale: how fast the weight falls with distance
    context: float  # how strongly that context enters the residual stream
    rho: float  # correlation of consecutive layers' routers (through a permutation)
    readout: float  # lm_head gain: peaked next tokens


# One profile per published routing (core/routing.py PUBLISHED); calibrated by
# `packbench model stats` on the tiny and real shapes (docs/workloads.md gives the measurements).
PROFILES: dict[str, RoutingProfile] = {
    "mixtral": RoutingProfile(shared=1.0, skew=0.0, window=6.0, sharpness=20.0, context=2.0, rho=0.4, readout=6.0),
    "olmoe": RoutingProfile(shared=1.0, skew=1.0, window=6.0, sharpness=20.0, context=2.0, rho=0.4, readout=6.0),
    # No locality, no skew, no cross-layer link: what a random router gives (the check's negative).
    "uniform": RoutingProfile(shared=0.0, skew=0.0, window=0.0, sharpness=0.0, context=0.0, rho=0.0, readout=6.0),
}


def _config(shape: str, layers: int | None, dtype: str):
    import transformers

    body = moe_config(shape, layers=layers, dtype=dtype)
    family = MOE_SHAPES[shape]["family"]
    cls = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "olmoe": transformers.OlmoeConfig}[family]
    kwargs = {k: v for k, v in body.items() if k not in ("model_type", "architectures", "dtype")}
    return cls(**kwargs), family


def _rotary_angles(config, head_dim: int) -> torch.Tensor:
    """(head_dim / 2,) the per-token angle of each rotary pair (inv_freq)."""
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 1e4))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _window_query(angles: torch.Tensor, window: float, head_dim: int) -> torch.Tensor:
    """(head_dim,) a constant query/key whose rotary score q.R(d)k = sum_i c_i^2 cos(angle_i d)
    falls with the distance d: weight on the pairs whose angle is below ~pi/window (one period
    covers many windows), each pair's two components equal (rotate_half pairs i and i + d/2)."""
    q = torch.zeros(head_dim, dtype=torch.float64)
    half = head_dim // 2
    keep = (angles < math.pi / max(window, 1.0)) & (angles > 0.05 / max(window, 1.0))
    if not bool(keep.any()):
        keep = angles == angles[angles < math.pi / max(window, 1.0)].max()
    q[:half][keep] = 1.0
    q[half:][keep] = 1.0
    return q / q.norm()


@one_thread
def synth_moe(out: Path, *, shape: str, seed: int = 0, dtype: str = "float32", layers: int | None = None,
              profile: str | None = None, device: str = "cpu", recipe: RoutingProfile | None = None) -> Path:
    """Write a synthetic MoE checkpoint of `shape` to `out` (config.json + safetensors, as
    save_pretrained writes them) and return `out`. `layers` below the shape's depth keeps the real
    layer shapes with fewer layers; `profile` defaults to the published routing of the shape's family."""
    if shape not in MOE_SHAPES:
        raise ValueError(f"shape must be one of {', '.join(MOE_SHAPES)}, got {shape!r}")
    name = profile or ROUTING_OF[shape]
    if name not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {name!r}")
    p = recipe or PROFILES[name]  # `recipe`: a profile's knobs tried out before it gets a name
    config, family = _config(shape, layers, dtype)
    s = MOE_SHAPES[shape]
    H, E, hd = s["hidden"], s["experts"], s["head_dim"]
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)

    def normal(*size: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=dev, dtype=torch.float32) * std

    with torch.device(dev):
        model = model_class(family)(config)
    params = dict(model.named_parameters())
    drawn: set[str] = set()

    class _Into(dict):
        """Each drawn tensor goes straight into its parameter (one layer's experts are GBs)."""

        def __setitem__(self, name: str, value: torch.Tensor) -> None:
            with torch.no_grad():
                params[name].copy_(value)
            drawn.add(name)
    u = normal(H)
    u = u / u.norm()
    sd = _Into()
    norms: dict[str, float] = {}  # RMSNorm weights other than 1
    emb = normal(s["vocab"], H, std=1.0)
    emb = emb - (emb @ u)[:, None] * u[None, :]  # the random part is orthogonal to u ...
    sd["model.embed_tokens.weight"] = emb + p.shared * math.sqrt(H) * u[None, :]  # ... u's weight is set alone
    angles = _rotary_angles(config, hd)
    wq = _window_query(angles, p.window, hd).float().to(dev) if p.window > 0 else None
    # After input_layernorm (weight 1) every token has rms 1, so |x| = sqrt(H), and its component
    # along u is sqrt(H) sin(phi) with tan(phi) = shared (the random part is orthogonal to u).
    phi = math.atan(p.shared)
    along_u = math.sqrt(H) * math.sin(phi)
    qk_norm = family in ("qwen3_moe", "olmoe")  # q and k pass an RMSNorm before the rotary
    prev_router = None
    for li in range(config.num_hidden_layers):
        pre = f"model.layers.{li}."
        nq, nkv = s["heads"], s["kv_heads"]
        if wq is None:
            q = normal(nq * hd, H, std=INIT_STD)
            k = normal(nkv * hd, H, std=INIT_STD)
        else:
            # Each head's query and key are the unit vector wq times (u . x) times a gain, so the
            # score is sharpness x sum_i c_i^2 cos(angle_i d): highest for the token itself and
            # falling with distance. With a q/k RMSNorm the norm's weight sets the scale instead.
            gain = 1.0 if qk_norm else math.sqrt(p.sharpness * math.sqrt(hd)) / along_u
            q = (wq.repeat(nq)[:, None] * u[None, :]) * gain
            k = (wq.repeat(nkv)[:, None] * u[None, :]) * gain
            if qk_norm:
                norms[pre + "self_attn.q_norm.weight"] = math.sqrt(p.sharpness / math.sqrt(hd))
                norms[pre + "self_attn.k_norm.weight"] = math.sqrt(p.sharpness / math.sqrt(hd))
        sd[pre + "self_attn.q_proj.weight"] = q
        sd[pre + "self_attn.k_proj.weight"] = k
        # Values blind to u: the window carries only the tokens' own parts (u would add the same
        # vector to every token's context, shifting all routing alike: load skew, not locality).
        v = normal(nkv * hd, H, std=1.0 / math.sqrt(H))
        sd[pre + "self_attn.v_proj.weight"] = v - (v @ u)[:, None] * u[None, :]
        # The output projection writes the window's content orthogonally to u (u stays the shared
        # part); `context` sets its size against a token's own embedding.
        o = normal(H, nq * hd, std=p.context / math.sqrt(nq * hd))
        sd[pre + "self_attn.o_proj.weight"] = o - u[:, None] * (u[None, :] @ o)
        router = normal(E, H, std=1.0 / math.sqrt(H))
        router = router - (router @ u)[:, None] * u[None, :]
        if prev_router is not None and p.rho > 0:
            perm = torch.randperm(E, generator=g, device=dev)
            router = p.rho * prev_router[perm] + math.sqrt(1 - p.rho ** 2) * router
        prev_router = router
        # A token's random-part logit has std about cos(phi); the offset along u, bias_e x sqrt(H)
        # sin(phi), gets std skew x cos(phi).
        bias = normal(E, std=p.skew * math.cos(phi) / along_u) if p.skew > 0 and along_u > 0 \
            else torch.zeros(E, device=dev)
        sd[pre + "mlp.gate.weight"] = router + bias[:, None] * u[None, :]
        I = s["intermediate"]
        # Experts blind to u, in and out (as the values and lm_head are): every token carries the same
        # component along u, so an expert reading it would give every token's output a common part,
        # which the next layers' routers see as a per-expert offset, a load skew that grows with
        # depth (the Mixtral-8x7B shape's deeper layers reached 1.4-1.6 against the published 1.08-1.33).
        gate_up = normal(E, 2 * I, H, std=INIT_STD)
        down = normal(E, H, I, std=INIT_STD)
        for e in range(E):  # one expert at a time: a whole layer's temporaries would be GBs
            gate_up[e] -= (gate_up[e] @ u)[:, None] * u[None, :]
            down[e] -= u[:, None] * (u[None, :] @ down[e])
        sd[pre + "mlp.experts.gate_up_proj"] = gate_up
        sd[pre + "mlp.experts.down_proj"] = down
    head = normal(s["vocab"], H, std=p.readout / math.sqrt(H))
    sd["lm_head.weight"] = head - (head @ u)[:, None] * u[None, :]  # blind to u: no token wins every call
    missing = [n for n in params if n not in drawn and not n.endswith("norm.weight")]
    if missing:
        raise RuntimeError(f"synth_moe leaves {missing[:3]} at transformers' init: the recipe must draw them")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    with torch.no_grad():
        for n, prm in params.items():
            if n.endswith("norm.weight"):
                prm.fill_(norms.get(n, 1.0))
    model = model.to(torch_dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with os_errors():  # a full disk or a read-only mount: an OSError, as the command expects
        model.save_pretrained(out)
    recipe = {"shape": shape, "seed": seed, "dtype": dtype, "layers": config.num_hidden_layers,
              "profile": name, **asdict(p)}
    (out / "packbench_synth.json").write_text(json.dumps(recipe, indent=1, sort_keys=True))
    return out
