"""The dense policies: `resident` (every outgoing weight on the device) and `dense-stream`
(every call copies each layer's whole weight, double-buffered on a copy stream of its own)."""

from dataclasses import dataclass, field

import torch

from packbench.core.registry import check_param
from packbench.engine.ledger import Recorder
from packbench.engine.policies.base import HostWeights, nbytes, stream_dense, zeroed_workspace


class Resident:
    """All outgoing weights on the device: the warm-latency reference where it fits."""

    name = "resident"
    starts_early = False

    def __init__(self, *, allowance: str = "held") -> None:
        # "unbounded": the worker lifts the allocator's cap for this policy's episodes (engine/worker.py)
        self.allowance = check_param(self.name, "allowance", allowance)
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
        return nbytes(*(self.weights or ()))

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
        return nbytes(*self.workspaces)

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
        workspaces = self.landing(host, device)
        copy = None
        if device.type == "cuda":
            # Copies only, never a kernel: no cuBLAS workspace is kept for this stream.
            copy = torch.cuda.Stream(device)
            for workspace in workspaces:
                workspace.record_stream(copy)  # freed only once the copy stream's work is done
        self.buffers = DoubleBuffer(workspaces, copy)

    def landing(self, host: HostWeights, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The two device buffers the copies land in: workspaces in the original layout."""
        return zeroed_workspace(host, device), zeroed_workspace(host, device)

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
            self.copy_layer(layer, b.of(layer))
            b.landed[layer] = None
            return
        capturing = torch.cuda.is_current_stream_capturing()
        b.copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(b.copy):
            self.copy_layer(layer, b.of(layer))
            done = torch.cuda.Event()
            done.record(b.copy)
        b.landed[layer] = done
        # Only a captured copy is joined at its piece's end: waiting inside a capture on an
        # event of uncaptured work (the eager warm-up call's last copy) is a capture error.
        b.tail = done if capturing else None

    def copy_layer(self, layer: int, workspace: torch.Tensor) -> None:
        """The copy itself, on the current stream (the int8 variant copies its rows and scales)."""
        stream_dense(self.host, layer, workspace, self.recorder)

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
