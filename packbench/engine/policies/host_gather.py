"""The host-gather policies: `packet {gather: host}`, `sparse-extents`, `phase-switched
{gather: host}`, `row-retention` and `early-forecast {gather: host}`. Each reads the layer's
activity mask back (one synchronisation per layer), gathers the rows it chooses on the host
into one `RowPacket`, uploads it in one transfer and scatters it into a zeroed workspace.
One workspace serves every layer: layers run one after another on one stream, so layer l+1's
refresh is queued after layer l's matmul has consumed it.
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from packbench.core import charges
from packbench.core.charges import lru_plan  # noqa: F401  (the LRU's decisions live in core; re-exported)
from packbench.core.registry import check_param, param_default
from packbench.engine.ledger import Recorder
from packbench.engine.policies.base import (INDEX_DTYPE, HostWeights, RowPacket, nbytes, build_gather_layout,
                                  stream_dense, zeroed_workspace)


@dataclass
class Staging:
    """The buffers of a host-gather policy (packet and its relatives), while it is active."""

    workspace: torch.Tensor  # (hidden, ffn) on the device, zeros
    packet: RowPacket  # [k int64 | k rows] staging, host and device
    mask: torch.Tensor  # (ffn,) bool on the host, pinned on CUDA: the activity readback

    @staticmethod
    def parts(host: HostWeights, device: torch.device) -> tuple[torch.Tensor, RowPacket, torch.Tensor]:
        """The shared buffers, allocated in this order (subclasses allocate theirs after)."""
        workspace = zeroed_workspace(host, device)
        packet = RowPacket.allocate(host, device)
        return workspace, packet, torch.zeros(host.shape[1], dtype=torch.bool, pin_memory=host.pin)

    def device_bytes(self) -> int:
        return nbytes(self.workspace, self.packet.landed)

    def pinned_bytes(self) -> int:
        return nbytes(self.packet.staged, self.mask) if self.packet.pinned else 0


class HostGather:
    """What the host-gather policies share; not a policy itself (a subclass's `fetch` says
    which rows it sends).

    Per layer: reduce h to an activity mask on the device, read the mask back (one sync),
    gather the chosen outgoing rows on the host into one pinned `RowPacket`, copy it to the
    device in one transfer, and scatter the rows into the workspace's columns.
    """

    name: str
    starts_early = False
    gather = "host"  # where rows are gathered (a fact of the class, not a mode): after a mask readback

    def __init__(self) -> None:
        self.buffers: Staging | None = None

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.device, self.recorder = host, device, recorder
        build_gather_layout(host)
        self.buffers = self.allocate(host, device)

    def allocate(self, host: HostWeights, device: torch.device) -> Staging:
        return Staging(*Staging.parts(host, device))

    def deactivate(self) -> None:
        self.buffers = None

    def before_layer(self, layer: int) -> None:
        pass  # demand is known only after fc1

    def observe(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Sorted int64 indices (host) of neurons non-zero in any token of the call.

        The readback is the ffn-byte mask; the host waits for it (charged as D2H and copy wait).
        """
        mask_host = self.buffers.mask
        mask = (h != 0).any(dim=0)  # (ffn,) on the device
        t0 = time.perf_counter()
        mask_host.copy_(mask, non_blocking=self.host.pin)
        if self.host.pin:
            torch.cuda.current_stream(self.device).synchronize()
        wait_s = time.perf_counter() - t0
        active = mask_host.nonzero().squeeze(1)
        self.recorder.add(layer, **charges.activity_readback(active.numel(), mask_host.numel()), wait_s=wait_s)
        return active

    def send(self, layer: int, rows: torch.Tensor, index: torch.Tensor) -> None:
        """Gather outgoing `rows` (host int64) into the packet, prefixed by `index` (what the
        device scatters by), copy both in one transfer, scatter into the workspace columns `rows`."""
        b = self.buffers
        packet = b.packet
        size = packet.pack(self.host.transposed(layer), rows, index)
        packet.upload(size, non_blocking=self.host.pin)
        k, n = rows.numel(), index.numel()
        b.workspace.index_copy_(1, self.expand(packet.index(n)), packet.rows(n, k).t())
        self.recorder.add(layer, **charges.unit_packet(k, self.host.row_bytes, index=n))

    def expand(self, index: torch.Tensor) -> torch.Tensor:
        return index  # the index is the row list itself (sparse-extents sends block ids)

    def send_active(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The exact packet: every active row, indexed by itself."""
        active = self.observe(layer, h)
        self.send(layer, active, active)
        return self.buffers.workspace

    def device_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.device_bytes()

    def pinned_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.pinned_bytes()


class Packet(HostGather):
    """Exact active rows, gathered on the host: the union over the call's tokens, plus their
    indices, in one copy (`packet`, `gather: host`: what a protocol's `packet` has always meant)."""

    name = "packet"

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.send_active(layer, h)


@dataclass
class Extents(Staging):
    """sparse-extents' buffers: the staging, plus the row offsets within a block."""

    # (min(block_rows, ffn),) int64 on the host and on the device: no block holds more rows than
    # the layer has, so a block_rows above ffn (one block, every row) makes no larger buffer. Not
    # charged (at most ffn x 8 B), as before issue 9: charging it would change recorded bytes.
    offsets_host: torch.Tensor = field(kw_only=True)
    offsets: torch.Tensor = field(kw_only=True)


class SparseExtents(HostGather):
    """Every fixed-size block of `block_rows` outgoing rows that holds an active row.

    The packet carries block ids; the device expands them into row indices.
    """

    name = "sparse-extents"
    buffers: Extents | None

    def __init__(self, *, block_rows: int = param_default("sparse-extents", "block_rows")) -> None:
        super().__init__()
        self.block_rows = check_param(self.name, "block_rows", block_rows)

    def allocate(self, host: HostWeights, device: torch.device) -> Extents:
        shared = Staging.parts(host, device)
        offsets_host = torch.arange(min(self.block_rows, host.shape[1]), dtype=INDEX_DTYPE)
        return Extents(*shared, offsets_host=offsets_host, offsets=offsets_host.to(device))

    def rows_of(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        rows = (blocks[:, None] * self.block_rows + offsets[None, :]).flatten()
        return rows[rows < self.host.shape[1]]  # the last block may be short

    def expand(self, index: torch.Tensor) -> torch.Tensor:
        return self.rows_of(index, self.buffers.offsets)

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        active = self.observe(layer, h)
        blocks = torch.from_numpy(charges.extent_blocks(active.numpy(), self.block_rows))
        self.send(layer, self.rows_of(blocks, self.buffers.offsets_host), blocks)
        return self.buffers.workspace


class PhaseSwitched(HostGather):
    """Dense streaming for prefill calls, exact packets for decode calls, one set of buffers."""

    name = "phase-switched"

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.recorder.phase == "prefill":
            return stream_dense(self.host, layer, self.buffers.workspace, self.recorder)
        return self.send_active(layer, h)


@dataclass
class Retention(Staging):
    """row-retention's buffers: the staging, plus the row cache and its LRU bookkeeping."""

    cache: torch.Tensor = field(kw_only=True)  # (layers, slots, hidden) on the device: charged
    slot_of: np.ndarray = field(kw_only=True)  # (layers, ffn) cache slot of each neuron or -1
    last_used: np.ndarray = field(kw_only=True)  # (layers, slots) last call a slot served

    def device_bytes(self) -> int:
        return super().device_bytes() + nbytes(self.cache)


class RowRetention(HostGather):
    """A device cache of `rows_per_layer` outgoing rows per layer with LRU replacement; only
    misses are copied. The cache is charged to the condition's device bytes."""

    name = "row-retention"
    buffers: Retention | None

    def __init__(self, *, rows_per_layer: int) -> None:  # no default: the protocol requires one
        super().__init__()
        self.rows_per_layer = check_param(self.name, "rows_per_layer", rows_per_layer)

    def allocate(self, host: HostWeights, device: torch.device) -> Retention:
        shared = Staging.parts(host, device)
        hidden, ffn = host.shape
        slots = min(self.rows_per_layer, ffn)
        return Retention(*shared, cache=torch.zeros((host.layers, slots, hidden), dtype=host.dtype, device=device),
                         slot_of=np.full((host.layers, ffn), -1, dtype=np.int64),
                         last_used=np.full((host.layers, slots), -1, dtype=np.int64))

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = self.buffers
        active = self.observe(layer, h)
        hit_rows, hit_slots, miss_rows, fill_rows, fill_slots = lru_plan(
            b.slot_of[layer], b.last_used[layer], active.numpy(), self.recorder.serial)
        cache = b.cache[layer]
        if hit_rows.size:
            dev_slots = torch.from_numpy(hit_slots).to(self.device, non_blocking=False)
            dev_rows = torch.from_numpy(hit_rows).to(self.device, non_blocking=False)
            b.workspace.index_copy_(1, dev_rows, cache.index_select(0, dev_slots).t())
            self.recorder.add(layer, **charges.retention_hits(hit_rows.size))
        self.send(layer, torch.from_numpy(miss_rows), torch.from_numpy(miss_rows))
        if fill_rows.size:
            # The filled rows are the tail of the packet just sent, already on the device.
            n = miss_rows.size
            sent = b.packet.rows(n, n)[n - fill_rows.size:]
            cache.index_copy_(0, torch.from_numpy(fill_slots).to(self.device), sent)
            self.recorder.add(layer, **charges.retention_fills(fill_slots.size))
        return b.workspace


def forecast_split(predicted: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(remainder, wasted) of host int64 tensors: core/charges.py `forecast_split`'s decision."""
    remainder, wasted = charges.forecast_split(predicted.numpy(), active.numpy())
    return torch.from_numpy(remainder), wasted


@dataclass
class Forecast(Staging):
    """early-forecast's buffers: the staging, plus a second packet for the forecast rows, the
    side stream that copies it, and the forecasts themselves."""

    forecast: RowPacket = field(kw_only=True)
    side: "torch.cuda.Stream | None" = field(kw_only=True)  # None off CUDA: the copy is synchronous
    previous: list[torch.Tensor | None] = field(kw_only=True)  # per layer: rows active in its last call
    pending: dict[int, tuple[torch.Tensor, object]] = field(kw_only=True, default_factory=dict)

    def device_bytes(self) -> int:
        return super().device_bytes() + nbytes(self.forecast.landed)

    def pinned_bytes(self) -> int:
        return super().pinned_bytes() + (nbytes(self.forecast.staged) if self.forecast.pinned else 0)


class EarlyForecast(HostGather):
    """Predict a call's active rows from the same layer's previous call and send them as the
    layer starts (on a side stream on CUDA), then send the exact remainder after fc1. Predicted
    rows that turn out inactive are counted as wasted; exactness never depends on the forecast.
    """

    name = "early-forecast"
    starts_early = True
    buffers: Forecast | None

    def allocate(self, host: HostWeights, device: torch.device) -> Forecast:
        shared = Staging.parts(host, device)
        return Forecast(*shared, forecast=RowPacket.allocate(host, device),
                        side=torch.cuda.Stream(device) if device.type == "cuda" else None,
                        previous=[None] * host.layers)

    def before_layer(self, layer: int) -> None:
        b = self.buffers
        predicted = b.previous[layer] if self.recorder.phase == "decode" else None
        if predicted is None or predicted.numel() == 0:
            return
        k = predicted.numel()
        size = b.forecast.pack(self.host.transposed(layer), predicted, predicted)
        if b.side is not None:
            b.side.wait_stream(torch.cuda.current_stream(self.device))  # the buffer is free
            with torch.cuda.stream(b.side):
                b.forecast.upload(size, non_blocking=True)
                event = torch.cuda.Event()
                event.record(b.side)
        else:
            b.forecast.upload(size, non_blocking=False)
            event = None
        b.pending[layer] = (predicted, event)
        self.recorder.add(layer, **charges.unit_packet(k, self.host.row_bytes))

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = self.buffers
        active = self.observe(layer, h)
        b.previous[layer] = active
        predicted, event = b.pending.pop(layer, (None, None))
        if predicted is None:
            self.send(layer, active, active)
            return b.workspace
        k = predicted.numel()
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()  # the forecast staging is reused by the next layer
        self.recorder.add(layer, wait_s=time.perf_counter() - t0)
        b.workspace.index_copy_(1, b.forecast.index(k), b.forecast.rows(k, k).t())
        remainder, wasted = forecast_split(predicted, active)
        self.recorder.add(layer, wasted=wasted)
        self.send(layer, remainder, remainder)
        return b.workspace
