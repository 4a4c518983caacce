"""Expert caches and forecasts on the device (`expert-cache`, `expert-forecast`), exact.

Every decision (what is a hit, what is fetched, what stays, what a forecast prefetches and
whether it was used) is core/expert_cache.py's, so a weightless replay of the episode's routing
counts exactly what this policy counted (the auditor does it from the archive).

Per layer and call, with the routed set known (read back, as for a packet):

- **cache** (`capacity` c > 0): `LayerCache(c, rule).step(routed)`. Hits are read in place from
  their cache slot (no copy: the experts module reads each routed expert through `_ExpertView`,
  which answers its slot or its workspace slot). Misses that no forecast brought are copied from
  their pinned host slices (the packet's device gather: no index moves, the expert id is the
  copy's destination) straight into a free cache slot when the rule admits them, else into the
  workspace; a used prefetch the rule admits is copied from the workspace into its slot (device
  to device). Evicted experts free their slots (one routed in this call, a hit evicted for a miss
  that ranks higher, is first copied into the workspace). The slots, c per layer, live on the
  device and are charged to the allowance.
- **forecast**: in layer l's call, once its routing is known, the router of the next layer with
  experts, n (l+1 where every layer has experts; a Qwen3-MoE's dense layers are skipped), is
  applied to layer l's MoE input (the hidden state the model has computed; nothing later), its
  top-k union read back (E bytes), and the forecast experts the cache of n does not hold are
  copied on a side stream into the workspace n will use (the layers with experts alternate, in
  their order, between two workspaces, so the prefetch never overwrites what layer l reads).
  Layer n waits for that copy (a CUDA event) before it uses it, takes what the forecast
  brought, and fetches the rest. Prefetched
  experts the call did not route are `wasted` (the ledger's `rows_wasted`); they are never
  admitted to the cache. On the CPU the side stream degrades to synchronous copies.

Ledger per call and layer: `active_rows` the routed experts, `rows_copied` the experts moved
host-to-device (misses not prefetched + prefetched), `h2d_weight_bytes` those x expert bytes,
`rows_wasted` the wasted prefetches, `d2h_bytes` E per readback (routing, forecast). The
per-call, per-layer hits, misses and forecasts go to the episode record's `experts` section
(`figures()`), with Belady's hits for the same capacity on the same routing.
"""

from __future__ import annotations

import torch

from packbench.core import charges
from packbench.core.expert_cache import LayerCache, forecast_step
from packbench.engine.ledger import Recorder
from packbench.engine.moe.host import ExpertHost
from packbench.engine.moe.policies import Workspace


class _Slots:
    """One layer's cache slots on the device: `capacity` experts in the fused layout, and which
    expert each slot holds."""

    def __init__(self, host: ExpertHost, capacity: int, device: torch.device) -> None:
        i = host.first
        self.gate_up = torch.zeros((capacity, *host.gate_up[i].shape[1:]), dtype=host.dtype, device=device)
        self.down = torch.zeros((capacity, *host.down[i].shape[1:]), dtype=host.dtype, device=device)
        self.slot_of: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))  # pop() takes the lowest slot first

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


class _ExpertView:
    """What the experts module reads as `gate_up_proj` or `down_proj` in one call: indexed by the
    global expert id (stock transformers' eager loop reads `self.gate_up_proj[expert_idx]` for
    each routed expert and nothing else), it answers the expert's cache slot or workspace slot.
    Either holds the expert's exact bits in the same contiguous layout, so each product is the
    one dense-stream computes."""

    def __init__(self, at: dict[int, tuple[torch.Tensor, torch.Tensor]], fallback: torch.Tensor, part: int) -> None:
        self.at, self.fallback, self.part = at, fallback, part

    def __getitem__(self, index) -> torch.Tensor:
        e = int(index)
        found = self.at.get(e)
        return self.fallback[e] if found is None else found[self.part]


class ExpertCache:
    """`expert-cache` (capacity c >= 1, rule lru|lfu, forecast off|on) and `expert-forecast`
    (capacity 0, forecast on): module docstring."""

    def __init__(self, *, capacity: int = 0, rule: str = "lru", forecast: str = "off") -> None:
        if forecast not in ("off", "on"):
            raise ValueError(f"forecast must be one of off, on, got {forecast!r}")
        LayerCache(capacity, rule)  # the same checks as the decisions make
        self.capacity, self.rule, self.forecast = capacity, rule, forecast == "on"
        self.name = "expert-forecast" if capacity == 0 and self.forecast else "expert-cache"
        self.host: ExpertHost | None = None
        self.recorder: Recorder | None = None
        self.device: torch.device | None = None
        self.caches: list[LayerCache | None] = []
        self.slots: list[_Slots | None] = []
        self.workspaces: list[Workspace] = []
        self.workspace_of: list[int] = []  # per layer, the index of the workspace it reads
        self.side: torch.cuda.Stream | None = None
        self.pending: dict[int, tuple[tuple[int, ...], frozenset[int], torch.cuda.Event | None]] = {}
        self.counts: list[list[dict | None]] = []  # per call, per layer: what this policy counted
        self.d2d_bytes = 0

    def observes(self) -> bool:
        return True

    def forecasts(self) -> bool:
        return self.forecast

    def activate(self, host: ExpertHost, device: torch.device, recorder: Recorder) -> None:
        self.host, self.device, self.recorder = host, device, recorder
        moe = [host.has_experts(layer) for layer in range(host.layers)]
        self.caches = [LayerCache(self.capacity, self.rule) if m else None for m in moe]
        self.slots = [_Slots(host, self.capacity, device) if m and self.capacity else None for m in moe]
        # Two workspaces when forecasting: the next MoE layer's prefetch lands in the one layer l
        # does not read. They alternate over the layers with experts in order (not over all the
        # layers: MoE layers 1 and 3 of a model with dense layers 0 and 2 would share one).
        self.workspaces = [Workspace.zeros(host, device) for _ in range(2 if self.forecast else 1)]
        ordinal = [sum(moe[:layer]) for layer in range(host.layers)]
        self.workspace_of = [ordinal[layer] % len(self.workspaces) for layer in range(host.layers)]
        self.side = torch.cuda.Stream(device) if device.type == "cuda" and self.forecast else None
        self.pending, self.counts, self.d2d_bytes = {}, [], 0

    def deactivate(self) -> None:
        self.host = self.recorder = self.side = None
        self.caches, self.slots, self.workspaces, self.pending = [], [], [], {}

    def _workspace(self, layer: int) -> Workspace:
        return self.workspaces[self.workspace_of[layer]]

    def _count(self, layer: int) -> dict:
        call = self.recorder.current
        index = call.index if call is not None else 0
        while len(self.counts) <= index:
            self.counts.append([None] * self.host.layers)
        if self.counts[index][layer] is None:
            self.counts[index][layer] = {}
        return self.counts[index][layer]

    def prefetch(self, layer: int, forecast: list[int]) -> None:
        """Copy the forecast experts of `layer` that its cache does not hold into its workspace,
        on the side stream (CUDA), before `layer`'s routing is known."""
        cached = self.caches[layer].cached
        ids = tuple(e for e in sorted(set(forecast)) if e not in cached)
        ws, gu, dn = self._workspace(layer), self.host.gate_up[layer], self.host.down[layer]
        event = None
        if self.side is not None:
            # The workspace was last read by the expert loop of the MoE layer before the one
            # forecasting, queued on the main stream.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                for e in ids:
                    ws.gate_up[e].copy_(gu[e], non_blocking=self.host.pin)
                    ws.down[e].copy_(dn[e], non_blocking=self.host.pin)
                event = torch.cuda.Event()
                event.record(self.side)
        else:
            for e in ids:
                ws.gate_up[e].copy_(gu[e])
                ws.down[e].copy_(dn[e])
        self.pending[layer] = (tuple(sorted(set(forecast))), cached, event)
        self.recorder.add(layer, **charges.expert_prefetch(len(ids), self.host.expert_bytes, self.host.experts))

    def experts(self, layer: int, routed: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        ws, gu, dn = self._workspace(layer), self.host.gate_up[layer], self.host.down[layer]
        cache, slots = self.caches[layer], self.slots[layer]
        brought: set[int] = set()
        wasted = 0
        count = self._count(layer)
        if layer in self.pending:
            forecast, cached, event = self.pending.pop(layer)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            f = forecast_step(forecast, cached, routed)
            brought = set(f.used)
            count.update(forecast=list(forecast), prefetched=len(f.prefetched), used=len(f.used), wasted=len(f.wasted))
            wasted = len(f.wasted)
        step = cache.step(routed)
        count.update(hits=len(step.hits), misses=len(step.misses))
        # Where each routed expert is read from in this call: its cache slot, or the workspace.
        at: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        d2d = 0
        if slots is not None:
            for e in step.evicted:
                s = slots.slot_of.pop(e)
                slots.free.append(s)
                if e in step.hits:  # routed, yet evicted for a miss that ranks higher: read from the
                    # workspace, copied before an admission reuses the slot (queued in that order)
                    ws.gate_up[e].copy_(slots.gate_up[s])
                    ws.down[e].copy_(slots.down[s])
                    at[e] = (ws.gate_up[e], ws.down[e])
                    d2d += 1
            for e in step.hits:
                if e in slots.slot_of:
                    s = slots.slot_of[e]
                    at[e] = (slots.gate_up[s], slots.down[s])
            for e in sorted(cache.cached - slots.slot_of.keys()):  # admitted: misses of this call
                s = slots.free.pop()
                slots.slot_of[e] = s
                src_gu, src_dn = (ws.gate_up[e], ws.down[e]) if e in brought else (gu[e], dn[e])
                slots.gate_up[s].copy_(src_gu, non_blocking=self.host.pin)
                slots.down[s].copy_(src_dn, non_blocking=self.host.pin)
                at[e] = (slots.gate_up[s], slots.down[s])
                d2d += e in brought  # a used prefetch moves from the workspace into its slot
        fetched = 0
        for e in step.misses:
            if e in brought:
                at.setdefault(e, (ws.gate_up[e], ws.down[e]))
                continue
            fetched += 1
            if e not in at:  # not admitted: the device gather into the workspace slot
                ws.gate_up[e].copy_(gu[e], non_blocking=self.host.pin)
                ws.down[e].copy_(dn[e], non_blocking=self.host.pin)
                at[e] = (ws.gate_up[e], ws.down[e])
        self.recorder.add(layer, **charges.expert_fetch(fetched, self.host.expert_bytes, wasted=wasted))
        self.d2d_bytes += d2d * self.host.expert_bytes
        return _ExpertView(at, ws.gate_up, 0), _ExpertView(at, ws.down, 1)

    def device_bytes(self) -> int:
        return (sum(w.nbytes for w in self.workspaces)
                + sum(s.nbytes for s in self.slots if s is not None))

    def pinned_bytes(self) -> int:
        return 0

    def figures(self) -> dict:
        """What the record's `experts` section takes from the policy: its parameters and, per call
        and layer, what it counted (None for a layer without experts)."""
        return {"capacity": self.capacity, "rule": self.rule, "forecast": "on" if self.forecast else "off",
                "counted": [[None if c is None else dict(c) for c in call] for call in self.counts],
                "d2d_bytes": self.d2d_bytes}


def expert_cache(*, capacity: int, rule: str = "lru", forecast: str = "off") -> ExpertCache:
    """A fresh `expert-cache` policy (core/conditions/expert_cache.py declares its parameters)."""
    return ExpertCache(capacity=capacity, rule=rule, forecast=forecast)


def expert_forecast() -> ExpertCache:
    """A fresh `expert-forecast` policy: no cache, the next MoE layer's experts prefetched."""
    return ExpertCache(capacity=0, forecast="on")


# The expert-only kinds, by the name a protocol gives them.
CACHE_KINDS = {"expert-cache": expert_cache, "expert-forecast": expert_forecast}
