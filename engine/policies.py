"""Loader policies: how each layer's outgoing FFN weight reaches the device for a call.

Every policy hands `OutgoingLinear` a device weight in the ORIGINAL layout (hidden, ffn), and
the layer multiplies with the ordinary dense `F.linear`, exactly as stock OPT's fc2 does. Rows a
policy did not refresh hold stale but finite values; they meet exact zeros in `h`, so logits
are bit-identical to streaming everything. (The workspace starts as zeros, never `empty`: an
uninitialised bfloat16 buffer held NaN, and 0 * NaN breaks exactness.)

One workspace serves every layer: layers run one after another on one stream, so layer l+1's
refresh is queued after layer l's matmul has consumed it. dense-stream alone keeps two and
fills them on a copy stream of its own, so a layer's copy overlaps the layers before it.

Layout of this file, bottom-up: the host weights; the shared pieces (a zeroed workspace, the
dense copy, `RowPacket`: rows in transit); one class per policy, each holding its buffers in
one object made in `activate` and dropped in `deactivate`; the registry `POLICIES`, whose
constructors take exactly the parameters and defaults of `core.registry.POLICY_PARAMS`.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.registry import check_param, param_default
from engine.gather import complete_forecast, gather_active_rows
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
    recorder.add(layer, rows=src.shape[1], weight_bytes=_nbytes(src))
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


# ----------------------------------------------------------------------------- policies


class Resident:
    """All outgoing weights on the device: the warm-latency reference where it fits."""

    name = "resident"
    starts_early = False

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] | None = None  # (hidden, ffn) per layer, while active

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.weights = [w.to(device, copy=True) for w in host.original]

    def deactivate(self) -> None:
        self.weights = None

    def before_layer(self, layer: int) -> None:
        pass  # resident: nothing to fetch

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.weights[layer]

    def device_bytes(self) -> int:
        return _nbytes(*(self.weights or ()))

    def pinned_bytes(self) -> int:
        return 0


def copies_ahead(layer: int, layers: int) -> tuple[int, ...]:
    """The layers whose dense copies are issued as layer `layer`'s fc1 starts: at layer 0 the
    call's first two (a call never uses a copy issued in the call before it: its bytes are its
    own), then always the next one. Layer l+1's workspace is the one fc2 of layer l-1 read,
    already queued by then; layer l's own copy was issued a layer earlier."""
    wanted = (0, 1) if layer == 0 else (layer + 1,)
    return tuple(ahead for ahead in wanted if ahead < layers)


@dataclass
class DoubleBuffer:
    """dense-stream's buffers, while it is active: layer l's weight lands in `workspaces[l % 2]`
    (early-forecast's device gather lands its forecasts the same way: `DeviceForecastBuffers`)."""

    workspaces: tuple[torch.Tensor, torch.Tensor]  # (hidden, ffn) on the device each, zeros
    copy: "torch.cuda.Stream | None"  # the stream that fills them; None off CUDA (copies run in place)
    # layer -> the end of its copy, until fetch waits for it; None: nothing left to wait for
    # (off CUDA, or joined at the end of a captured piece)
    landed: dict[int, "torch.cuda.Event | None"] = field(default_factory=dict)
    tail: "torch.cuda.Event | None" = None  # the end of the last copy issued and not yet joined

    def of(self, layer: int) -> torch.Tensor:
        return self.workspaces[layer % 2]

    def device_bytes(self) -> int:
        return _nbytes(*self.workspaces)

    def join(self, stream: "torch.cuda.Stream") -> None:
        """Make `stream` wait for every copy issued so far. A captured graph piece must rejoin
        every stream it forked before it ends (engine/graph.py calls the policy's `join` at each
        piece's end); the copies joined need no wait later in the capture."""
        if self.tail is not None:
            stream.wait_event(self.tail)  # the copy stream runs in order: its last copy ends last
            self.tail = None
        self.landed = dict.fromkeys(self.landed)


class DenseStream:
    """Every call copies each layer's whole outgoing weight host-to-device, in its original layout.

    Double-buffered: layer l+1's copy is issued as layer l's fc1 starts, into the workspace
    layer l-1's fc2 has finished with, on a copy stream of its own (CUDA), so it runs while
    the compute stream finishes layer l and starts layer l+1; fc2 of layer l+1 waits for it.
    Before issue 11 each copy was issued at fetch on the compute stream into one workspace,
    so copy(l) waited for compute(l-1) and compute(l) for copy(l): 85 % of the pinned
    bandwidth in mode eager on the H200, 88 % in mode graph (docs/benchmarks.md). The matmul
    sees the same whole weight either way: logits are unchanged. Off CUDA the same schedule
    runs with in-place copies (the CPU twin).
    """

    name = "dense-stream"
    starts_early = True  # before_layer(l), at fc1 of layer l, issues the copy of layer l+1

    def __init__(self) -> None:
        self.buffers: DoubleBuffer | None = None

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.device, self.recorder = host, device, recorder
        workspaces = (zeroed_workspace(host, device), zeroed_workspace(host, device))
        copy = None
        if device.type == "cuda":
            # Copies only, never a kernel: no cuBLAS workspace is kept for this stream.
            copy = torch.cuda.Stream(device)
            for workspace in workspaces:
                workspace.record_stream(copy)  # freed only once the copy stream's work is done
        self.buffers = DoubleBuffer(workspaces, copy)

    def deactivate(self) -> None:
        self.buffers = None

    def before_layer(self, layer: int) -> None:
        b = self.buffers
        if layer == 0:  # a new call: nothing of the call before is waited for or carried over
            b.landed.clear()
            b.tail = None
        for ahead in copies_ahead(layer, self.host.layers):
            self.issue(ahead)

    def issue(self, layer: int) -> None:
        """Copy layer `layer`'s whole weight into its workspace, charged to that layer now.

        On CUDA the copy stream first waits for everything queued on the compute stream so
        far, which includes the last fc2 that read this workspace (two layers back, or the
        call before); inside a graph capture that wait is the fork of the copy stream.
        """
        b = self.buffers
        if b.copy is None:
            stream_dense(self.host, layer, b.of(layer), self.recorder)
            b.landed[layer] = None
            return
        capturing = torch.cuda.is_current_stream_capturing()
        b.copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(b.copy):
            stream_dense(self.host, layer, b.of(layer), self.recorder)
            done = torch.cuda.Event()
            done.record(b.copy)
        b.landed[layer] = done
        # Only a captured copy is joined at its piece's end: waiting inside a capture on an
        # event of uncaptured work (the eager warm-up call's last copy) is a capture error.
        b.tail = done if capturing else None

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = self.buffers
        if layer not in b.landed:  # a caller that ignored starts_early: copy now, still exact
            self.issue(layer)
        done = b.landed.pop(layer)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return b.of(layer)

    def join(self, stream: "torch.cuda.Stream") -> None:
        """A captured piece rejoins the copy stream before it ends (DoubleBuffer.join)."""
        self.buffers.join(stream)

    def device_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.device_bytes()

    def pinned_bytes(self) -> int:
        return 0


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
        return _nbytes(self.workspace, self.packet.landed)

    def pinned_bytes(self) -> int:
        return _nbytes(self.packet.staged, self.mask) if self.packet.pinned else 0


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
        self.recorder.add(layer, active=active.numel(), d2h_bytes=_nbytes(mask_host), wait_s=wait_s)
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
        self.recorder.add(layer, rows=k, weight_bytes=k * self.host.row_bytes, index_bytes=n * INDEX_BYTES)

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
class Mapped:
    """The buffers of `DevicePacket`, while it is active."""

    workspace: torch.Tensor  # (hidden, ffn) on the device, zeros
    counts: torch.Tensor  # (layers,) int32 on the device: active rows per layer of one call
    source: list[torch.Tensor]  # (ffn, hidden) per layer: mapped views of HostWeights (charged there)
    counted_call: int = -1  # recorder.serial of the call `counts` belongs to

    def device_bytes(self) -> int:
        return _nbytes(self.workspace, self.counts)


class DevicePacket:
    """Exact active rows, gathered by the device (`packet`, `gather: device`).

    The compute device finds the active rows itself and, on CUDA, pulls them straight from
    pinned host memory through a mapped view (UVA) into the workspace, in one kernel per layer
    (`engine.gather`): no host work, no index, no staging copy, and no per-layer
    synchronisation. Each layer's active count stays on the device until the call's logits are
    back; then the counts (4 bytes a layer, charged as D2H) are read once.
    """

    name = "packet"
    starts_early = False
    gather = "device"  # no host decision inside a call

    def __init__(self) -> None:
        self.buffers: Mapped | None = None

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder, *,
                 workspace: torch.Tensor | None = None) -> None:
        """`workspace`: a (hidden, ffn) device tensor of finite values to gather into (shared,
        e.g. device phase-switched's dense workspace); by default a zeroed one of its own."""
        self.host, self.recorder = host, recorder
        workspace = zeroed_workspace(host, device) if workspace is None else workspace
        build_gather_layout(host)
        counts = torch.zeros(host.layers, dtype=torch.int32, device=device)
        if device.type == "cuda":
            from engine.mapped import cuda_view

            source = [cuda_view(host.transposed(layer)) for layer in range(host.layers)]
        else:
            source = [host.transposed(layer) for layer in range(host.layers)]
        self.buffers = Mapped(workspace=workspace, counts=counts, source=source)

    def deactivate(self) -> None:
        self.buffers = None

    def before_layer(self, layer: int) -> None:
        pass  # packet: demand is known only after fc1

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = self.buffers
        if b.counted_call != self.recorder.serial:  # the call's first layer
            b.counted_call = self.recorder.serial
            b.counts.zero_()
            self.recorder.defer(self.settle)
        gather_active_rows(h, b.source[layer], b.workspace, b.counts, layer)
        return b.workspace

    def settle(self, call: CallLedger) -> None:
        """The call has ended (its logits are on the host): read every layer's count at once."""
        counts = self.buffers.counts
        row_bytes = self.host.row_bytes
        for layer, k in enumerate(counts.tolist()):
            self.recorder.add(layer, active=k, rows=k, weight_bytes=k * row_bytes, d2h_bytes=counts.element_size())

    def device_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.device_bytes()

    def pinned_bytes(self) -> int:
        return 0


# `packet`'s gathers: a plain registry whose keys are the registry's `gather` choices.
PACKET_GATHERS: dict[str, type[LoaderPolicy]] = {"host": Packet, "device": DevicePacket}


def packet(*, gather: str = param_default("packet", "gather")) -> LoaderPolicy:
    """The `packet` condition: exact active rows, gathered on the host or by the device."""
    return PACKET_GATHERS[check_param("packet", "gather", gather)]()


@dataclass
class Extents(Staging):
    """sparse-extents' buffers: the staging, plus the row offsets within a block."""

    # (block_rows,) int64 on the host and on the device. Not charged (block_rows x 8 B), as
    # before issue 9: charging it would change recorded bytes.
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
        offsets_host = torch.arange(self.block_rows, dtype=INDEX_DTYPE)
        return Extents(*shared, offsets_host=offsets_host, offsets=offsets_host.to(device))

    def rows_of(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        rows = (blocks[:, None] * self.block_rows + offsets[None, :]).flatten()
        return rows[rows < self.host.shape[1]]  # the last block may be short

    def expand(self, index: torch.Tensor) -> torch.Tensor:
        return self.rows_of(index, self.buffers.offsets)

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        active = self.observe(layer, h)
        blocks = torch.unique(active // self.block_rows)
        self.send(layer, self.rows_of(blocks, self.buffers.offsets_host), blocks)
        return self.buffers.workspace


class PhaseSwitched(HostGather):
    """Dense streaming for prefill calls, exact packets for decode calls, one set of buffers."""

    name = "phase-switched"

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.recorder.phase == "prefill":
            return stream_dense(self.host, layer, self.buffers.workspace, self.recorder)
        return self.send_active(layer, h)


class DevicePhaseSwitched:
    """phase-switched with the device's gather (`phase-switched`, `gather: device`): prefill
    calls run dense-stream's double-buffered copies, decode calls `packet {gather: device}`'s
    gather, into the first of dense-stream's two workspaces (its rows are finite, whatever they
    hold: an inactive row meets an exact zero). No host decision in a decode call, so mode graph
    captures the decode step as it does packet's; prefill runs eagerly, as every prefill does.
    """

    name = "phase-switched"
    starts_early = True  # prefill: dense-stream issues layer l+1's copy as layer l's fc1 starts
    gather = "device"

    def __init__(self) -> None:
        self.dense, self.packet = DenseStream(), DevicePacket()

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder = host, recorder
        self.dense.activate(host, device, recorder)
        self.packet.activate(host, device, recorder, workspace=self.dense.buffers.workspaces[0])

    def deactivate(self) -> None:
        self.dense.deactivate()
        self.packet.deactivate()

    def before_layer(self, layer: int) -> None:
        if self.recorder.phase == "prefill":
            self.dense.before_layer(layer)
        # decode: demand is known only after fc1

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.recorder.phase == "prefill":
            return self.dense.fetch(layer, h)
        return self.packet.fetch(layer, h)

    def join(self, stream: "torch.cuda.Stream") -> None:
        """A captured piece rejoins dense-stream's copy stream (a decode step forks none)."""
        if self.dense.buffers is not None:
            self.dense.join(stream)

    def device_bytes(self) -> int:
        if self.dense.buffers is None:
            return 0
        return self.dense.device_bytes() + _nbytes(self.packet.buffers.counts)  # the workspace is dense-stream's

    def pinned_bytes(self) -> int:
        return 0


# `phase-switched`'s gathers, as packet's.
PHASE_SWITCHED_GATHERS: dict[str, type[LoaderPolicy]] = {"host": PhaseSwitched, "device": DevicePhaseSwitched}


def phase_switched(*, gather: str = param_default("phase-switched", "gather")) -> LoaderPolicy:
    """The `phase-switched` condition: dense prefill, exact packets in decode, gathered on the
    host (one mask readback per layer) or by the device."""
    return PHASE_SWITCHED_GATHERS[check_param("phase-switched", "gather", gather)]()


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



@dataclass
class Retention(Staging):
    """row-retention's buffers: the staging, plus the row cache and its LRU bookkeeping."""

    cache: torch.Tensor = field(kw_only=True)  # (layers, slots, hidden) on the device: charged
    slot_of: np.ndarray = field(kw_only=True)  # (layers, ffn) cache slot of each neuron or -1
    last_used: np.ndarray = field(kw_only=True)  # (layers, slots) last call a slot served

    def device_bytes(self) -> int:
        return super().device_bytes() + _nbytes(self.cache)


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
            self.recorder.add(layer, index_bytes=2 * hit_rows.size * INDEX_BYTES)
        self.send(layer, torch.from_numpy(miss_rows), torch.from_numpy(miss_rows))
        if fill_rows.size:
            # The filled rows are the tail of the packet just sent, already on the device.
            n = miss_rows.size
            sent = b.packet.rows(n, n)[n - fill_rows.size:]
            cache.index_copy_(0, torch.from_numpy(fill_slots).to(self.device), sent)
            self.recorder.add(layer, index_bytes=fill_slots.size * INDEX_BYTES)
        return b.workspace


def forecast_split(predicted: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(remainder, wasted): the active rows the forecast missed, which must still be sent, and
    how many forecast rows turned out inactive. Exactness never depends on the forecast: every
    active row is either forecast or in the remainder."""
    hit = torch.isin(active, predicted)
    return active[~hit], predicted.numel() - int(hit.sum())



@dataclass
class Forecast(Staging):
    """early-forecast's buffers: the staging, plus a second packet for the forecast rows, the
    side stream that copies it, and the forecasts themselves."""

    forecast: RowPacket = field(kw_only=True)
    side: "torch.cuda.Stream | None" = field(kw_only=True)  # None off CUDA: the copy is synchronous
    previous: list[torch.Tensor | None] = field(kw_only=True)  # per layer: rows active in its last call
    pending: dict[int, tuple[torch.Tensor, object]] = field(kw_only=True, default_factory=dict)

    def device_bytes(self) -> int:
        return super().device_bytes() + _nbytes(self.forecast.landed)

    def pinned_bytes(self) -> int:
        return super().pinned_bytes() + (_nbytes(self.forecast.staged) if self.forecast.pinned else 0)


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
        self.recorder.add(layer, rows=k, weight_bytes=k * self.host.row_bytes, index_bytes=k * INDEX_BYTES)

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


@dataclass
class DeviceForecastBuffers(DoubleBuffer):
    """The buffers of `DeviceForecast`, while it is active: dense-stream's two workspaces and
    copy stream (here it carries the forecasts), plus the forecast itself and the counts."""

    prev: torch.Tensor = field(kw_only=True)  # (layers, ffn) int8 on the device: each layer's active set in its last call
    counts: torch.Tensor = field(kw_only=True)  # (4, layers) int32 on the device: active, forecast, missed, wasted rows
    source: list[torch.Tensor] = field(kw_only=True)  # (ffn, hidden) per layer: mapped views of HostWeights (charged there)
    counted_call: int = -1  # recorder.serial of the call `counts` belongs to

    def device_bytes(self) -> int:
        return super().device_bytes() + _nbytes(self.prev, self.counts)


class DeviceForecast:
    """early-forecast with the device's gather (`early-forecast`, `gather: device`).

    The same rows as the host's early-forecast (forecast = the layer's active rows in its last
    call; then the active rows the forecast missed), so the same bytes and the same wasted
    rows, but the device decides and copies: the forecast lives on the device (`prev`), a
    kernel pulls its rows from mapped host memory, and a second kernel, after fc1, pulls the
    rows it missed, counts, and stores the new forecast (`engine.gather`). No host decision, so
    mode graph captures its decode step. As dense-stream does, layer l+1's forecast is copied
    on a stream of its own while layer l finishes (two workspaces); fc2 of a layer waits only for
    its own forecast and the missed rows. No index travels (counts, 16 bytes a layer, come back
    after the logits, charged as D2H).
    """

    name = "early-forecast"
    starts_early = True  # before_layer(l), at fc1 of layer l, issues layer l+1's forecast copy
    gather = "device"

    def __init__(self) -> None:
        self.buffers: DeviceForecastBuffers | None = None

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.device, self.recorder = host, device, recorder
        build_gather_layout(host)
        workspaces = (zeroed_workspace(host, device), zeroed_workspace(host, device))
        prev = torch.zeros((host.layers, host.shape[1]), dtype=torch.int8, device=device)
        counts = torch.zeros((4, host.layers), dtype=torch.int32, device=device)
        side = None
        if device.type == "cuda":
            from engine.mapped import cuda_view

            source = [cuda_view(host.transposed(layer)) for layer in range(host.layers)]
            side = torch.cuda.Stream(device)  # Triton kernels only: no cuBLAS workspace is kept for it
            for t in (*workspaces, prev, counts):
                t.record_stream(side)
        else:
            source = [host.transposed(layer) for layer in range(host.layers)]
        self.buffers = DeviceForecastBuffers(workspaces, side, prev=prev, counts=counts, source=source)

    def deactivate(self) -> None:
        self.buffers = None

    def _open_call(self) -> None:
        """The call's first use of the counts: zero them (on the compute stream) and settle later."""
        b = self.buffers
        if b.counted_call != self.recorder.serial:
            b.counted_call = self.recorder.serial
            b.counts.zero_()
            b.landed.clear()
            b.tail = None
            self.recorder.defer(self.settle)

    def before_layer(self, layer: int) -> None:
        if self.recorder.phase != "decode":
            return  # a prefill has no forecast (as the host's early-forecast)
        self._open_call()
        for ahead in copies_ahead(layer, self.host.layers):
            self.issue(ahead)

    def issue(self, layer: int) -> None:
        """Copy layer `layer`'s forecast rows into its workspace. On CUDA the side stream first
        waits for the compute stream (the last fc2 that read this workspace, the counts' zeroing);
        inside a capture that wait is the fork."""
        b = self.buffers
        forecast = b.prev[layer][None]  # (1, ffn): "active" where the layer's last call was
        if b.copy is None:
            gather_active_rows(forecast, b.source[layer], b.of(layer), b.counts[1], layer)
            b.landed[layer] = None
            return
        capturing = torch.cuda.is_current_stream_capturing()
        b.copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(b.copy):
            gather_active_rows(forecast, b.source[layer], b.of(layer), b.counts[1], layer)
            done = torch.cuda.Event()
            done.record(b.copy)
        b.landed[layer] = done
        b.tail = done if capturing else None  # as DenseStream.issue

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = self.buffers
        self._open_call()
        forecast = layer in b.landed
        done = b.landed.pop(layer, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        complete_forecast(h, b.prev, forecast, b.source[layer], b.of(layer), b.counts, layer)
        return b.of(layer)

    def join(self, stream: "torch.cuda.Stream") -> None:
        """A captured piece rejoins the side stream before it ends (DoubleBuffer.join)."""
        self.buffers.join(stream)

    def settle(self, call: CallLedger) -> None:
        """The call has ended: read the four counts of every layer at once."""
        active, forecast, missed, wasted = self.buffers.counts.tolist()
        row_bytes, d2h = self.host.row_bytes, 4 * self.buffers.counts.element_size()
        for layer in range(self.host.layers):
            rows = forecast[layer] + missed[layer]
            self.recorder.add(layer, active=active[layer], rows=rows, weight_bytes=rows * row_bytes,
                              d2h_bytes=d2h, wasted=wasted[layer])

    def device_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.device_bytes()

    def pinned_bytes(self) -> int:
        return 0


# `early-forecast`'s gathers, as PACKET_GATHERS.
FORECAST_GATHERS: dict[str, type[LoaderPolicy]] = {"host": EarlyForecast, "device": DeviceForecast}


def early_forecast(*, gather: str = param_default("early-forecast", "gather")) -> LoaderPolicy:
    """The `early-forecast` condition: forecast rows gathered on the host or by the device."""
    return FORECAST_GATHERS[check_param("early-forecast", "gather", gather)]()


# One constructor per policy name of core.registry.POLICY_PARAMS, taking exactly its parameters
# as keyword-only arguments with its defaults (tests/engine/test_policy_registry.py checks).
POLICIES: dict[str, Callable[..., LoaderPolicy]] = {
    "resident": Resident,
    "dense-stream": DenseStream,
    "sparse-extents": SparseExtents,
    "packet": packet,
    "phase-switched": phase_switched,
    "row-retention": RowRetention,
    "early-forecast": early_forecast,
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
