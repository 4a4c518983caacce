"""`CpuFirstMoE`: a transformers MoE model (Mixtral, Qwen3-MoE, OLMoE) whose experts stay in host
memory behind an expert loader policy; attention, norms, routers, embeddings and lm_head (and
any shared expert) live on the device.

The expert arithmetic is stock transformers' own expert loop (`experts_implementation`
"eager": for each routed expert, in ascending id order, its tokens' rows through `gate_up`,
the activation, `down`, scaled by the routing weight and index-added), run over the policy's
device tensors. Every policy therefore multiplies the same rows by the same weights in the
same order, whatever the number of tokens per expert: logits are bit-identical across policies
and to stock transformers with the weights resident. (The grouped and batched kernels of other
`experts_implementation`s reduce in another order and would not be; they are never used here.)
A policy that keeps the routing on the device (`packet {gather: mapped}`) computes a call of one
token with that loop's arithmetic minus its host decisions (engine/moe/gather.py
single_token_experts): the same bits.

Modes: "eager", and "graph": on CUDA, each layer's experts of a one-token call under a policy
that keeps the routing on the device (the mapped gather) are captured as one CUDA graph per
layer at the first such call (after an eager run that warms the kernels up) and replayed after;
attention, norms and routers run eagerly between them with stock shapes (DynamicCache), so the
logits keep stock's bits. Policies that read the routing back run the same forward eagerly in
mode graph (their step cannot be captured), as OPT's do (engine/graph.py). On the CPU nothing is
captured (the CPU twin).
"""

import time
from pathlib import Path

import torch

from packbench.core import charges
from packbench.core.errors import CheckpointError
from packbench.core.expert_cache import episode_figures
from packbench.core.moe import FAMILIES
from packbench.core.text import one_line, show
from packbench.engine.hf import cache_keyword
from packbench.engine.ledger import Recorder
from packbench.engine.model import StartStats  # host_outgoing_bytes: the experts, in host memory
from packbench.engine.moe.cache import CACHE_KINDS, ExpertCache
from packbench.engine.moe.host import ExpertHost
from packbench.engine.moe.policies import EXPERT_POLICIES, MAPPED_POLICIES, ExpertPolicy

MOE_MODES = ("eager", "graph")  # engine/graph.py MODES, the protocol's engine.mode


class MoeCheckpointError(CheckpointError, ValueError):
    """A checkpoint packbench cannot run as an MoE model (the message names the fix)."""


def moe_family(model_dir: Path) -> str | None:
    """config.json's model_type when it is an MoE family packbench runs, else None."""
    from packbench.core.files import read_json_object

    try:
        config = read_json_object(Path(model_dir) / "config.json", limit=1 << 20)
    except (OSError, ValueError):  # a FIFO, /dev/zero, no JSON object: read_config names it
        return None
    kind = config.get("model_type")
    return kind if isinstance(kind, str) and kind in FAMILIES else None


def model_class(family: str):
    import transformers

    return getattr(transformers, FAMILIES[family]["model"])


def load_stock(model_dir: Path, *, family: str, dtype: torch.dtype):
    """Stock transformers' model of an MoE checkpoint, in host memory, its tensors exactly the
    checkpoint's. transformers initialises a tensor the files lack (or hold in another shape) at
    random and prints a report of many lines; here any such tensor, and a config.json its config
    class or model refuses, is one MoeCheckpointError line (read_config checked the integers)."""
    from transformers.activations import ACT2FN
    from transformers.utils import logging as hf_logging

    from packbench.engine.config import check_weight_files, read_config

    read_config(model_dir)
    check_weight_files(model_dir, moe=True)
    cls = model_class(family)
    try:
        config = cls.config_class.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 transformers' own validation raises its own types (StrictDataclass...)
        raise MoeCheckpointError(f"{model_dir}/config.json: transformers' {family} config refuses it "
                                 f"({one_line(' '.join(str(e).split()))[:200]}); fix config.json") from None  # its lines as one
    act = getattr(config, "hidden_act", "silu")
    if not isinstance(act, str) or act not in ACT2FN:
        raise MoeCheckpointError(f"{model_dir}/config.json: hidden_act {show(act)} is not an activation "
                                 f"transformers has; fix config.json")
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the load report: what it says is the one line below
    hf_logging.disable_progress_bar()
    try:
        # ignore_mismatched_sizes: a tensor of another shape is listed in `info`, not raised after the report
        model, info = cls.from_pretrained(model_dir, config=config, dtype=dtype, attn_implementation="eager",
                                          output_loading_info=True, ignore_mismatched_sizes=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    for key, what in (("missing_keys", "lacks {n} tensors a {family} model as config.json describes it has"),
                      ("mismatched_keys", "holds {n} tensors in other shapes than config.json gives them"),
                      ("unexpected_keys", "holds {n} tensors a {family} model as config.json describes it has no "
                                          "place for")):
        # mismatched_keys are (name, its shape, the model's shape)
        names = sorted(str(n[0] if isinstance(n, tuple) else n) for n in info.get(key) or ())
        if names:
            raise MoeCheckpointError(f"{model_dir}: the checkpoint {what.format(n=len(names), family=family)} "
                                     f"(first: {show(names[0])}); regenerate the checkpoint or fix config.json")
    return model


def force_eager(config) -> None:
    """Eager attention (SDPA is not reproducible run to run on CUDA in decode) and the eager
    expert loop (the one path every policy shares)."""
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation") or "experts_implementation" in getattr(config, "__dict__", {}):
        config._experts_implementation = "eager"


def _experts_modules(model) -> list:
    """Per decoder layer, its experts module (fused 3-D `gate_up_proj` / `down_proj`) or None."""
    out = []
    for layer in model.model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None and not hasattr(experts, "gate_up_proj"):
            raise MoeCheckpointError(
                f"this transformers keeps {type(experts).__name__} as separate modules, not fused 3-D tensors; "
                f"packbench's MoE engine needs transformers >= 5 (pip install 'transformers>=5')")
        out.append(experts)
    return out


def _param_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class CpuFirstMoE:
    """Reads an MoE checkpoint into host memory, keeps the experts there, moves the rest.

    Offers what the episode loop and the worker read from a model: `device`, `recorder`, `mode`
    ("eager" only), `new_cache`, `forward`, `use`/`use_policy`, `slot.policy`, `host`,
    `start`, `weights`, `vocab`. `routes[c][l]` is the sorted tuple of experts call c routed to
    in layer l (None where the policy did not read the routing back, or a dense layer): the
    per-call, per-layer trace of experts.
    """

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device, mode: str = "eager") -> None:
        if mode not in MOE_MODES:
            raise MoeCheckpointError(f"mode {mode} is not available for MoE models; freeze the protocol "
                                     f"with engine mode {' or '.join(MOE_MODES)}")
        family = moe_family(model_dir)
        if family is None:
            raise MoeCheckpointError(f"{model_dir}/config.json is not one of the MoE families "
                                     f"{', '.join(FAMILIES)}; give an MoE checkpoint")
        self.family, self.mode, self.device, self.dtype, self.model_dir = family, mode, device, dtype, Path(model_dir)
        t0 = time.perf_counter()
        model = load_stock(model_dir, family=family, dtype=dtype)  # into host memory
        force_eager(model.config)
        model.eval()
        t1 = time.perf_counter()
        self.experts_modules = _experts_modules(model)
        # Each layer's forecast target (forecast_target), fixed by the model: found once, not per call.
        with_experts = [i for i, e in enumerate(self.experts_modules) if e is not None]
        self._targets = [next((n for n in with_experts if n > i), None) for i in range(len(self.experts_modules))]
        gate_up, down = [], []
        for experts in self.experts_modules:
            if experts is None:
                gate_up.append(None), down.append(None)
                continue
            gate_up.append(experts.gate_up_proj.detach())
            down.append(experts.down_proj.detach())
            # The fused tensors stop being parameters: they never move with the model.
            del experts._parameters["gate_up_proj"], experts._parameters["down_proj"]
        self.host = ExpertHost(gate_up, down, pin=device.type == "cuda")
        del gate_up, down
        self.weights = model.to(device)
        self.recorder = Recorder(len(self.experts_modules))
        self.slot = _Slot()
        self.routes: list[list[tuple[int, ...] | None]] = []
        self.graphs = LayerGraphs()
        for i, e in enumerate(self.experts_modules):
            if e is not None:  # the instance's forward: nn.Module.__call__ reads self.forward
                e.forward = self._experts_forward(i, e, e.forward)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.start = StartStats(read_s=t1 - t0, place_s=time.perf_counter() - t1,
                                device_param_bytes=_param_bytes(self.weights),
                                host_outgoing_bytes=self.host.host_bytes)
        self.config = model.config
        self.vocab = model.config.vocab_size
        self.model = model
        self._cache_kw = cache_keyword(model)
        self._park_empty()

    def _park_empty(self) -> None:
        # Until a policy is active the experts modules hold nothing (a call without one fails loudly).
        for e in self.experts_modules:
            if e is not None:
                e.gate_up_proj = e.down_proj = None

    def _experts_forward(self, layer: int, module, stock_forward):
        """Layer `layer`'s experts forward, wrapping stock transformers' (`stock_forward`, the
        class's eager loop, bound): a policy that `computes` the experts itself (host-experts) gets
        the call with the stock loop to run over weights of its choosing; a mapped gather
        (`on_device`) reads the routed experts with the routing on the device; every other policy
        places the weights for the routed set (read back when it `observes`), prefetches the forecast
        experts of the next layer with experts when it `forecasts`, and the stock loop runs over them."""

        def stock(gate_up, down, hidden_states, top_k_index, top_k_weights):
            module.gate_up_proj, module.down_proj = gate_up, down
            return stock_forward(hidden_states, top_k_index, top_k_weights)

        def forward(hidden_states, top_k_index, top_k_weights):
            policy = self.slot.policy
            if getattr(policy, "computes", False):
                return policy.compute(layer, stock, hidden_states, top_k_index, top_k_weights)
            if getattr(policy, "on_device", False):  # the routing never leaves the device
                if hidden_states.shape[0] == 1 and policy.takes_single_token():
                    out = self.graphs.run(self, layer, policy, hidden_states, top_k_index, top_k_weights,
                                          module.act_fn)
                    policy.charge_single_token(layer, top_k_index.shape[1])
                    return out
                module.gate_up_proj, module.down_proj = policy.union(layer, top_k_index)
                return stock_forward(hidden_states, top_k_index, top_k_weights)
            routed = None
            if policy.observes():
                # (tokens, k) expert ids -> which experts this call routed to: E bytes read back.
                hit = torch.bincount(top_k_index.reshape(-1), minlength=self.host.experts) > 0
                routed = hit.nonzero().reshape(-1).cpu().tolist()
                self.recorder.add(layer, **charges.activity_readback(len(routed), self.host.experts))
                if self.recorder.current is not None:
                    self._call_routes()[layer] = tuple(routed)
            module.gate_up_proj, module.down_proj = policy.experts(layer, routed)
            if policy.forecasts():
                forecast = self.forecast(layer, (hidden_states, top_k_index), {})
                if forecast is not None:
                    policy.prefetch(self.forecast_target(layer), forecast)
            return stock_forward(hidden_states, top_k_index, top_k_weights)
        return forward

    def forecast_target(self, layer: int) -> int | None:
        """The layer a forecast made in layer `layer` is for: the next layer with experts (l+1
        where every layer has them; a Qwen3-MoE with `mlp_only_layers` or `decoder_sparse_step`
        skips its dense layers), None after the last one."""
        return self._targets[layer]

    def forecast(self, layer: int, args: tuple, kwargs: dict) -> list[int] | None:
        """The experts the next layer with experts (`forecast_target`) picks by its router
        applied to layer l's MoE input (an experts module's call `args`/`kwargs`): only what the
        model has computed. None after the last layer with experts. `expert-forecast` prefetches
        them; a trace records them."""
        nxt = self.forecast_target(layer)
        if nxt is None:
            return None
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        hidden = args[0] if args else kwargs["hidden_states"]
        index = _forecast_index(self.model.model.layers[nxt].mlp.gate(hidden), k=top_k_index.shape[-1])
        hit = torch.bincount(index.reshape(-1), minlength=self.host.experts) > 0
        return hit.nonzero().reshape(-1).cpu().tolist()

    def _call_routes(self) -> list:
        index = self.recorder.current.index
        while len(self.routes) <= index:
            self.routes.append([None] * self.recorder.layers)
        return self.routes[index]

    def use(self, policy_name: str, **params) -> None:
        """A fresh MoE policy of kind `policy_name`. The parameters read are OPT's row formats
        (`gather`, `weights`), the expert cache's (`capacity`, `rule`, `forecast`) and host-experts'
        `hot`; `weights` other than the checkpoint's dtype is refused, anything else (a competitor's
        `mode`) ignored."""
        if params.get("weights", "dtype") != "dtype":
            raise MoeCheckpointError(f"weights {params['weights']} is not available for MoE models; "
                                     f"drop it from the condition")
        if policy_name in CACHE_KINDS:
            self.use_policy(CACHE_KINDS[policy_name](**params))
            return
        if policy_name not in EXPERT_POLICIES:
            raise MoeCheckpointError(f"policy {policy_name} does not fit an MoE model; use one of "
                                     f"{', '.join((*EXPERT_POLICIES, *CACHE_KINDS))}")
        self.use_policy(_expert_policy(policy_name, params))

    def use_policy(self, policy) -> None:
        """Activate `policy`, releasing the previous one. An OPT loader policy of the same name
        (what the condition runtimes build) is replaced by its expert version."""
        known = (*EXPERT_POLICIES.values(), *MAPPED_POLICIES.values())
        if isinstance(policy, ExpertCache):
            pass  # a kind for MoE models alone: built for this model by its runtime
        elif not isinstance(policy, ExpertPolicy) or type(policy) not in known:
            name = getattr(policy, "name", type(policy).__name__)
            if name not in EXPERT_POLICIES:
                raise MoeCheckpointError(f"policy {name} does not fit an MoE model; use one of "
                                         f"{', '.join(EXPERT_POLICIES)}")
            policy = _expert_policy(name, {"gather": getattr(policy, "gather", "host")})
        self.release_policy()
        self.routes = []
        policy.activate(self.host, self.device, self.recorder)
        self.slot.policy = policy

    def release_policy(self) -> None:
        """Deactivate the active policy, if any, and free its device buffers: its captured
        layer graphs, and the experts modules' references to its tensors (which kept them alive
        while a competitor ran). Before another policy, or a competitor that must have the
        allowance to itself."""
        self.graphs.clear()  # a capture holds the previous policy's buffers
        if self.slot.policy is not None:
            self.slot.policy.deactivate()
            self.slot.policy = None
            self._park_empty()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def expert_record(self) -> dict | None:
        """The episode record's `experts` section for a cache or forecast policy (None for the
        others): its parameters and counts, the episode's routing, and the figures a replay of
        that routing gives (core/expert_cache.py episode_figures: hit rates beside Belady's)."""
        policy = self.slot.policy
        if not isinstance(policy, ExpertCache):
            return None
        phases = [c.phase for c in self.recorder.calls]
        figures = policy.figures()
        routes = [[None if r is None else list(r) for r in call] for call in self.routes]
        return {**figures, "routes": routes,
                **episode_figures(routes, phases, capacity=policy.capacity, rule=policy.rule,
                                  forecasts=[[None if c is None else c.get("forecast") for c in call]
                                             for call in figures["counted"]])}

    def new_cache(self, capacity: int | None = None, *, mode: str | None = None, batch: int = 1):
        mode = mode or self.mode
        if mode not in MOE_MODES:
            raise MoeCheckpointError(f"MoE models run in mode {' or '.join(MOE_MODES)}; freeze the protocol with one")
        from transformers import DynamicCache

        cache = DynamicCache()
        # What the episode record says of mode graph (engine/episode.py reads `graph` / `eager_reason`).
        self.graphs.enabled = mode == "graph"
        cache.graph, cache.eager_reason = (self.graphs, None) if self.graphs.captures(self) else \
            (None, self.graphs.refusal(self))
        return cache

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One call: (B, T) ids in, last-position logits out, (vocab,) at batch 1."""
        out = self.model(input_ids=ids, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1] if ids.shape[0] == 1 else out.logits[:, -1]


def _forecast_index(out, *, k: int) -> torch.Tensor:
    """The expert ids a router's output picks: transformers 5's top-k routers return (logits,
    scores, indices), the last is the choice; a router that returns its logits alone is read by
    its k largest (the softmax keeps their order)."""
    return out[-1] if isinstance(out, tuple) else torch.topk(out, k, dim=-1).indices


def _expert_policy(name: str, params: dict) -> ExpertPolicy:
    """A fresh expert policy; packet and phase-switched keep the kind's `gather` (mapped: the
    on-device gather), host-experts its `hot`."""
    if params.get("gather") == "mapped" and name in MAPPED_POLICIES:
        return MAPPED_POLICIES[name]()
    cls = EXPERT_POLICIES[name]
    if name in ("packet", "phase-switched"):
        return cls(gather=params.get("gather", "host"))
    return cls(hot=params.get("hot", 0)) if name == "host-experts" else cls()


class _Slot:
    """Which expert policy the layers use now."""

    def __init__(self) -> None:
        self.policy: ExpertPolicy | None = None


class LayerGraphs:
    """Mode graph's captures: per layer, one CUDA graph of a one-token call's experts under a
    policy that keeps the routing on the device (gather, sort, k expert products), with its static
    inputs (hidden (1, H), top-k ids and weights (1, k)) and output. Captured at a layer's first
    such call after that call has run eagerly on a side stream (kernels compiled, cuBLAS's
    workspace made); later calls copy their inputs in and replay. All layers share one memory
    pool; `clear` drops them when the policy changes. Off CUDA, or off mode graph, `run` is the
    eager call."""

    def __init__(self) -> None:
        self.enabled = False
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        self.capture_s = 0.0

    def captures(self, model) -> bool:
        return self.refusal(model) is None

    def refusal(self, model) -> str | None:
        if not self.enabled:
            return "mode eager"
        policy = model.slot.policy
        if not getattr(policy, "on_device", False):
            name = getattr(policy, "name", None)
            gather = getattr(policy, "gather", None)
            return (f"{name}{f' with gather {gather}' if gather else ''} runs stock transformers' expert loop, which "
                    f"reads the routing on the host: experts run eagerly")
        if model.device.type != "cuda":
            return f"no CUDA graphs on {model.device.type}: experts run eagerly, sync-free"
        return None

    def clear(self) -> None:
        self.graphs, self.pool = {}, None

    def describe(self) -> str:
        return (f"experts captured: {len(self.graphs)} layer graphs ({self.capture_s * 1e3:.0f} ms to capture), "
                f"attention eager between them")

    def run(self, model, layer: int, policy, hidden, top_k_index, top_k_weights, act_fn):
        if not self.enabled or model.device.type != "cuda":
            return policy.single_token(layer, hidden, top_k_index, top_k_weights, act_fn)
        entry = self.graphs.get(layer)
        if entry is not None:
            graph, (h, idx, w), out = entry
            h.copy_(hidden), idx.copy_(top_k_index), w.copy_(top_k_weights)
            graph.replay()
            return out
        import time

        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):  # this call's output, computed eagerly; it warms the kernels up
            result = policy.single_token(layer, hidden, top_k_index, top_k_weights, act_fn)
        torch.cuda.current_stream(model.device).wait_stream(side)
        t0 = time.perf_counter()
        static = (hidden.clone(), top_k_index.clone(), top_k_weights.clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = policy.single_token(layer, *static, act_fn)
        self.pool = graph.pool()
        self.graphs[layer] = (graph, static, out)
        self.capture_s += time.perf_counter() - t0
        return result
