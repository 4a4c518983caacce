"""Experts computed on the host CPU, where their weights live (`host-experts`: Fiddler-style,
packbench's implementation; docs/experiments/competitors.md says what it leaves out of Fiddler).

Per MoE layer and call: the layer's input hidden states `(tokens, hidden)`, the routed expert ids
`(tokens, k)` int64 and their routing weights `(tokens, k)` go device-to-host; stock transformers'
own expert loop (the same eager loop every loader policy runs, engine/moe/model.py) runs on the
host over the host's fused expert tensors, in the checkpoint's dtype on torch's CPU kernels; the
summed output `(tokens, hidden)` goes host-to-device. No expert weight moves.

Ledger, per layer: `d2h_bytes` the hidden states, ids and routing weights sent down;
`h2d_index_bytes` the outputs coming back (activations, not weights: `h2d_weight_bytes` and
`rows_copied` stay 0); `active_rows` the number of experts the call routed to. On the CPU the two
copies are no-ops, and the bytes are charged as the link would carry them (as every policy's are).
"""

from collections.abc import Callable

import torch

from packbench.engine.ledger import Recorder
from packbench.engine.moe.host import ExpertHost

# How the stock expert loop is run over given weights: (gate_up, down, hidden_states, top_k_index,
# top_k_weights) -> the layer's expert output (CpuFirstMoE hands it to the policy).
StockExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _unrouted(index: torch.Tensor, weights: torch.Tensor, mine: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, weights) for one side of a split expert call: the pairs that are not `mine` point at
    expert `fill` (one this side computes) with weight 0, so they add exactly 0 to their token."""
    return torch.where(mine, index, fill), torch.where(mine, weights, torch.zeros_like(weights))


class HostExperts:
    """Every routed expert computed on the host (module docstring); with `hot` > 0, the `hot`
    experts of each MoE layer that the layer's first call (the episode's prefill) routed the most
    tokens to are copied to the device once and computed there for the rest of the episode, the
    others on the host (Fiddler's popularity placement, measured on the episode's own prompt)."""

    name = "host-experts"
    computes = True  # CpuFirstMoE hands it the whole expert computation, not a request for weights

    def __init__(self, hot: int = 0) -> None:
        if isinstance(hot, bool) or not isinstance(hot, int) or hot < 0:
            raise ValueError(f"hot must be an integer >= 0, got {hot!r}")
        self.hot = hot
        self.host: ExpertHost | None = None
        self.recorder: Recorder | None = None
        self.device: torch.device | None = None
        # layer -> (hot gate_up (h, 2I, H), hot down (h, H, I) on the device, expert id -> slot on the
        # device (E + 1,), the experts sentinel E for an expert not held; which ids are held (E + 1,) host)
        self.resident: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.hits = self.routes = 0  # (token, expert) pairs the device's hot set served, of all routed

    def observes(self) -> bool:
        return False  # the routing goes down with the hidden states; nothing is read back apart

    def forecasts(self) -> bool:
        return False

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder, self.device = host, recorder, device

    def deactivate(self) -> None:
        self.host = self.recorder = self.device = None
        self.resident = {}

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("host-experts computes the experts on the host; it hands no device weights")

    def _place(self, layer: int, top_k_index: torch.Tensor) -> None:
        """The layer's hot set from this call's routing: the `hot` experts with the most tokens (ties
        to the lower id), copied to the device in ascending id order; charged as rows (experts) moved
        and the E token counts read back."""
        experts = self.host.experts
        counts = torch.bincount(top_k_index.reshape(-1), minlength=experts + 1)[:experts].to("cpu")
        ranked = sorted(range(experts), key=lambda e: (-int(counts[e]), e))
        ids = torch.tensor(sorted(ranked[:min(self.hot, experts)]), dtype=torch.int64)
        gate_up = self.host.gate_up[layer].index_select(0, ids).to(self.device)
        down = self.host.down[layer].index_select(0, ids).to(self.device)
        # Slot 0 stands in for every expert not held (its pairs weigh 0 on the device: _unrouted).
        slot = torch.zeros(experts, dtype=torch.int64)
        slot[ids] = torch.arange(len(ids))
        held = torch.zeros(experts, dtype=torch.bool)
        held[ids] = True
        self.resident[layer] = (gate_up, down, slot.to(self.device), held)
        self.recorder.add(layer, rows=len(ids), weight_bytes=len(ids) * self.host.expert_bytes,
                          d2h_bytes=_nbytes(counts))

    def compute(self, layer: int, stock: StockExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s expert output on the device of `hidden_states`: the hot set's part on the
        device (stock loop over the held experts), the rest computed on the host, the two parts added.
        Each side's pairs that belong to the other side are given an expert it computes anyway and
        weight 0 (`_unrouted`), so each contributes exactly 0 to its token's sum: stock's skipped
        sentinel id (num_experts) is not used, since transformers' eager loop before 5.2x one-hots
        the ids into num_experts classes only (an id of num_experts is out of range: a device-side
        assert on CUDA, an error on the CPU)."""
        device = hidden_states.device
        if not self.hot:
            # (tokens, hidden), (tokens, k), (tokens, k): down the link in one synchronising copy each
            down = [t.to("cpu") for t in (hidden_states, top_k_index, top_k_weights)]
            out = stock(self.host.gate_up[layer], self.host.down[layer], *down)  # (tokens, hidden), host
            self.routes += down[1].numel()
            self.recorder.add(layer, active=int(torch.unique(down[1]).numel()), d2h_bytes=_nbytes(*down),
                              index_bytes=_nbytes(out))
            return out.to(device)
        if layer not in self.resident:
            self._place(layer, top_k_index)
        gate_up, down_w, slot, held = self.resident[layer]
        ids = top_k_index.to("cpu")  # (tokens, k): which pairs the host must compute
        cold = ~held[ids]
        on_device = stock(gate_up, down_w, hidden_states,
                          *_unrouted(slot[top_k_index], top_k_weights, (~cold).to(top_k_weights.device), 0))
        self.hits += int((~cold).sum())
        self.routes += ids.numel()
        routed = int(torch.unique(ids).numel())
        if not bool(cold.any()):
            self.recorder.add(layer, active=routed, d2h_bytes=_nbytes(ids))
            return on_device
        sent = [hidden_states.to("cpu"), top_k_weights.to("cpu")]
        fill = int(ids[cold][0])  # a cold expert the host computes anyway stands in for the held pairs
        out = stock(self.host.gate_up[layer], self.host.down[layer], sent[0], *_unrouted(ids, sent[1], cold, fill))
        self.recorder.add(layer, active=routed, d2h_bytes=_nbytes(ids, *sent), index_bytes=_nbytes(out))
        return on_device + out.to(device)

    @property
    def hit_rate(self) -> float | None:
        """The share of routed (token, expert) pairs the device's hot set served (None: none routed)."""
        return self.hits / self.routes if self.routes else None

    def device_bytes(self) -> int:
        return sum(_nbytes(gu, dn, slot) for gu, dn, slot, _ in self.resident.values())

    def pinned_bytes(self) -> int:
        return 0
