"""Mixture-of-Experts checkpoints as core sees them, torch-free: the families packbench runs,
their real and test shapes, the loader policies that fit an MoE model, and the byte arithmetic
the schema's refusals use (an expert's bytes, one layer's routed experts).

Layer rule: core. Imports nothing outside core (no torch, no transformers).
"""

from dataclasses import dataclass
from typing import Any

from packbench.core.registry import DTYPE_NAMES, MAX_SEED, SynthArgumentError

from packbench.core.conditions import CONDITIONS

# config.json's `model_type` -> what transformers calls the family's causal LM, and the config
# keys of its expert count and expert width. (transformers 5.2x writes Qwen3-MoE's and OLMoE's
# expert count as `num_local_experts`, the published config.json says `num_experts`: either is read.)
FAMILIES: dict[str, dict[str, str]] = {
    "mixtral": dict(model="MixtralForCausalLM", experts="num_local_experts", intermediate="intermediate_size"),
    "qwen3_moe": dict(model="Qwen3MoeForCausalLM", experts="num_experts", intermediate="moe_intermediate_size"),
    "olmoe": dict(model="OlmoeForCausalLM", experts="num_experts", intermediate="intermediate_size"),
}

# The kinds that run on an MoE model (their declaration's `families` holds "moe"): the loader
# policies defined at expert granularity (engine/moe/policies.py), accelerate's offload of the
# stock model, and host-experts (engine/moe/host_experts.py). Every other kind moves OPT's neuron
# rows and is refused for an MoE model; a kind for MoE models alone is refused for OPT.
MOE_POLICIES = tuple(n for n, k in CONDITIONS.items() if "moe" in k.families)
# Kinds that place the device part themselves and hold no expert buffers of packbench's: their
# need is the allowance's global floor (accelerate fills what is left with whole layers).
NO_EXPERT_BUFFERS = tuple(n for n, k in CONDITIONS.items() if "moe" in k.families and k.competitor is not None)
CACHE_POLICIES = ("expert-cache", "expert-forecast")  # MoE models alone: core/conditions families ("moe",)

# Real shapes (each model's published config.json) and tiny test shapes of each family.
MOE_SHAPES: dict[str, dict] = {
    "mixtral-8x7b": dict(family="mixtral", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                         head_dim=128, experts=8, k=2, vocab=32000, norm_topk_prob=True),
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden=2048, intermediate=768, layers=48, heads=32, kv_heads=4,
                          head_dim=128, experts=128, k=8, vocab=151936, norm_topk_prob=True),
    "olmoe-1b-7b": dict(family="olmoe", hidden=2048, intermediate=1024, layers=16, heads=16, kv_heads=16,
                        head_dim=128, experts=64, k=8, vocab=50304, norm_topk_prob=False),
    "mixtral-tiny": dict(family="mixtral", hidden=64, intermediate=96, layers=3, heads=4, kv_heads=2,
                         head_dim=16, experts=8, k=2, vocab=512, norm_topk_prob=True),
    "qwen3-moe-tiny": dict(family="qwen3_moe", hidden=64, intermediate=32, layers=3, heads=4, kv_heads=2,
                           head_dim=16, experts=16, k=4, vocab=512, norm_topk_prob=True),
    "olmoe-tiny": dict(family="olmoe", hidden=64, intermediate=32, layers=3, heads=4, kv_heads=4,
                       head_dim=16, experts=16, k=4, vocab=512, norm_topk_prob=False),
}
# Which published routing figures a shape is calibrated to (core/routing.py PUBLISHED).
ROUTING_OF = {"mixtral-8x7b": "mixtral", "mixtral-tiny": "mixtral", "qwen3-30b-a3b": "olmoe",
              "olmoe-1b-7b": "olmoe", "qwen3-moe-tiny": "olmoe", "olmoe-tiny": "olmoe"}

# The routing profiles of engine/moe/synth.py PROFILES (tests/engine/test_moe_synth.py holds them equal):
# each shape's default is the published routing it is calibrated to (ROUTING_OF); `uniform` is the
# random router the calibration is judged against.
ROUTING_PROFILES = ("mixtral", "olmoe", "uniform")
# config.json's max_position_embeddings of every synthetic MoE checkpoint (engine/moe/synth.py moe_config).
MAX_POSITIONS = 4096

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
INDEX_BYTES = 8  # engine/moe/policies.py INDEX_DTYPE is int64: core/charges.py INDEX_BYTES, the ledger's rule


def moe_config(shape: str, *, layers: int | None = None, dtype: str = "float32") -> dict:
    """The config.json of a synthetic checkpoint of `shape` (core/moe.py MOE_SHAPES)."""
    s = MOE_SHAPES[shape]
    common = dict(hidden_size=s["hidden"], num_hidden_layers=layers or s["layers"], num_attention_heads=s["heads"],
                  num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], vocab_size=s["vocab"],
                  num_experts_per_tok=s["k"], max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  dtype=dtype, output_router_logits=False, router_aux_loss_coef=0.0)
    if s["family"] == "mixtral":
        return dict(model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=s["intermediate"],
                    num_local_experts=s["experts"], rope_theta=1e6, sliding_window=None, **common)
    if s["family"] == "qwen3_moe":
        return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=s["intermediate"],
                    intermediate_size=s["intermediate"] * 8, num_experts=s["experts"], decoder_sparse_step=1,
                    mlp_only_layers=[], norm_topk_prob=s["norm_topk_prob"], rope_theta=1e6, **common)
    return dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], intermediate_size=s["intermediate"],
                num_experts=s["experts"], norm_topk_prob=s["norm_topk_prob"], rope_theta=1e4, clip_qkv=None, **common)


def is_moe_shape(shape: Any) -> bool:
    return isinstance(shape, str) and shape in MOE_SHAPES


def moe_synth_spec(*, shape: Any, dtype: Any, seed: Any, layers: Any = None, routing: Any = None) -> dict[str, Any]:
    """A protocol's `model.synth` for an MoE shape, checked and normalised: {shape, dtype, seed,
    layers, routing}, every field written out (`layers` defaults to the shape's depth, `routing` to
    its published routing, ROUTING_OF), so the frozen body says what the worker generates
    (engine/moe/synth.py synth_moe). Raises SynthArgumentError for the first bad argument."""
    if not is_moe_shape(shape):
        raise SynthArgumentError("shape", shape, f"one of {', '.join(MOE_SHAPES)}", choice=True)
    if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
        raise SynthArgumentError("dtype", dtype, f"one of {', '.join(DTYPE_NAMES)}", choice=True)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SynthArgumentError("seed", seed, f"an integer in [0, {MAX_SEED}]", choice=False)
    depth = MOE_SHAPES[shape]["layers"]
    if layers is None:
        layers = depth
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= depth:
        raise SynthArgumentError("layers", layers, f"an integer in [1, {depth}] ({shape}'s depth; fewer layers keep "
                                                   f"the real layer shapes)", choice=False)
    if routing is None:
        routing = ROUTING_OF[shape]
    if not isinstance(routing, str) or routing not in ROUTING_PROFILES:
        raise SynthArgumentError("routing", routing, f"one of {', '.join(ROUTING_PROFILES)}", choice=True)
    return {"shape": shape, "dtype": dtype, "seed": seed, "layers": layers, "routing": routing}


def family_of_shape(shape: str) -> str:
    """config.json's model_type of a synthetic MoE shape."""
    return MOE_SHAPES[shape]["family"]


@dataclass(frozen=True)
class MoeShape:
    """What the byte arithmetic needs of an MoE model."""

    hidden: int
    intermediate: int
    layers: int
    experts: int
    k: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    # Layers without experts (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`): a dense MLP
    # of `dense_intermediate` on the device, nothing to move. No named shape has one.
    dense_layers: int = 0
    dense_intermediate: int = 0

    @property
    def moe_layers(self) -> int:
        """The layers whose experts stay on the host: what every expert policy moves, per layer."""
        return self.layers - self.dense_layers

    @classmethod
    def of(cls, shape: str, *, layers: int | None = None) -> "MoeShape":
        s = MOE_SHAPES[shape]
        return cls(hidden=s["hidden"], intermediate=s["intermediate"], layers=layers or s["layers"],
                   experts=s["experts"], k=s["k"], vocab=s["vocab"], heads=s["heads"], kv_heads=s["kv_heads"],
                   head_dim=s["head_dim"])

    def expert_bytes(self, dtype: str) -> int:
        """gate_up (2 x intermediate, hidden) + down (hidden, intermediate)."""
        return 3 * self.hidden * self.intermediate * DTYPE_BYTES[dtype]

    def device_part_bytes(self, dtype: str) -> int:
        """What a CPU-first MoE model places on the device: embeddings, lm_head, attention, norms,
        routers (experts excluded)."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        per_layer = attn + 2 * self.hidden
        routers = self.moe_layers * self.experts * self.hidden
        dense_mlps = self.dense_layers * 3 * self.hidden * self.dense_intermediate
        return (2 * self.vocab * self.hidden + self.layers * per_layer + routers + dense_mlps + self.hidden) * \
            DTYPE_BYTES[dtype]

    def layer_bytes(self, dtype: str) -> int:
        """One decoder layer's weights: its experts, attention, router and norms (what accelerate's
        hooks copy for a layer they offload)."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return self.experts * self.expert_bytes(dtype) + (attn + self.experts * self.hidden + 2 * self.hidden) * \
            DTYPE_BYTES[dtype]

    def dense_layer_bytes(self, dtype: str) -> int:
        """One layer without experts: its dense MLP, attention and norms (accelerate's hooks copy it)."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return (3 * self.hidden * self.dense_intermediate + attn + 2 * self.hidden) * DTYPE_BYTES[dtype]

    def routed_bytes(self, dtype: str, tokens: int) -> int:
        """One layer's routed experts for a call of `tokens` tokens at most, and their indices."""
        m = min(self.experts, self.k * tokens)
        return m * (self.expert_bytes(dtype) + INDEX_BYTES)


def config_experts(config: dict):
    """The expert count of an MoE config.json, under either name."""
    key = FAMILIES[config["model_type"]]["experts"]
    return config.get(key, config.get("num_local_experts", config.get("num_experts")))


def shape_of_config(config: dict) -> MoeShape:
    """The byte arithmetic's view of an MoE config.json (its family's keys, FAMILIES)."""
    f = FAMILIES[config["model_type"]]
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    dense = 0
    if config["model_type"] == "qwen3_moe":  # transformers: layer i has experts iff i is not in
        # mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (engine/config.py checks both keys)
        step, only = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or [])
        dense = sum(1 for i in range(layers) if i in only or (i + 1) % step)
    return MoeShape(hidden=config["hidden_size"], intermediate=config[f["intermediate"]],
                    layers=layers, experts=config_experts(config), k=config["num_experts_per_tok"],
                    vocab=config["vocab_size"], heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
                    head_dim=config.get("head_dim") or config["hidden_size"] // heads, dense_layers=dense,
                    dense_intermediate=config.get("intermediate_size", 0) if dense else 0)


def forecasting(policy: str, params: dict) -> bool:
    """Whether an expert policy prefetches forecast experts (expert-forecast, expert-cache forecast on)."""
    return policy == "expert-forecast" or (policy == "expert-cache" and params.get("forecast") == "on")


def policy_need_bytes(shape: MoeShape, dtype: str, policy: str, gather: str = "host", params: dict | None = None) -> int:
    """Device bytes an expert policy holds besides the device part (engine/moe/policies.py,
    cache.py): none for accelerate (it places what fits itself); host-experts its `hot` experts a
    layer; resident every layer's experts; dense-stream one layer's workspace; packet and
    phase-switched the workspace, and with the host gather the landing buffer of a layer's packet
    (every expert of a layer and its index); expert-cache its c slots in every layer and the
    workspace, two workspaces when it forecasts (the prefetch lands in the one the current layer
    does not read); expert-forecast those two workspaces."""
    layer = shape.experts * shape.expert_bytes(dtype)
    params = params or {}
    if policy == "host-experts":
        return shape.moe_layers * min(params.get("hot", 0), shape.experts) * shape.expert_bytes(dtype)
    if policy in NO_EXPERT_BUFFERS:
        return 0
    if policy == "resident":
        return shape.moe_layers * layer
    if policy in CACHE_POLICIES:
        slots = params.get("capacity", 0) * shape.moe_layers * shape.expert_bytes(dtype)
        return slots + (2 if forecasting(policy, params) else 1) * layer
    if policy == "dense-stream" or gather in ("device", "mapped"):
        return layer  # the mapped gather's k one-token slots are the workspace's first k
    return layer + shape.experts * (shape.expert_bytes(dtype) + INDEX_BYTES)


def family_refusal(conditions: list[tuple[str, str, dict]], *, family: str, model: str) -> tuple[str, str] | None:
    """(field, why) the first condition whose kind does not run on model family `family` ("opt" or
    "moe", core/conditions/base.py MODEL_FAMILIES), or None. Pure."""
    fits = tuple(n for n, k in CONDITIONS.items() if family in k.families)
    for i, (name, policy, params) in enumerate(conditions):
        if family not in CONDITIONS[policy].families:
            what = "an OPT model" if family == "opt" else "an MoE model"
            return (f"conditions[{i}].policy", f"{policy!r} does not fit {model}, {what}; use one of {', '.join(fits)}")
    return None


def moe_refusal(config: dict, *, dtype: str, conditions: list[tuple[str, str, dict]], allowance_bytes: int,
                model: str) -> tuple[str, str] | None:
    """(field, why) a protocol's conditions cannot run on MoE checkpoint `config`, or None. Pure:
    submit and `protocol check` call it with config.json's mapping (shape_refusal says the rest)."""
    return shape_refusal(shape_of_config(config), config["model_type"], dtype=dtype, conditions=conditions,
                         allowance_bytes=allowance_bytes, model=model)


def capacity_refusal(capacity: int, experts: int, model: str) -> str | None:
    """Why an expert cache of `capacity` experts a layer cannot run on `model` of `experts` a layer,
    or None. A capacity beyond the experts would run as a cache of all of them, labelled with a size
    it never had: submit (shape_refusal) and `simulate` (core/simulate.py) both refuse it here."""
    if capacity > experts:
        return f"{capacity} experts a layer, but {model} has {experts}; give a capacity from 0 to {experts}"
    return None


def shape_refusal(s: MoeShape, family: str, *, dtype: str, conditions: list[tuple[str, str, dict]],
                  allowance_bytes: int, model: str) -> tuple[str, str] | None:
    """(field, why) a protocol's conditions cannot run on an MoE model of shape `s`, or None. Pure:
    the schema calls it for a synthetic MoE shape, submit for an MoE checkpoint. A policy that
    moves OPT's neuron rows does not fit the family; an allowance must hold the device part plus
    one layer's routed experts (the least any expert policy moves) and what the policy's buffers
    hold. (In mode graph a policy that reads the routing back runs eagerly, as OPT's do: no refusal.)"""
    for i, (name, policy, params) in enumerate(conditions):
        if policy not in MOE_POLICIES:
            return (f"conditions[{i}].policy", f"{policy!r} does not fit {model}, a {family} MoE "
                                               f"model; use one of {', '.join(MOE_POLICIES)}")
        if params.get("gather") == "mapped" and policy not in ("packet", "phase-switched"):
            return (f"conditions[{i}].params.gather", "mapped is an expert packet's gather; drop it")
        if params.get("weights", "dtype") != "dtype":
            return (f"conditions[{i}].params.weights", f"{params['weights']} is not available for MoE models; "
                                                       f"drop it")
        why = capacity_refusal(params["capacity"], s.experts, model) if policy == "expert-cache" else None
        if why:
            return (f"conditions[{i}].params.capacity", why)
        if params.get("hot", 0) > s.experts:
            return (f"conditions[{i}].params.hot", f"{params['hot']} is more than the {s.experts} experts of a "
                                                   f"layer of {model}; give at most {s.experts}")
    part, routed = s.device_part_bytes(dtype), s.routed_bytes(dtype, 1)
    if allowance_bytes < part + routed:
        return ("allowance_mib", f"{allowance_bytes // 2**20} MiB cannot hold {model}'s device part "
                                 f"({part / 2**20:.0f} MiB) and one layer's routed experts ({routed / 2**20:.1f} MiB); "
                                 f"raise allowance_mib to at least {-(-(part + routed) // 2**20)}")
    for i, (name, policy, params) in enumerate(conditions):
        if policy == "resident" and params.get("allowance") == "unbounded":
            continue
        need = part + policy_need_bytes(s, dtype, policy, params.get("gather", "host"), params)
        if allowance_bytes < need and policy == "expert-cache":
            slots = params["capacity"] * s.moe_layers * s.expert_bytes(dtype)
            return ("allowance_mib", f"{allowance_bytes // 2**20} MiB cannot hold condition {name!r} (expert-cache): "
                                     f"its capacity {params['capacity']} x {s.moe_layers} MoE layers x "
                                     f"{s.expert_bytes(dtype) / 2**20:.1f} MiB an expert = {slots / 2**20:.0f} MiB of "
                                     f"cache, with the device part and workspace {-(-need // 2**20)} MiB; lower "
                                     f"capacity or raise allowance_mib")
        if allowance_bytes < need:
            return ("allowance_mib", f"{allowance_bytes // 2**20} MiB cannot hold condition {name!r} ({policy}) on "
                                     f"{model}: the device part and its expert buffers need {-(-need // 2**20)} MiB; "
                                     f"raise allowance_mib or drop the condition")
    return None


def call_bytes(shape: MoeShape, dtype: str, policy: str, *, tokens: int, phase: str, gather: str = "device",
               hot: int = 0, params: dict | None = None) -> int:
    """Host-to-device bytes one call moves, all MoE layers: exact for dense-stream, resident and
    host-experts (the experts' outputs coming back, one hidden-sized row a token a layer; its `hot`
    experts a layer moved once, in the prefill call: at most the outputs then), llama-cpp's by
    llama.cpp's rules (its host layers' float32 expert outputs; with `op_offload: on`, a call of 32
    tokens or more copies their experts: at most every one, `params` its n_cpu_moe, omitted every layer's), at most for a
    packet (the union of `tokens` tokens' k experts a layer is at most min(E, k x tokens)), for
    accelerate (every layer offloaded: its whole weights each call) and for an expert cache (only
    its misses move: at most the packet's experts, no index); for expert-forecast the packet's
    experts, at least in a call of one token (wrong forecasts add, up to min(E, k x tokens) more a
    layer), about in a longer one (its tokens may share experts: fewer than min(E, k x tokens))."""
    if policy in CACHE_POLICIES:
        gather = "device"  # the cache's fetches and prefetches are device-gather copies: no index
    layer_all = shape.experts * shape.expert_bytes(dtype)
    if policy == "resident":
        return 0
    if policy == "llama-cpp":  # by llama.cpp's scheduler's rules: core/conditions/llama_cpp.py
        from packbench.core.conditions.llama_cpp import F32, OP_OFFLOAD_MIN_BATCH

        params = params or {}
        given = params.get("n_cpu_moe")  # None (omitted): chosen on the worker, at most every layer
        host = shape.moe_layers if given is None else min(given, shape.moe_layers)
        copied = params.get("op_offload", "off") == "on" and tokens >= OP_OFFLOAD_MIN_BATCH
        return host * (tokens * shape.hidden * F32 + (layer_all if copied else 0))
    if policy == "host-experts":
        placed = min(hot, shape.experts) * shape.expert_bytes(dtype) if phase == "prefill" else 0
        return shape.moe_layers * (tokens * shape.hidden * DTYPE_BYTES[dtype] + placed)
    if policy == "accelerate":
        return shape.moe_layers * shape.layer_bytes(dtype) + shape.dense_layers * shape.dense_layer_bytes(dtype)
    if policy == "dense-stream" or (policy == "phase-switched" and phase == "prefill"):
        return shape.moe_layers * layer_all
    m = min(shape.experts, shape.k * tokens)
    index = INDEX_BYTES * m if gather == "host" else 0  # device and mapped gathers upload no index
    return shape.moe_layers * (m * shape.expert_bytes(dtype) + index)


def call_bytes_bound(policy: str, params: dict, *, tokens: int = 1) -> str:
    """How `call_bytes` bounds what `policy` moves in calls of at most `tokens` tokens: exact
    (resident, dense-stream), at most (a packet, a cache: misses only), at least (a forecast alone
    in one-token calls: the estimate is then the exact demand, and wrong forecasts add), about (a
    forecast alone in longer calls, whose tokens may share experts, so the demand can be below the
    estimate; a cache that forecasts: fewer misses, some waste)."""
    if policy in ("resident", "dense-stream"):
        return "exact"
    if policy == "llama-cpp":
        from packbench.core.conditions.llama_cpp import OP_OFFLOAD_MIN_BATCH

        copies = params.get("op_offload", "off") == "on" and tokens >= OP_OFFLOAD_MIN_BATCH
        return "at most" if copies or params.get("n_cpu_moe") is None else "exact"
    if policy == "expert-forecast":
        return "at least" if tokens == 1 else "about"
    return "about" if forecasting(policy, params) else "at most"
