"""The device-gather policies: `packet {gather: device}`, `phase-switched {gather: device}` and
`early-forecast {gather: device}`. The device finds the active rows and pulls them from mapped
host memory itself (`engine.gather`): no host decision inside a call, so mode graph captures
their decode steps; counts stay on the device until the call's logits are back.
"""

from dataclasses import dataclass, field

import torch

from packbench.core import charges
from packbench.engine.gather import complete_forecast, gather_active_rows
from packbench.engine.ledger import CallLedger, Recorder
from packbench.engine.policies.base import HostWeights, nbytes, build_gather_layout, zeroed_workspace
from packbench.engine.policies.dense import DenseStream, DoubleBuffer, copies_ahead


@dataclass
class Mapped:
    """The buffers of `DevicePacket`, while it is active."""

    workspace: torch.Tensor  # (hidden, ffn) on the device, zeros
    counts: torch.Tensor  # (layers,) int32 on the device: active rows per layer of one call
    source: list[torch.Tensor]  # (ffn, hidden) per layer: mapped views of HostWeights (charged there)
    counted_call: int = -1  # recorder.serial of the call `counts` belongs to

    def device_bytes(self) -> int:
        return nbytes(self.workspace, self.counts)


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
            from packbench.engine.mapped import cuda_view

            source = [cuda_view(host.transposed(layer)) for layer in range(host.layers)]
        else:
            source = [host.transposed(layer) for layer in range(host.layers)]
        self.buffers = Mapped(workspace=workspace, counts=counts, source=source)

    def deactivate(self) -> None:
        self.buffers = None

    def before_layer(self, layer: int) -> None:
        pass  # packet: demand is known only after fc1

    def call_buffers(self) -> Mapped:
        """The buffers, their counts zeroed and the settle deferred at the call's first layer."""
        b = self.buffers
        if b.counted_call != self.recorder.serial:  # the call's first layer
            b.counted_call = self.recorder.serial
            b.counts.zero_()
            self.recorder.defer(self.settle)
        return b

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = self.call_buffers()
        gather_active_rows(h, b.source[layer], b.workspace, b.counts, layer)
        return b.workspace

    def row_bytes(self) -> int:
        """Bytes one active row moves (the int8 variant: its int8 row and its scale)."""
        return self.host.row_bytes

    def settle(self, call: CallLedger) -> None:
        """The call has ended (its logits are on the host): read every layer's count at once."""
        counts = self.buffers.counts
        row_bytes = self.row_bytes()
        for layer, k in enumerate(counts.tolist()):
            self.recorder.add(layer, **charges.device_counts(k, row_bytes))

    def device_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.device_bytes()

    def pinned_bytes(self) -> int:
        return 0


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
        return self.dense.device_bytes() + nbytes(self.packet.buffers.counts)  # the workspace is dense-stream's

    def pinned_bytes(self) -> int:
        return 0


@dataclass
class DeviceForecastBuffers(DoubleBuffer):
    """The buffers of `DeviceForecast`, while it is active: dense-stream's two workspaces and
    copy stream (here it carries the forecasts), plus the forecast itself and the counts."""

    prev: torch.Tensor = field(kw_only=True)  # (layers, ffn) int8 on the device: each layer's active set in its last call
    counts: torch.Tensor = field(kw_only=True)  # (4, layers) int32 on the device: active, forecast, missed, wasted rows
    source: list[torch.Tensor] = field(kw_only=True)  # (ffn, hidden) per layer: mapped views of HostWeights (charged there)
    counted_call: int = -1  # recorder.serial of the call `counts` belongs to

    def device_bytes(self) -> int:
        return super().device_bytes() + nbytes(self.prev, self.counts)


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
            from packbench.engine.mapped import cuda_view

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
        for layer in range(self.host.layers):
            self.recorder.add(layer, **charges.device_counts(active[layer], self.host.row_bytes, counters=4,
                                                             rows=forecast[layer] + missed[layer], wasted=wasted[layer]))

    def device_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.device_bytes()

    def pinned_bytes(self) -> int:
        return 0
