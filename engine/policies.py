"""Loader policies: how each layer's outgoing FFN weight reaches the device for a call.

Every policy hands `OutgoingLinear` a device weight in the ORIGINAL layout (hidden, ffn), and
the layer multiplies with the ordinary dense `F.linear`, exactly as stock OPT's fc2 does. Rows a
policy did not refresh hold stale but finite values; they meet exact zeros in `h`, so logits
are bit-identical to streaming everything. (The workspace starts as zeros, never `empty`: an
uninitialised bfloat16 buffer held NaN, and 0 * NaN breaks exactness.)

One workspace serves every layer: layers run one after another on one stream, so layer l+1's
refresh is queued after layer l's matmul has consumed it.
"""

import time
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.gather import gather_active_rows
from engine.ledger import CallLedger, Recorder

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
        t0 = time.perf_counter()
        self.original = [w.contiguous().pin_memory() if pin else w.contiguous() for w in weights]
        self.pin_s = time.perf_counter() - t0
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
        return per * (2 if self._transposed is not None else 1)

    @property
    def pinned_bytes(self) -> int:
        return self.host_bytes if self.pin else 0


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class LoaderPolicy(Protocol):
    """What the episode loop needs from a policy; it never asks which one it holds."""

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


class Resident:
    """All outgoing weights on the device: the warm-latency reference where it fits."""

    name = "resident"
    starts_early = False

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.weights = [w.to(device, copy=True) for w in host.original]

    def deactivate(self) -> None:
        self.weights = []

    def before_layer(self, layer: int) -> None:
        pass  # resident: nothing to fetch

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.weights[layer]

    def device_bytes(self) -> int:
        return _nbytes(*getattr(self, "weights", []))

    def pinned_bytes(self) -> int:
        return 0


class DenseStream:
    """Every call copies each layer's whole outgoing weight host-to-device, in its original layout."""

    name = "dense-stream"
    starts_early = False

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder, self.device = host, recorder, device
        self.workspace = torch.zeros(host.shape, dtype=host.dtype, device=device)

    def deactivate(self) -> None:
        del self.workspace

    def before_layer(self, layer: int) -> None:
        pass  # dense-stream: the copy is issued at fetch, on the compute stream

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        src = self.host.original[layer]
        self.workspace.copy_(src, non_blocking=self.host.pin)
        self.recorder.add(layer, rows=src.shape[1], weight_bytes=_nbytes(src))
        return self.workspace

    def device_bytes(self) -> int:
        return _nbytes(self.workspace)

    def pinned_bytes(self) -> int:
        return 0


class Packet:
    """Exact active rows: the union over the call's tokens, plus their indices, in one copy.

    gather="host" (the default): reduce h to an activity mask on the device, read the mask back
    (one sync), gather the active outgoing rows on the host into one pinned staging buffer laid
    out as [k int64 indices | k rows x hidden], copy it to the device in one transfer, and
    scatter the rows into the dense workspace's columns. Subclasses change which rows are sent.

    gather="device": the compute device finds the active rows itself and, on CUDA, pulls them
    straight from pinned host memory through a mapped view (UVA) into the workspace, in one
    kernel per layer (`engine.gather`): no host work, no index, no staging copy, and no
    per-layer synchronisation. Each layer's active count stays on the device until the call's
    logits are back; then the counts (4 bytes a layer, charged as D2H) are read once.
    """

    name = "packet"
    starts_early = False

    def __init__(self, gather: str = "host") -> None:
        if gather not in ("host", "device"):
            raise ValueError(f"gather must be host or device, got {gather!r}")
        self.gather = gather

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder, self.device = host, recorder, device
        hidden, ffn = host.shape
        self.workspace = torch.zeros(host.shape, dtype=host.dtype, device=device)
        for layer in range(host.layers):
            host.transposed(layer)  # build the gather layout before any episode is timed
        if self.gather == "device":
            self.counts = torch.zeros(host.layers, dtype=torch.int32, device=device)
            self.counted_call = -1  # recorder.serial of the call `counts` belongs to
            if device.type == "cuda":
                from engine.mapped import cuda_view

                self.source = [cuda_view(host.transposed(layer)) for layer in range(host.layers)]
            else:
                self.source = [host.transposed(layer) for layer in range(host.layers)]
            return
        capacity = ffn * (INDEX_BYTES + host.row_bytes)
        self.staging = torch.zeros(capacity, dtype=torch.uint8, pin_memory=host.pin)
        self.device_staging = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self.mask_host = torch.zeros(ffn, dtype=torch.bool, pin_memory=host.pin)

    def deactivate(self) -> None:
        for name in ("staging", "device_staging", "workspace", "mask_host", "counts", "source"):
            self.__dict__.pop(name, None)

    def before_layer(self, layer: int) -> None:
        pass  # packet: demand is known only after fc1

    def observe(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Sorted int64 indices (host) of neurons non-zero in any token of the call.

        The readback is the ffn-byte mask; the host waits for it (charged as D2H and copy wait).
        """
        mask = (h != 0).any(dim=0)  # (ffn,) on the device
        t0 = time.perf_counter()
        self.mask_host.copy_(mask, non_blocking=self.host.pin)
        if self.host.pin:
            torch.cuda.current_stream(self.device).synchronize()
        self.recorder.add(layer, d2h_bytes=_nbytes(self.mask_host), wait_s=time.perf_counter() - t0)
        return self.mask_host.nonzero().squeeze(1)

    def send(self, layer: int, rows: torch.Tensor, index: torch.Tensor) -> None:
        """Gather outgoing `rows` (host int64) into staging, prefixed by `index` (what the device
        scatters by), copy both in one transfer, scatter into the workspace columns `rows`."""
        hidden, _ = self.host.shape
        k, n_index = rows.numel(), index.numel() * INDEX_BYTES
        n_rows = k * self.host.row_bytes
        staged = self.staging[: n_index + n_rows]
        staged[:n_index].view(INDEX_DTYPE).copy_(index)
        torch.index_select(self.host.transposed(layer), 0, rows,
                           out=staged[n_index:].view(self.host.dtype).view(k, hidden))
        packet = self.device_staging[: n_index + n_rows]
        packet.copy_(staged, non_blocking=self.host.pin)
        device_rows = self.expand(packet[:n_index].view(INDEX_DTYPE))
        self.workspace.index_copy_(1, device_rows, packet[n_index:].view(self.host.dtype).view(k, hidden).t())
        self.recorder.add(layer, rows=k, weight_bytes=n_rows, index_bytes=n_index)

    def expand(self, index: torch.Tensor) -> torch.Tensor:
        return index  # packet: the index is the row list itself

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.gather == "device":
            return self.fetch_mapped(layer, h)
        active = self.observe(layer, h)
        self.recorder.add(layer, active=active.numel())
        self.send(layer, active, active)
        return self.workspace

    def fetch_mapped(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.counted_call != self.recorder.serial:  # the call's first layer
            self.counted_call = self.recorder.serial
            self.counts.zero_()
            self.recorder.defer(self.settle)
        gather_active_rows(h, self.source[layer], self.workspace, self.counts, layer)
        return self.workspace

    def settle(self, call: CallLedger) -> None:
        """The call has ended (its logits are on the host): read every layer's count at once."""
        row_bytes = self.host.row_bytes
        for layer, k in enumerate(self.counts.tolist()):
            self.recorder.add(layer, active=k, rows=k, weight_bytes=k * row_bytes,
                              d2h_bytes=self.counts.element_size())

    def device_bytes(self) -> int:
        held = [getattr(self, name) for name in ("device_staging", "workspace", "counts") if hasattr(self, name)]
        return _nbytes(*held)

    def pinned_bytes(self) -> int:
        return _nbytes(self.staging, self.mask_host) if self.host.pin and self.gather == "host" else 0


class SparseExtents(Packet):
    """Every fixed-size block of `block_rows` outgoing rows that holds an active row.

    The packet carries block ids; the device expands them into row indices.
    """

    name = "sparse-extents"

    def __init__(self, block_rows: int = 128) -> None:
        super().__init__()
        self.block_rows = block_rows

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        super().activate(host, device, recorder)
        self.host_offsets = torch.arange(self.block_rows, dtype=INDEX_DTYPE)
        self.offsets = self.host_offsets.to(device)
        self.ffn = host.shape[1]

    def rows_of(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        rows = (blocks[:, None] * self.block_rows + offsets[None, :]).flatten()
        return rows[rows < self.ffn]  # the last block may be short

    def expand(self, index: torch.Tensor) -> torch.Tensor:
        return self.rows_of(index, self.offsets)

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        active = self.observe(layer, h)
        self.recorder.add(layer, active=active.numel())
        blocks = torch.unique(active // self.block_rows)
        self.send(layer, self.rows_of(blocks, self.host_offsets), blocks)
        return self.workspace


class PhaseSwitched(Packet):
    """Dense streaming for prefill calls, exact packets for decode calls, one set of buffers."""

    name = "phase-switched"

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.recorder.phase == "prefill":
            src = self.host.original[layer]
            self.workspace.copy_(src, non_blocking=self.host.pin)
            self.recorder.add(layer, rows=src.shape[1], weight_bytes=_nbytes(src))
            return self.workspace
        return super().fetch(layer, h)


def lru_plan(slot_of: np.ndarray, last_used: np.ndarray, active: np.ndarray, now: int):
    """One call of an LRU row cache, decided on host arrays (mutated in place).

    slot_of: (ffn,) cache slot of each neuron or -1; last_used: (slots,) last call a slot served;
    active: sorted neuron ids this call needs. Returns (hit_rows, hit_slots, miss_rows,
    fill_rows, fill_slots): hits are served from the cache, misses are copied, and the last
    `slots` misses are then written into the least recently used slots (hits of this call are
    evicted last, since their rows were already scattered into the workspace).
    """
    slots = last_used.shape[0]
    hit = slot_of[active] >= 0
    hit_rows, miss_rows = active[hit], active[~hit]
    hit_slots = slot_of[hit_rows]
    last_used[hit_slots] = now
    fill_rows = miss_rows[-slots:] if miss_rows.size > slots else miss_rows
    fill_slots = np.argsort(last_used, kind="stable")[: fill_rows.size]
    owner = np.full(slots, -1, dtype=np.int64)
    owner[slot_of[slot_of >= 0]] = np.nonzero(slot_of >= 0)[0]
    evicted = owner[fill_slots]
    slot_of[evicted[evicted >= 0]] = -1
    slot_of[fill_rows] = fill_slots
    last_used[fill_slots] = now
    return hit_rows, hit_slots, miss_rows, fill_rows, fill_slots


class RowRetention(Packet):
    """A device cache of `rows_per_layer` outgoing rows per layer with LRU replacement; only
    misses are copied. The cache is charged to the condition's device bytes."""

    name = "row-retention"

    def __init__(self, rows_per_layer: int = 1024) -> None:
        super().__init__()
        self.rows_per_layer = rows_per_layer

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        super().activate(host, device, recorder)
        hidden, ffn = host.shape
        slots = min(self.rows_per_layer, ffn)
        self.cache = torch.zeros((host.layers, slots, hidden), dtype=host.dtype, device=device)
        self.slot_of = np.full((host.layers, ffn), -1, dtype=np.int64)
        self.last_used = np.full((host.layers, slots), -1, dtype=np.int64)

    def deactivate(self) -> None:
        super().deactivate()
        del self.cache

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        active = self.observe(layer, h)
        self.recorder.add(layer, active=active.numel())
        hit_rows, hit_slots, miss_rows, fill_rows, fill_slots = lru_plan(
            self.slot_of[layer], self.last_used[layer], active.numpy(), self.recorder.serial)
        cache = self.cache[layer]
        if hit_rows.size:
            dev_slots = torch.from_numpy(hit_slots).to(self.device, non_blocking=False)
            dev_rows = torch.from_numpy(hit_rows).to(self.device, non_blocking=False)
            self.workspace.index_copy_(1, dev_rows, cache.index_select(0, dev_slots).t())
            self.recorder.add(layer, index_bytes=2 * hit_rows.size * INDEX_BYTES)
        self.send(layer, torch.from_numpy(miss_rows), torch.from_numpy(miss_rows))
        if fill_rows.size:
            # The filled rows are the tail of the packet just sent, already on the device.
            hidden = self.host.shape[0]
            n_index = miss_rows.size * INDEX_BYTES
            sent = self.device_staging[n_index: n_index + miss_rows.size * self.host.row_bytes]
            sent = sent.view(self.host.dtype).view(miss_rows.size, hidden)[miss_rows.size - fill_rows.size:]
            dev_fill = torch.from_numpy(fill_slots).to(self.device)
            cache.index_copy_(0, dev_fill, sent)
            self.recorder.add(layer, index_bytes=fill_slots.size * INDEX_BYTES)
        return self.workspace

    def device_bytes(self) -> int:
        return super().device_bytes() + _nbytes(self.cache)


def forecast_split(predicted: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(remainder, wasted): the active rows the forecast missed, which must still be sent, and
    how many forecast rows turned out inactive. Exactness never depends on the forecast: every
    active row is either forecast or in the remainder."""
    hit = torch.isin(active, predicted)
    return active[~hit], predicted.numel() - int(hit.sum())


class EarlyForecast(Packet):
    """Predict a call's active rows from the same layer's previous call and send them as the
    layer starts (on a side stream on CUDA), then send the exact remainder after fc1. Predicted
    rows that turn out inactive are counted as wasted; exactness never depends on the forecast.
    """

    name = "early-forecast"
    starts_early = True

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        super().activate(host, device, recorder)
        _, ffn = host.shape
        capacity = ffn * (INDEX_BYTES + host.row_bytes)
        self.forecast_staging = torch.zeros(capacity, dtype=torch.uint8, pin_memory=host.pin)
        self.forecast_device = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.previous: list[torch.Tensor | None] = [None] * host.layers
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}

    def deactivate(self) -> None:
        super().deactivate()
        del self.forecast_staging, self.forecast_device

    def before_layer(self, layer: int) -> None:
        predicted = self.previous[layer] if self.recorder.phase == "decode" else None
        if predicted is None or predicted.numel() == 0:
            return
        hidden, _ = self.host.shape
        k = predicted.numel()
        n_index, n_rows = k * INDEX_BYTES, k * self.host.row_bytes
        staged = self.forecast_staging[: n_index + n_rows]
        staged[:n_index].view(INDEX_DTYPE).copy_(predicted)
        torch.index_select(self.host.transposed(layer), 0, predicted,
                           out=staged[n_index:].view(self.host.dtype).view(k, hidden))
        packet = self.forecast_device[: n_index + n_rows]
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.device))  # the buffer is free
            with torch.cuda.stream(self.side):
                packet.copy_(staged, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.side)
        else:
            packet.copy_(staged)
            event = None
        self.pending[layer] = (predicted, event)
        self.recorder.add(layer, rows=k, weight_bytes=n_rows, index_bytes=n_index)

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        active = self.observe(layer, h)
        self.recorder.add(layer, active=active.numel())
        self.previous[layer] = active
        predicted, event = self.pending.pop(layer, (None, None))
        if predicted is None:
            self.send(layer, active, active)
            return self.workspace
        hidden, _ = self.host.shape
        k = predicted.numel()
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()  # the forecast staging is reused by the next layer
        self.recorder.add(layer, wait_s=time.perf_counter() - t0)
        packet = self.forecast_device[: k * (INDEX_BYTES + self.host.row_bytes)]
        rows = packet[k * INDEX_BYTES:].view(self.host.dtype).view(k, hidden)
        self.workspace.index_copy_(1, packet[: k * INDEX_BYTES].view(INDEX_DTYPE), rows.t())
        remainder, wasted = forecast_split(predicted, active)
        self.recorder.add(layer, wasted=wasted)
        self.send(layer, remainder, remainder)
        return self.workspace

    def device_bytes(self) -> int:
        return super().device_bytes() + _nbytes(self.forecast_device)

    def pinned_bytes(self) -> int:
        return super().pinned_bytes() + (_nbytes(self.forecast_staging) if self.host.pin else 0)


POLICIES: dict[str, type] = {
    "resident": Resident,
    "dense-stream": DenseStream,
    "sparse-extents": SparseExtents,
    "packet": Packet,
    "phase-switched": PhaseSwitched,
    "row-retention": RowRetention,
    "early-forecast": EarlyForecast,
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
