"""Quantized packets: `dense-stream` and `packet` over int8 weight-only outgoing weights
(`weights: int8`, core.registry.WEIGHT_FORMATS).

Each outgoing row (neuron j's row of the (ffn, hidden) layout, column j of fc2.weight) is
quantized on the host with one symmetric absmax scale: q = round(row / s), s = max|row| / 127,
q in [-127, 127], s float32. A row travels as its `hidden` int8 values plus its 4-byte scale:
hidden + 4 bytes against fp16's 2 x hidden (50.08 % at OPT-2.7B's hidden 2560). A scale per
row rather than per hidden channel, so a row is self-contained: a packet carries exactly the
scales of its rows, and the ledger counts rows x (hidden + 4) bytes.

On the device the rows are dequantized after the copy, before the ordinary `F.linear`: the
workspace receives dtype(float32(q) * s), one float32 product rounded once to the protocol's
dtype (q is exact in float32, float16 and bfloat16 alike). The op is elementwise, so a row
dequantizes to the same bits alone, in a packet, or in the whole matrix: `packet {weights:
int8}` is bit-identical to `dense-stream {weights: int8}`, its reference. Against a reference
in the protocol's own precision an int8 condition is approximate (the weights differ).

Host layout (`int8_layout`, made once, charged in HostWeights.host_bytes): per layer one uint8
slab `[ffn float32 scales | ffn x hidden int8 rows]`, pinned on CUDA, so dense-stream copies a
layer in one transfer and packets gather rows and scales from its views.
"""

from dataclasses import dataclass

import torch

from packbench.core import charges
from packbench.core.registry import INT8_SCALE_BYTES
from packbench.engine.gather import gather_active_int8_rows
from packbench.engine.ledger import Recorder
from packbench.engine.policies.base import INDEX_BYTES, INDEX_DTYPE, HostWeights, nbytes, zeroed_workspace
from packbench.engine.policies.dense import DenseStream
from packbench.engine.policies.device_gather import DevicePacket, Mapped
from packbench.engine.policies.host_gather import HostGather, Staging

SCALE_DTYPE = torch.float32
SCALE_BYTES = INT8_SCALE_BYTES
QMAX = 127  # symmetric: -128 is never used, so -q is always representable


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, hidden) float of any layout -> ((n, hidden) int8, (n,) float32): symmetric absmax per
    row. An all-zero row gets scale 1 (its q are zeros either way)."""
    w = rows.to(torch.float32)
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """out = dtype(float32(q) * scales), elementwise (`scales` broadcast against `q`), in place.

    The copy makes q exact in out's dtype; the in-place multiply by a float32 tensor computes in
    float32 and rounds once to out's dtype (torch's type promotion). The same two ops serve the
    dense matrix and a packet's rows, so both give the same bits.
    """
    out.copy_(q)
    return out.mul_(scales)


def int8_row_bytes(host: HostWeights) -> int:
    """Bytes one quantized row moves: hidden int8 values and one float32 scale."""
    return host.shape[0] + SCALE_BYTES


def slab_views(slab: torch.Tensor, ffn: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((ffn,) float32 scales, (ffn, hidden) int8 rows) viewing one layer's uint8 slab."""
    scales = slab[: ffn * SCALE_BYTES].view(SCALE_DTYPE)
    rows = slab[ffn * SCALE_BYTES:].view(torch.int8).view(ffn, hidden)
    return scales, rows


def int8_layout(host: HostWeights) -> list[torch.Tensor]:
    """Every layer's quantized slab (made on first use, kept in `host.int8`, pinned on CUDA)."""
    if host.int8 is None:
        hidden, ffn = host.shape
        slabs = []
        for w in host.original:
            q, scales = quantize_rows(w.t())  # (ffn, hidden): neuron j's outgoing row is row j
            slab = torch.empty(ffn * (SCALE_BYTES + hidden), dtype=torch.uint8, pin_memory=host.pin)
            dst_scales, dst_rows = slab_views(slab, ffn, hidden)
            dst_scales.copy_(scales)
            dst_rows.copy_(q)
            slabs.append(slab)
        host.int8 = slabs
    return host.int8


class Int8DenseStream(DenseStream):
    """`dense-stream {weights: int8}`: dense-stream's double-buffered schedule moving each layer's
    quantized slab (ffn x (hidden + 4) bytes) into one of two device slabs; fc2 dequantizes its
    layer's slab into one workspace on the compute stream after the copy's event (so the copy
    stream still carries copies only)."""

    weights = "int8"

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        int8_layout(host)
        super().activate(host, device, recorder)
        self.workspace = zeroed_workspace(host, device)  # (hidden, ffn) dequantized, protocol dtype

    def deactivate(self) -> None:
        super().deactivate()
        self.workspace = None

    def landing(self, host: HostWeights, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        size = nbytes(host.int8[0])
        return (torch.zeros(size, dtype=torch.uint8, device=device),
                torch.zeros(size, dtype=torch.uint8, device=device))

    def copy_layer(self, layer: int, workspace: torch.Tensor) -> None:
        src = self.host.int8[layer]
        workspace.copy_(src, non_blocking=self.host.pin)
        ffn = self.host.shape[1]
        self.recorder.add(layer, **charges.dense_copy(ffn, int8_row_bytes(self.host)))

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        slab = super().fetch(layer, h)  # waited for: the copy has landed
        hidden, ffn = self.host.shape
        scales, rows = slab_views(slab, ffn, hidden)
        return dequantize_into(self.workspace, rows.t(), scales[None, :])

    def device_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.device_bytes() + nbytes(self.workspace)


@dataclass
class Int8RowPacket:
    """Quantized rows in transit, laid out as [n int64 indices | k float32 scales | k x hidden
    int8]: a host staging buffer (pinned on CUDA) and its device twin, each big enough for every
    row of a layer. One packet is one host-to-device transfer (RowPacket's int8 twin)."""

    staged: torch.Tensor  # (capacity,) uint8 on the host
    landed: torch.Tensor  # (capacity,) uint8 on the device
    hidden: int
    pinned: bool

    @classmethod
    def allocate(cls, host: HostWeights, device: torch.device) -> "Int8RowPacket":
        capacity = host.shape[1] * (INDEX_BYTES + int8_row_bytes(host))
        return cls(staged=torch.zeros(capacity, dtype=torch.uint8, pin_memory=host.pin),
                   landed=torch.zeros(capacity, dtype=torch.uint8, device=device),
                   hidden=host.shape[0], pinned=host.pin)

    def pack(self, slab_scales: torch.Tensor, slab_rows: torch.Tensor, rows: torch.Tensor,
             index: torch.Tensor) -> int:
        """Stage `index` (host int64), then the scales and int8 rows `rows` (host int64) of one
        layer's slab. Returns the packet's size in bytes."""
        k, n_index = rows.numel(), index.numel() * INDEX_BYTES
        at_rows = n_index + k * SCALE_BYTES
        size = at_rows + k * self.hidden
        staged = self.staged[:size]
        staged[:n_index].view(INDEX_DTYPE).copy_(index)
        torch.index_select(slab_scales, 0, rows, out=staged[n_index:at_rows].view(SCALE_DTYPE))
        torch.index_select(slab_rows, 0, rows, out=staged[at_rows:].view(torch.int8).view(k, self.hidden))
        return size

    def upload(self, size: int, *, non_blocking: bool) -> None:
        self.landed[:size].copy_(self.staged[:size], non_blocking=non_blocking)

    def index(self, n: int) -> torch.Tensor:
        return self.landed[: n * INDEX_BYTES].view(INDEX_DTYPE)

    def scales(self, n: int, k: int) -> torch.Tensor:
        """(k,) float32 on the device, behind the packet's `n` indices."""
        start = n * INDEX_BYTES
        return self.landed[start: start + k * SCALE_BYTES].view(SCALE_DTYPE)

    def rows(self, n: int, k: int) -> torch.Tensor:
        """(k, hidden) int8 on the device, behind the indices and the scales."""
        start = n * INDEX_BYTES + k * SCALE_BYTES
        return self.landed[start: start + k * self.hidden].view(torch.int8).view(k, self.hidden)


class Int8Packet(HostGather):
    """`packet {gather: host, weights: int8}`: the host gather's exact active rows, quantized:
    one `Int8RowPacket` per layer, dequantized on the device into the workspace's columns."""

    name = "packet"
    weights = "int8"

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.device, self.recorder = host, device, recorder
        int8_layout(host)  # the fp (ffn, hidden) layout is never needed
        self.buffers = self.allocate(host, device)

    def allocate(self, host: HostWeights, device: torch.device) -> Staging:
        workspace = zeroed_workspace(host, device)
        packet = Int8RowPacket.allocate(host, device)
        return Staging(workspace, packet, torch.zeros(host.shape[1], dtype=torch.bool, pin_memory=host.pin))

    def send(self, layer: int, rows: torch.Tensor, index: torch.Tensor) -> None:
        b = self.buffers
        packet = b.packet
        hidden, ffn = self.host.shape
        size = packet.pack(*slab_views(self.host.int8[layer], ffn, hidden), rows, index)
        packet.upload(size, non_blocking=self.host.pin)
        k, n = rows.numel(), index.numel()
        landed = torch.empty((k, hidden), dtype=self.host.dtype, device=b.workspace.device)
        dequantize_into(landed, packet.rows(n, k), packet.scales(n, k)[:, None])
        b.workspace.index_copy_(1, packet.index(n), landed.t())
        self.recorder.add(layer, **charges.unit_packet(k, int8_row_bytes(self.host), index=n))

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.send_active(layer, h)


class Int8DevicePacket(DevicePacket):
    """`packet {gather: device, weights: int8}`: the device finds the active rows and reads their
    int8 rows and scales from the host slab (on CUDA through a mapped view), dequantizing into
    the workspace (`engine.gather.gather_active_int8_rows`: on CUDA one Triton kernel per layer,
    no host synchronisation, so mode graph captures its decode step as it does packet's)."""

    weights = "int8"

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder, *,
                 workspace: torch.Tensor | None = None) -> None:
        self.host, self.recorder = host, recorder
        workspace = zeroed_workspace(host, device) if workspace is None else workspace
        counts = torch.zeros(host.layers, dtype=torch.int32, device=device)
        slabs = int8_layout(host)
        if device.type == "cuda":
            from packbench.engine.mapped import cuda_view

            slabs = [cuda_view(slab) for slab in slabs]
        self.buffers = Mapped(workspace=workspace, counts=counts, source=slabs)

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = self.call_buffers()
        hidden, ffn = self.host.shape
        scales, rows = slab_views(b.source[layer], ffn, hidden)
        gather_active_int8_rows(h, rows, scales, b.workspace, b.counts, layer, dequantize=dequantize_into)
        return b.workspace

    def row_bytes(self) -> int:
        return int8_row_bytes(self.host)
