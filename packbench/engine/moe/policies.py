"""Loader policies at expert granularity. Each hands the layer a device pair (gate_up, down)
in transformers' fused layout, indexed by the global expert id, valid for every expert the
call routed to; stock transformers' expert loop then multiplies exactly as it would with the
weights resident. Experts a policy did not refresh hold stale but finite values (the workspace
starts as zeros, never `empty`) and no token meets them, so logits are bit-identical to
streaming every expert (tests/engine/test_moe.py, fp32/fp16/bf16).

| policy | per layer and call | charged |
| --- | --- | --- |
| `resident` | nothing: every expert lives on the device | the experts' device bytes |
| `dense-stream` | every expert of the layer, one copy of each fused tensor into the workspace | E x expert bytes |
| `packet {gather: host}` | the union of the call's routed experts: a host gather into one pinned buffer `[m int64 | m gate_up | m down]`, one upload, an index copy into the workspace | m x expert bytes + 8m B; E B routing readback |
| `packet {gather: device}` | the same experts, each read by the copy engine straight from its contiguous pinned slices into its workspace slot (2m copies queued at once, no host memcpy, no index: the expert id is the copy's destination) | m x expert bytes; E B routing readback |
| `packet {gather: mapped}` | the same experts, read by the device itself from mapped pinned host memory, indexed by the router's top-k on the device (engine/moe/gather.py): no readback, no index, no host decision, so mode graph captures it | m x expert bytes, m the distinct routed experts (a call of one token: its k; longer calls: the union, deduplicated on the device and counted there, 4 B a layer read after the call) |
| `phase-switched` | dense-stream in prefill calls, packet (any gather) in decode calls | as those |
| `expert-cache {capacity: c, rule, forecast}` | hits read in place from c slots a layer; misses as packet's device gather, into a slot when admitted (engine/moe/cache.py) | misses x expert bytes; E B routing readback; c x layers slots |
| `expert-forecast` | the next MoE layer's router on this layer's input, its experts prefetched on a side stream; the rest of the demand fetched | (prefetched + misses not prefetched) x expert bytes; 2E B readbacks |

An expert is a contiguous slice of each fused tensor, so the device gather reaches the copy
engine's pinned rate; the host gather first copies the whole packet through the CPU (a host
memcpy of m experts) to send it as one transfer with its index.

The ledger's `active_rows` and `rows_copied` count experts here (routed, moved), and the model
keeps the routed set of every call and layer (`CpuFirstMoE.routes`): the trace a cache or a
forecast would replay.
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from packbench.core import charges
from packbench.engine.ledger import Recorder
from packbench.engine.moe.host import ExpertHost
from packbench.engine.moe.host_experts import HostExperts

INDEX_DTYPE = torch.int64
INDEX_BYTES = charges.INDEX_BYTES


@runtime_checkable
class ExpertPolicy(Protocol):
    """What the MoE model needs from a policy; it never asks which one it holds."""

    name: str

    def observes(self) -> bool:
        """Whether this call's `experts` needs the routed set (read back from the device)."""

    def forecasts(self) -> bool:
        """Whether the model should apply the next layer's router to this layer's input and hand
        the forecast to `prefetch(next_layer, experts)` (engine/moe/cache.py)."""

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None: ...

    def deactivate(self) -> None: ...

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Device (gate_up, down), full fused shapes, valid for every expert in `routed`."""

    def device_bytes(self) -> int: ...

    def pinned_bytes(self) -> int: ...


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Workspace:
    """One layer's experts on the device, shared by every layer (layers run one after another on
    one stream, so a layer's copies are queued after the previous layer's expert products)."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def zeros(cls, host: ExpertHost, device: torch.device) -> "Workspace":
        i = host.first
        return cls(torch.zeros(host.gate_up[i].shape, dtype=host.dtype, device=device),
                   torch.zeros(host.down[i].shape, dtype=host.dtype, device=device))

    @property
    def nbytes(self) -> int:
        return _nbytes(self.gate_up, self.down)


class ExpertResident:
    """Every layer's experts copied to the device once, at activation."""

    name = "resident"

    def __init__(self) -> None:
        self.weights: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def observes(self) -> bool:
        return False

    def forecasts(self) -> bool:
        return False

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None:
        self.weights = [None if gu is None else (gu.to(device), dn.to(device))
                        for gu, dn in zip(host.gate_up, host.down)]

    def deactivate(self) -> None:
        self.weights = None

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        pass  # resident: nothing to fetch
        return self.weights[layer]

    def device_bytes(self) -> int:
        return sum(_nbytes(*w) for w in self.weights or () if w is not None)

    def pinned_bytes(self) -> int:
        return 0


class ExpertDenseStream:
    """Every expert of the layer, every call: the reference the others are judged against."""

    name = "dense-stream"

    def __init__(self) -> None:
        self.host: ExpertHost | None = None
        self.workspace: Workspace | None = None
        self.recorder: Recorder | None = None

    def observes(self) -> bool:
        return False

    def forecasts(self) -> bool:
        return False

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder = host, recorder
        self.workspace = Workspace.zeros(host, device)

    def deactivate(self) -> None:
        self.host = self.workspace = self.recorder = None

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        return stream_all(self.host, layer, self.workspace, self.recorder)

    def device_bytes(self) -> int:
        return 0 if self.workspace is None else self.workspace.nbytes

    def pinned_bytes(self) -> int:
        return 0


def stream_all(host: ExpertHost, layer: int, ws: Workspace, recorder: Recorder) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy every expert of `layer` into `ws`, charged as E experts."""
    gu, dn = host.gate_up[layer], host.down[layer]
    ws.gate_up.copy_(gu, non_blocking=host.pin)
    ws.down.copy_(dn, non_blocking=host.pin)
    recorder.add(layer, **charges.dense_copy(gu.shape[0], host.expert_bytes))
    return ws.gate_up, ws.down


@dataclass
class ExpertPacket:
    """Experts in transit, `[m int64 ids | m gate_up slices | m down slices]`: a host staging
    buffer (pinned on CUDA) and its device twin, each big enough for every expert of a layer.
    One packet is one host-to-device transfer."""

    staged: torch.Tensor  # (capacity,) uint8, host
    landed: torch.Tensor  # (capacity,) uint8, device

    @classmethod
    def allocate(cls, host: ExpertHost, device: torch.device) -> "ExpertPacket":
        capacity = host.experts * (INDEX_BYTES + host.expert_bytes)
        return cls(staged=torch.zeros(capacity, dtype=torch.uint8, pin_memory=host.pin),
                   landed=torch.zeros(capacity, dtype=torch.uint8, device=device))

    @staticmethod
    def _views(buf: torch.Tensor, m: int, gu_shape: tuple, dn_shape: tuple, dtype: torch.dtype):
        n_idx = m * INDEX_BYTES
        gu_n = m * gu_shape[0] * gu_shape[1] * dtype.itemsize
        dn_n = m * dn_shape[0] * dn_shape[1] * dtype.itemsize
        return (buf[:n_idx].view(INDEX_DTYPE),
                buf[n_idx:n_idx + gu_n].view(dtype).view(m, *gu_shape),
                buf[n_idx + gu_n:n_idx + gu_n + dn_n].view(dtype).view(m, *dn_shape),
                n_idx + gu_n + dn_n)

    def send(self, host: ExpertHost, layer: int, ids: list[int], ws: Workspace, recorder: Recorder) -> None:
        """Gather experts `ids` of `layer` on the host, upload them in one copy, place them in `ws`."""
        gu, dn = host.gate_up[layer], host.down[layer]
        m = len(ids)
        index = torch.tensor(ids, dtype=INDEX_DTYPE)
        h_idx, h_gu, h_dn, size = self._views(self.staged, m, gu.shape[1:], dn.shape[1:], gu.dtype)
        h_idx.copy_(index)
        torch.index_select(gu, 0, index, out=h_gu)
        torch.index_select(dn, 0, index, out=h_dn)
        self.landed[:size].copy_(self.staged[:size], non_blocking=host.pin)
        d_idx, d_gu, d_dn, _ = self._views(self.landed, m, gu.shape[1:], dn.shape[1:], gu.dtype)
        ws.gate_up.index_copy_(0, d_idx, d_gu)
        ws.down.index_copy_(0, d_idx, d_dn)
        # The staging buffer is reused by the next layer: that layer's routing readback, queued
        # on the same stream after this upload, returns only once the upload is done.
        recorder.add(layer, **charges.unit_packet(m, host.expert_bytes))

    @property
    def nbytes(self) -> int:
        return self.landed.numel()


def send_direct(host: ExpertHost, layer: int, ids: list[int], ws: Workspace, recorder: Recorder) -> None:
    """Copy experts `ids` of `layer` straight from their host slices into their workspace slots."""
    gu, dn = host.gate_up[layer], host.down[layer]
    for e in ids:
        ws.gate_up[e].copy_(gu[e], non_blocking=host.pin)
        ws.down[e].copy_(dn[e], non_blocking=host.pin)
    recorder.add(layer, **charges.unit_packet(len(ids), host.expert_bytes, index=0))


class ExpertPacketPolicy:
    """The union of the call's routed experts, exact: one staged transfer with its index (`gather`
    host) or each expert's contiguous slices copied straight into place (`gather` device)."""

    name = "packet"

    def __init__(self, gather: str = "host") -> None:
        if gather not in ("host", "device"):
            raise ValueError(f"gather must be one of host, device, got {gather!r}")
        self.gather = gather
        self.host: ExpertHost | None = None
        self.workspace: Workspace | None = None
        self.packet: ExpertPacket | None = None
        self.recorder: Recorder | None = None

    def observes(self) -> bool:
        return True

    def forecasts(self) -> bool:
        return False

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder = host, recorder
        self.workspace = Workspace.zeros(host, device)
        self.packet = ExpertPacket.allocate(host, device) if self.gather == "host" else None

    def deactivate(self) -> None:
        self.host = self.workspace = self.packet = self.recorder = None

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.packet is not None:
            self.packet.send(self.host, layer, routed, self.workspace, self.recorder)
        else:
            send_direct(self.host, layer, routed, self.workspace, self.recorder)
        return self.workspace.gate_up, self.workspace.down

    def device_bytes(self) -> int:
        if self.workspace is None:
            return 0
        return self.workspace.nbytes + (0 if self.packet is None else self.packet.nbytes)

    def pinned_bytes(self) -> int:
        return 0 if self.packet is None or not self.host.pin else self.packet.staged.numel()


class ExpertMappedPacket:
    """The union of the call's routed experts, gathered by the device from mapped host memory with
    no host decision (`packet {gather: mapped}`). The model hands it the router's top-k tensors
    (`on_device`) instead of a routed set read back.

    A call of one token (a batch-1 decode) computes its k experts with `single_token_experts`
    from k slots the gather fills in ascending id order: no synchronisation anywhere, so mode graph
    captures the layer (engine/moe/model.py). A longer call gathers its union into the workspace
    (slot = expert id; a device-side hit mask dedupes, the device counts it) and runs the stock
    expert loop over it, whose own `nonzero` synchronises as it does for every policy."""

    name = "packet"
    on_device = True

    def __init__(self, gather: str = "mapped") -> None:
        if gather != "mapped":
            raise ValueError(f"ExpertMappedPacket gathers mapped, got {gather!r}")
        self.gather = gather
        self.host: ExpertHost | None = None
        self.recorder: Recorder | None = None
        self.workspace: Workspace | None = None
        self.slots: Workspace | None = None
        self.source: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.counts: torch.Tensor | None = None
        self.counted_call = -1

    def observes(self) -> bool:
        return False

    def forecasts(self) -> bool:
        return False  # the routing never leaves the device: nothing to forecast from on the host

    def takes_single_token(self) -> bool:
        """Whether a one-token call takes the sync-free path (phase-switched: not in prefill)."""
        return True

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder, self.device = host, recorder, device
        self.workspace = Workspace.zeros(host, device)
        if device.type == "cuda":
            from packbench.engine.mapped import cuda_view

            view = cuda_view
        else:
            view = lambda t: t  # noqa: E731 - the CPU twin reads host memory directly
        self.source = [None if gu is None else (view(gu), view(dn)) for gu, dn in zip(host.gate_up, host.down)]
        self.counts = torch.zeros(host.layers, dtype=torch.int32, device=device)
        self.arange = torch.arange(host.experts, dtype=INDEX_DTYPE, device=device)
        self.zero_index = torch.zeros(1, dtype=INDEX_DTYPE, device=device)
        self.slots = None  # k slots, made at the first one-token call (k is the router's)

    def deactivate(self) -> None:
        self.host = self.recorder = self.workspace = self.slots = self.counts = None
        self.source = []

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("packet {gather: mapped} is handed the router's top-k (forward), never a routed set")

    def ensure_slots(self, k: int) -> Workspace:
        """The k slots of a one-token call: the workspace's first k experts, not memory of their own.
        A one-token call reads only its slots and a longer call re-gathers every expert it routes
        into the workspace, so the two never need each other's contents; and every layer's gather
        is queued on one stream after the previous layer's products. Slots of their own would cost
        k experts more on the device (672 MiB at Mixtral-8x7B's shape: enough to run the mapped
        packet out of memory under 4608 MiB where the device-gather packet fits)."""
        if self.slots is None or self.slots.gate_up.shape[0] != k:
            ws = self.workspace
            self.slots = Workspace(ws.gate_up[:k], ws.down[:k])
        return self.slots

    def single_token(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, act_fn) -> torch.Tensor:
        """A one-token call's expert output, every step on the device (capturable); not charged
        here (`charge_single_token`: what a replay of it moves is known on the host)."""
        from packbench.engine.moe.gather import gather_experts, single_token_experts, sorted_routes

        ids, weights = sorted_routes(top_k_index, top_k_weights)
        slots = self.ensure_slots(ids.shape[0])
        gu, dn = self.source[layer]
        gather_experts(ids, gu, slots.gate_up)
        gather_experts(ids, dn, slots.down)
        return single_token_experts(hidden, weights, slots.gate_up, slots.down, act_fn, self.zero_index)

    def charge_single_token(self, layer: int, k: int) -> None:
        # The token's k experts are distinct (top-k): k experts move, no index, nothing read back.
        self.recorder.add(layer, active=k, rows=k, weight_bytes=k * self.host.expert_bytes)

    def union(self, layer: int, top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A longer call: its distinct routed experts gathered into their workspace slots, counted
        on the device (read once after the call)."""
        from packbench.engine.moe.gather import gather_experts

        if self.counted_call != self.recorder.serial:  # the call's first layer
            self.counted_call = self.recorder.serial
            self.counts.zero_()
            self.recorder.defer(self.settle)
        hit = torch.zeros(self.host.experts, dtype=torch.int32, device=self.device)
        hit.index_fill_(0, top_k_index.reshape(-1), 1)
        sel = torch.where(hit > 0, self.arange, -1)
        gu, dn = self.source[layer]
        gather_experts(sel, gu, self.workspace.gate_up)
        gather_experts(sel, dn, self.workspace.down)
        self.counts[layer] = hit.sum()
        return self.workspace.gate_up, self.workspace.down

    def settle(self, call) -> None:
        """The call has ended: each layer's count of gathered experts (4 B a layer, charged as D2H)."""
        for layer, m in enumerate(self.counts.tolist()):
            if self.source[layer] is not None and m:
                self.recorder.add(layer, active=m, rows=m, weight_bytes=m * self.host.expert_bytes,
                                  d2h_bytes=self.counts.element_size())

    def device_bytes(self) -> int:
        if self.workspace is None:
            return 0
        return self.workspace.nbytes + _nbytes(self.counts)  # the slots are the workspace's (ensure_slots)

    def pinned_bytes(self) -> int:
        return 0  # the experts' own pinned memory, charged by the model (host.pinned_bytes)


class ExpertMappedPhaseSwitched(ExpertMappedPacket):
    """Dense-stream in prefill calls, the mapped gather in decode calls (`phase-switched {gather: mapped}`)."""

    name = "phase-switched"

    def takes_single_token(self) -> bool:
        return self.recorder.phase != "prefill"

    def union(self, layer: int, top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recorder.phase == "prefill":
            return stream_all(self.host, layer, self.workspace, self.recorder)
        return super().union(layer, top_k_index)


class ExpertPhaseSwitched(ExpertPacketPolicy):
    """Dense-stream in prefill calls (a prompt's union is most of the experts), packets in decode."""

    name = "phase-switched"

    def observes(self) -> bool:
        return self.recorder is None or self.recorder.phase != "prefill"

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recorder.phase == "prefill":
            return stream_all(self.host, layer, self.workspace, self.recorder)
        return super().experts(layer, routed)


# Every MoE policy over CpuFirstMoE's host experts that a protocol names by an OPT loader's name or
# host-experts' (the kinds in core/conditions/ of the same names; core/moe.py MOE_POLICIES lists
# them torch-free for the schema, with accelerate, which runs a model of its own). host-experts
# moves no weight: it computes the experts on the host (engine/moe/host_experts.py). The kinds for
# MoE models alone (`expert-cache`, `expert-forecast`) are built by their own runtimes
# (engine/conditions/expert_cache.py), from engine/moe/cache.py.
EXPERT_POLICIES: dict[str, type] = {
    "resident": ExpertResident,
    "dense-stream": ExpertDenseStream,
    "packet": ExpertPacketPolicy,
    "phase-switched": ExpertPhaseSwitched,
    "host-experts": HostExperts,
}
# The mapped gathers, by policy name: what `gather: mapped` makes of packet and phase-switched.
MAPPED_POLICIES: dict[str, type] = {"packet": ExpertMappedPacket, "phase-switched": ExpertMappedPhaseSwitched}
