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


class HostExperts:
    """Every routed expert computed on the host (module docstring). No device buffers."""

    name = "host-experts"
    computes = True  # CpuFirstMoE hands it the whole expert computation, not a request for weights

    def __init__(self) -> None:
        self.host: ExpertHost | None = None
        self.recorder: Recorder | None = None

    def observes(self) -> bool:
        return False  # the routing goes down with the hidden states; nothing is read back apart

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder = host, recorder

    def deactivate(self) -> None:
        self.host = self.recorder = None

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("host-experts computes the experts on the host; it hands no device weights")

    def compute(self, layer: int, stock: StockExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s expert output on the device of `hidden_states`, computed on the host."""
        device = hidden_states.device
        # (tokens, hidden), (tokens, k), (tokens, k): down the link in one synchronising copy each
        down = [t.to("cpu") for t in (hidden_states, top_k_index, top_k_weights)]
        out = stock(self.host.gate_up[layer], self.host.down[layer], *down)  # (tokens, hidden), on the host
        routed = int(torch.unique(down[1]).numel())
        self.recorder.add(layer, active=routed, d2h_bytes=_nbytes(*down), index_bytes=_nbytes(out))
        return out.to(device)

    def device_bytes(self) -> int:
        return 0

    def pinned_bytes(self) -> int:
        return 0
