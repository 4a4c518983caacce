"""Loader policies: how each layer's outgoing FFN weight reaches the device for a call.

Every policy hands `OutgoingLinear` a device weight in the ORIGINAL layout (hidden, ffn), and
the layer multiplies with the ordinary dense `F.linear`, exactly as stock OPT's fc2 does. Rows a
policy did not refresh hold stale but finite values; they meet exact zeros in `h`, so logits
are bit-identical to streaming everything. (The workspace starts as zeros, never `empty`: an
uninitialised bfloat16 buffer held NaN, and 0 * NaN breaks exactness.)
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.ledger import Recorder

INDEX_DTYPE = torch.int64  # index_copy_ wants int64 indices on every backend
INDEX_BYTES = 8


class HostWeights:
    """The outgoing weights of every layer, in host memory, in the layouts policies gather from.

    `original[l]` is fc2.weight of layer l, (hidden, ffn) contiguous. `transposed(l)` is its
    (ffn, hidden) contiguous copy, made on first use, where neuron j's outgoing row is a
    contiguous `hidden`-element run: cheap to gather. On CUDA both are pinned so copies can run
    asynchronously. Every layout made is counted in `host_bytes` (charged to the screen).
    """

    def __init__(self, weights: list[torch.Tensor], *, pin: bool) -> None:
        self.pin = pin
        self.original = [w.contiguous().pin_memory() if pin else w.contiguous() for w in weights]
        self._transposed: list[torch.Tensor] | None = None

    @property
    def layers(self) -> int:
        return len(self.original)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.original[0].shape)  # (hidden, ffn)

    @property
    def dtype(self) -> torch.dtype:
        return self.original[0].dtype

    def transposed(self, layer: int) -> torch.Tensor:
        if self._transposed is None:
            self._transposed = [w.t().contiguous() for w in self.original]
        return self._transposed[layer]

    @property
    def host_bytes(self) -> int:
        per = sum(w.numel() * w.element_size() for w in self.original)
        return per * (2 if self._transposed is not None else 1)


class LoaderPolicy(Protocol):
    """What the episode loop needs from a policy; it never asks which one it holds."""

    name: str

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        """Allocate this policy's device buffers (charged while active)."""

    def deactivate(self) -> None:
        """Release device buffers so the next condition starts from the same footprint."""

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Device weight (hidden, ffn) valid for every row active in h (n_tokens, ffn)."""

    def device_bytes(self) -> int:
        """Bytes of device memory this policy holds (workspace, staging, resident weights)."""


class Resident:
    """All outgoing weights on the device: the warm-latency reference where it fits."""

    name = "resident"

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.weights = [w.to(device, copy=True) for w in host.original]

    def deactivate(self) -> None:
        self.weights = []

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.weights[layer]  # resident: nothing to fetch

    def device_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in getattr(self, "weights", []))


class DenseStream:
    """Every call copies each layer's whole outgoing weight host-to-device, in its original layout."""

    name = "dense-stream"

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder = host, recorder
        self.workspace = torch.zeros(host.shape, dtype=host.dtype, device=device)

    def deactivate(self) -> None:
        del self.workspace

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        src = self.host.original[layer]
        # Same stream as the matmuls, so layer l+1's copy cannot overwrite layer l's operand early.
        self.workspace.copy_(src, non_blocking=self.host.pin)
        self.recorder.add(layer, rows=src.shape[1], weight_bytes=src.numel() * src.element_size())
        return self.workspace

    def device_bytes(self) -> int:
        return self.workspace.numel() * self.workspace.element_size()


class Packet:
    """Exact active rows: the union over the call's tokens, plus their indices, in one copy.

    Per layer: observe the non-zero neurons on the device, read their indices back, gather those
    outgoing rows on the host into one pinned staging buffer laid out as
    [k int64 indices | k rows x hidden], copy it to the device in one transfer, and scatter the
    rows into the dense workspace's columns.
    """

    name = "packet"

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder, self.device = host, recorder, device
        hidden, ffn = host.shape
        self.row_bytes = hidden * host.dtype.itemsize
        capacity = ffn * (INDEX_BYTES + self.row_bytes)
        self.staging = torch.zeros(capacity, dtype=torch.uint8, pin_memory=host.pin)
        self.device_staging = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self.workspace = torch.zeros(host.shape, dtype=host.dtype, device=device)
        for layer in range(host.layers):
            host.transposed(layer)  # build the gather layout before any episode is timed

    def deactivate(self) -> None:
        del self.staging, self.device_staging, self.workspace

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.host.shape
        # (n_tokens, ffn) post-ReLU; exact zeros are the point.
        active = (h != 0).any(dim=0).nonzero().squeeze(1)
        index = active.to("cpu")  # the readback: one sync per layer, k int64
        k = index.numel()
        n_index, n_rows = k * INDEX_BYTES, k * self.row_bytes
        staged = self.staging[: n_index + n_rows]
        staged[:n_index].view(INDEX_DTYPE).copy_(index)
        torch.index_select(
            self.host.transposed(layer), 0, index, out=staged[n_index:].view(self.host.dtype).view(k, hidden)
        )
        packet = self.device_staging[: n_index + n_rows]
        packet.copy_(staged, non_blocking=self.host.pin)
        rows = packet[n_index:].view(self.host.dtype).view(k, hidden)
        self.workspace.index_copy_(1, packet[:n_index].view(INDEX_DTYPE), rows.t())
        self.recorder.add(layer, active=k, rows=k, weight_bytes=n_rows, index_bytes=n_index, d2h_bytes=n_index)
        return self.workspace

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.device_staging, self.workspace))


POLICIES: dict[str, type] = {
    "resident": Resident,
    "dense-stream": DenseStream,
    "packet": Packet,
}


class OutgoingLinear(nn.Module):
    """Stands in for one layer's fc2: the weight comes from the active policy, the math is F.linear."""

    def __init__(self, layer: int, bias: torch.Tensor | None, slot: "PolicySlot") -> None:
        super().__init__()
        self.layer = layer
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.slot = slot

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.slot.policy.fetch(self.layer, h)
        return F.linear(h, weight, self.bias)


class PolicySlot:
    """The one place that says which policy the outgoing layers use now."""

    def __init__(self) -> None:
        self.policy: LoaderPolicy | None = None
