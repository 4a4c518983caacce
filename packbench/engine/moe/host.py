"""The experts of every MoE layer in host memory: the fused 3-D tensors transformers holds
(`gate_up_proj` (experts, 2 x intermediate, hidden), `down_proj` (experts, hidden,
intermediate)), one expert a contiguous slice along the first dimension."""

import time

import torch


class ExpertHost:
    """`gate_up[l]`, `down[l]`: layer l's experts on the host (pinned on CUDA, so copies run
    asynchronously), contiguous; the lists given are filled in place. Layers without experts (a dense layer of Qwen3-MoE's
    `mlp_only_layers`) hold None."""

    def __init__(self, gate_up: list[torch.Tensor | None], down: list[torch.Tensor | None], *, pin: bool) -> None:
        self.pin = pin
        t0 = time.perf_counter()
        place = (lambda t: t.contiguous().pin_memory()) if pin else (lambda t: t.contiguous())
        # In place, one tensor at a time: each original is released as its pinned copy is made, so
        # host memory peaks at the experts plus one tensor, not twice the experts.
        for tensors in (gate_up, down):
            for i, t in enumerate(tensors):
                if t is not None:
                    tensors[i] = place(t)
        self.gate_up, self.down = gate_up, down
        self.pin_s = time.perf_counter() - t0
        # The first layer with experts: every MoE layer of a model has the same expert shapes.
        self.first = next(i for i, t in enumerate(self.gate_up) if t is not None)

    @property
    def layers(self) -> int:
        return len(self.gate_up)

    def has_experts(self, layer: int) -> bool:
        return self.gate_up[layer] is not None

    @property
    def experts(self) -> int:
        return self.gate_up[self.first].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up[self.first].dtype

    @property
    def expert_bytes(self) -> int:
        """One expert's weights as they travel: its gate_up slice and its down slice."""
        gu, dn = self.gate_up[self.first], self.down[self.first]
        return (gu[0].numel() + dn[0].numel()) * gu.element_size()

    @property
    def layer_bytes(self) -> int:
        return self.experts * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.gate_up, *self.down) if t is not None)

    @property
    def pinned_bytes(self) -> int:
        return self.host_bytes if self.pin else 0
