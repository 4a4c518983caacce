"""What every loader policy shares: the host weights, the `LoaderPolicy` protocol, the
zeroed workspace, the dense copy, `RowPacket` (rows in transit), and the slot and module
through which a layer's fc2 asks the active policy for its weight.

Every policy hands `OutgoingLinear` a device weight in the ORIGINAL layout (hidden, ffn), and
the layer multiplies with the ordinary dense `F.linear`, exactly as stock OPT's fc2 does. Rows a
policy did not refresh hold stale but finite values; they meet exact zeros in `h`, so logits
are bit-identical to streaming everything. (The workspace starts as zeros, never `empty`: an
uninitialised bfloat16 buffer held NaN, and 0 * NaN breaks exactness.)
"""

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from packbench.core import charges
from packbench.engine.ledger import Recorder

INDEX_DTYPE = torch.int64  # index_copy_ wants int64 indices on every backend
INDEX_BYTES = charges.INDEX_BYTES


class HostWeights:
    """The outgoing weights of every layer, in host memory, in the layouts policies gather from.

    `original[l]` is fc2.weight of layer l, (hidden, ffn) contiguous. `transposed(l)` is its
    (ffn, hidden) contiguous copy, made on first use, where neuron j's outgoing row is a
    contiguous `hidden`-element run: cheap to gather. On CUDA both are pinned so copies can run
    asynchronously. `int8` holds the int8 layout (engine/policies/int8.py `int8_layout`), made
    on first use by an int8 condition. Every layout made is counted in `host_bytes` (charged to
    the screen).
    """

    def __init__(self, weights: list[torch.Tensor], *, pin: bool) -> None:
        self.pin = pin
        t0 = time.perf_counter()
        self.original = [w.contiguous().pin_memory() if pin else w.contiguous() for w in weights]
        self.pin_s = time.perf_counter() - t0
        self._transposed: list[torch.Tensor] | None = None
        self.int8: list[torch.Tensor] | None = None  # per layer one uint8 slab [scales | rows], int8.py

    @property
    def layers(self) -> int:
        return len(self.original)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.original[0].shape)  # (hidden, ffn)

    @property
    def dtype(self) -> torch.dtype:
        return self.original[0].dtype

    @property
    def row_bytes(self) -> int:
        return self.shape[0] * self.dtype.itemsize

    def transposed(self, layer: int) -> torch.Tensor:
        if self._transposed is None:
            # Pinned too on CUDA: a device-side gather reads these rows straight over PCIe.
            self._transposed = [w.t().contiguous().pin_memory() if self.pin else w.t().contiguous()
                                for w in self.original]
        return self._transposed[layer]

    @property
    def host_bytes(self) -> int:
        per = sum(w.numel() * w.element_size() for w in self.original)
        return per * (2 if self._transposed is not None else 1) + nbytes(*(self.int8 or ()))

    @property
    def pinned_bytes(self) -> int:
        return self.host_bytes if self.pin else 0


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@runtime_checkable
class LoaderPolicy(Protocol):
    """What the episode loop needs from a policy; it never asks which one it holds.

    A policy's buffers exist only between `activate` and `deactivate`; `fetch` and
    `before_layer` are called only in between; `device_bytes` and `pinned_bytes` are 0 outside.
    """

    name: str
    starts_early: bool  # True: before_layer is called as each layer's fc1 starts

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        """Allocate this policy's buffers (charged while active)."""

    def deactivate(self) -> None:
        """Release buffers so the next condition starts from the same footprint."""

    def before_layer(self, layer: int) -> None:
        """Called as layer `layer`'s fc1 is launched (if `starts_early`): a chance to start copies early."""

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Device weight (hidden, ffn) valid for every row active in h (n_tokens, ffn)."""

    def device_bytes(self) -> int:
        """Device memory this policy holds (workspace, staging, caches, resident weights)."""

    def pinned_bytes(self) -> int:
        """Pinned host memory this policy holds beyond HostWeights (staging)."""


# What the policies hold on the device, as `policy_device_bytes` reports it; every episode
# record says which (`engine.buffers`; absent in archives made before: 1). 2: dense-stream keeps
# two workspaces (issue 11). A re-execution compares those bytes only between equal layouts.
BUFFERS_LAYOUT = 2


# ----------------------------------------------------------------------------- shared pieces


def zeroed_workspace(host: HostWeights, device: torch.device) -> torch.Tensor:
    """(hidden, ffn) on the device, zeros: finite everywhere (see the module doc)."""
    return torch.zeros(host.shape, dtype=host.dtype, device=device)


def stream_dense(host: HostWeights, layer: int, workspace: torch.Tensor, recorder: Recorder) -> torch.Tensor:
    """Copy layer `layer`'s whole outgoing weight into `workspace`, charged as ffn rows."""
    src = host.original[layer]
    workspace.copy_(src, non_blocking=host.pin)
    recorder.add(layer, **charges.dense_copy(src.shape[1], host.row_bytes))
    return workspace


def build_gather_layout(host: HostWeights) -> None:
    """Make the (ffn, hidden) layout rows are gathered from before any episode is timed."""
    for layer in range(host.layers):
        host.transposed(layer)


@dataclass
class RowPacket:
    """Outgoing rows in transit, laid out as [n int64 indices | k rows x hidden]: a host staging
    buffer (pinned on CUDA, so the copy can run asynchronously) and its device twin, each big
    enough for every row of a layer. One packet is one host-to-device transfer."""

    staged: torch.Tensor  # (capacity,) uint8 on the host
    landed: torch.Tensor  # (capacity,) uint8 on the device
    dtype: torch.dtype
    hidden: int
    pinned: bool

    @classmethod
    def allocate(cls, host: HostWeights, device: torch.device) -> "RowPacket":
        capacity = host.shape[1] * (INDEX_BYTES + host.row_bytes)
        return cls(staged=torch.zeros(capacity, dtype=torch.uint8, pin_memory=host.pin),
                   landed=torch.zeros(capacity, dtype=torch.uint8, device=device),
                   dtype=host.dtype, hidden=host.shape[0], pinned=host.pin)

    def pack(self, source: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> int:
        """Stage `index` (host int64: what the device scatters by), then rows `rows` (host int64)
        of `source` (ffn, hidden). Returns the packet's size in bytes."""
        k, n_index = rows.numel(), index.numel() * INDEX_BYTES
        size = n_index + k * self.hidden * self.dtype.itemsize
        staged = self.staged[:size]
        staged[:n_index].view(INDEX_DTYPE).copy_(index)
        torch.index_select(source, 0, rows, out=staged[n_index:].view(self.dtype).view(k, self.hidden))
        return size

    def upload(self, size: int, *, non_blocking: bool) -> None:
        self.landed[:size].copy_(self.staged[:size], non_blocking=non_blocking)

    def index(self, n: int) -> torch.Tensor:
        """(n,) int64 on the device: the uploaded packet's index."""
        return self.landed[: n * INDEX_BYTES].view(INDEX_DTYPE)

    def rows(self, n: int, k: int) -> torch.Tensor:
        """(k, hidden) on the device: the uploaded packet's rows, behind its `n` indices."""
        start = n * INDEX_BYTES
        return self.landed[start: start + k * self.hidden * self.dtype.itemsize].view(self.dtype).view(k, self.hidden)


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
