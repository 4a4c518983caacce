"""The CPU-first model: OPT whose outgoing FFN weights stay on the host behind a loader policy."""

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from packbench.engine.checkpoint import build_weights
from packbench.engine.graph import GraphDecoder, check_mode
from packbench.engine.opt_weights import stock_model
from packbench.engine.hf import cache_keyword
from packbench.engine.ledger import Recorder
from packbench.engine.policies.base import HostWeights, LoaderPolicy, OutgoingLinear, PolicySlot
from packbench.engine.static_opt import StaticKV


def is_outgoing(name: str) -> bool:
    """The tensors that stay on the host: every layer's fc2 weight."""
    return name.endswith(".fc2.weight")


@dataclass(frozen=True)
class StartStats:
    """Cold start of a worker's model: read from disk, pin, move to the device."""

    read_s: float
    place_s: float
    device_param_bytes: int  # everything but the outgoing weights (plus a resident policy's copy)
    host_outgoing_bytes: int


def _param_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


class CpuFirstModel:
    """Loads a checkpoint into host memory, keeps outgoing weights there, moves the rest.

    `use(condition_policy)` activates one policy; `forward(ids, cache)` is one call. The
    execution mode (`engine/graph.py`: "eager", stock transformers; "graph", packbench's
    static decoder with the decode step captured where the policy allows) is chosen per
    episode by the cache: `new_cache(capacity, mode=...)`; `mode` here is the default.
    """

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device,
                 mode: str = "eager") -> None:
        self.mode = check_mode(mode)
        t0 = time.perf_counter()
        # The outgoing weights are read straight into pinned host memory and the rest straight
        # to the device (engine/checkpoint.py read_placed) when the checkpoint holds `dtype`;
        # then read_s includes placing, and place_s is what .to(device) below still moves.
        weights = build_weights(model_dir, dtype=dtype, device=device, host_keys=is_outgoing)
        t1 = time.perf_counter()
        self.device, self.dtype, self.model_dir = device, dtype, Path(model_dir)
        self.slot = PolicySlot()
        layers = weights.model.decoder.layers
        self.recorder = Recorder(len(layers))
        outgoing = []
        for i, layer in enumerate(layers):
            outgoing.append(layer.fc2.weight.detach())
            bias = None if layer.fc2.bias is None else layer.fc2.bias.detach()
            layer.fc2 = OutgoingLinear(i, bias, self.slot)
        self._fc1 = [layer.fc1 for layer in layers]
        self._early_hooks: list = []  # fc1 pre-hooks, present only while a policy starts early
        self.host = HostWeights(outgoing, pin=device.type == "cuda")
        self.weights = weights.to(device)  # fc2 weights are no longer parameters: they stay behind
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.start = StartStats(
            read_s=t1 - t0,
            place_s=time.perf_counter() - t1,
            device_param_bytes=_param_bytes(self.weights),
            host_outgoing_bytes=self.host.host_bytes,
        )
        self.config = weights.config
        self.vocab = self.config.vocab_size
        self.graph = GraphDecoder(self.weights, self.slot, self.recorder, device)
        self._stock = None
        if self.mode == "eager":
            self.model  # built now, so a cold start says what an eager screen pays

    @property
    def model(self):
        """Stock transformers' OPTForCausalLM over the same modules (built on first use: mode
        graph alone never imports transformers)."""
        if self._stock is None:
            self._stock = stock_model(self.weights, vars(self.config))
            self._cache_kw = cache_keyword(self._stock)
        return self._stock

    def use(self, policy_name: str, **params) -> None:
        """Make a fresh `policy_name` the active loader policy, releasing the previous one.

        Always fresh, even for the same policy: every episode starts from the same state (an
        LRU cache or a forecast never carries over from the episode before).
        """
        from packbench.engine.conditions import loader_policy  # the kinds' table imports every policy module

        self.use_policy(loader_policy(policy_name, **params))

    def use_policy(self, policy: LoaderPolicy) -> None:
        """Activate `policy`, a fresh policy object, releasing the previous one. Screens name
        policies (`use`); a bench may hand in a variant of its own (bench/engine.py)."""
        self.release_policy()
        policy.activate(self.host, self.device, self.recorder)
        self.slot.policy = policy
        self._hook_fc1(policy.starts_early)

    def release_policy(self) -> None:
        """Deactivate the active loader policy, if any, and free its device buffers: before
        another policy, or before a competitor that must have the allowance to itself."""
        if self.slot.policy is not None:
            self.slot.policy.deactivate()
            self.slot.policy = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _hook_fc1(self, wanted: bool) -> None:
        """Call `before_layer(i)` as layer i's fc1 starts, only for a policy that starts copies
        early (early-forecast, dense-stream): a module with a hook takes torch's slower call path, a cost the
        other policies should not pay 32+ times a call."""
        if wanted and not self._early_hooks:
            self._early_hooks = [
                fc1.register_forward_pre_hook(lambda module, args, i=i: self.slot.policy.before_layer(i))
                for i, fc1 in enumerate(self._fc1)]
        elif not wanted:
            for handle in self._early_hooks:
                handle.remove()
            self._early_hooks = []

    def new_cache(self, capacity: int | None = None, *, mode: str | None = None, batch: int = 1):
        """A fresh episode cache: DynamicCache (mode "eager") or a StaticKV of `capacity`
        positions, prefix + continuation, for `batch` sequences (mode "graph"), allocated now
        and charged in full."""
        if check_mode(mode or self.mode) == "graph":
            if capacity is None:
                raise ValueError("mode graph needs the episode's capacity (prefix + continuation tokens)")
            return self.graph.new_cache(capacity, batch)
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One call: (B, T) token ids in, last-position logits out (on the device): (vocab,) at
        batch 1, (B, vocab) for a batch."""
        if isinstance(cache, StaticKV):
            return self.graph.forward(ids, cache)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1] if ids.shape[0] == 1 else out.logits[:, -1]
