"""Execution modes of a forward call, and the CUDA-graph decode step of mode "graph".

MODES:
- "eager": stock transformers' OPT forward with a DynamicCache (packbench's first path; every
  protocol written before modes existed means this).
- "graph": packbench's own decoder (`engine/static_opt.py`) on a static KV cache. Prefill runs
  eagerly; on CUDA, for a policy whose decode step makes no host decision (`GRAPH_SAFE`), the
  first decode call runs eagerly on the static buffers (the warm-up: Triton specialises, cuBLAS
  picks its kernels) and is then captured once; every later decode call copies its token id and
  position into the static inputs and replays. Policies with host decisions (a mask readback,
  an LRU plan, a forecast) run the same decoder eagerly: the same math, so exactness against
  dense-stream within the mode still holds. On the CPU nothing is captured (the CPU twin).

A replay runs no policy code, so the ledger cannot be written by the policy as it goes. The
host side of a graph-safe policy's call is the same every call (sizes it knows; the device
gather's counts are read after the call by a deferred settle), so the capture runs inside a
scratch call of the recorder and its ledger and deferred settles are the TAPE each replay adds
to its own call. Nothing inside the step reads the host: counts come back once per call, after
the logits, as in eager mode.
"""

import time
from collections.abc import Callable

import torch

from engine.ledger import CallLedger, Recorder
from engine.static_opt import StaticKV, StaticOPT

MODES = ("eager", "graph")

# Which policies' decode steps may be captured: no host reads, no host decisions, every
# buffer fixed for the episode. Keyed by policy name; a missing name stays eager.
GRAPH_SAFE: dict[str, Callable[[object], bool]] = {
    "resident": lambda p: True,
    "dense-stream": lambda p: p.host.pin,  # the copy from pinned memory is a graph memcpy node
    "packet": lambda p: p.gather == "device",
    "phase-switched": lambda p: p.gather == "device",  # its decode calls are packet's
}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown engine mode {mode!r}; use one of {', '.join(MODES)}")
    return mode


def graph_refusal(policy, device: torch.device) -> str | None:
    """Why this policy's decode step is not captured on `device` (None: it is captured)."""
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    safe = GRAPH_SAFE.get(policy.name)
    if safe is None or not safe(policy):
        return f"{policy.name} decides on the host"
    return None


class _Tape:
    """What a graph-safe policy's host side adds to one call's ledger (captured once)."""

    def __init__(self, call: CallLedger, settles: list) -> None:
        self.call, self.settles = call, settles

    def play(self, recorder: Recorder) -> None:
        c = self.call
        for layer in range(c.layers):
            recorder.add(layer, active=c.active_rows[layer], rows=c.rows_copied[layer],
                         weight_bytes=c.h2d_weight_bytes[layer], index_bytes=c.h2d_index_bytes[layer],
                         d2h_bytes=c.d2h_bytes[layer], wasted=c.rows_wasted[layer])
        for settle in self.settles:
            recorder.defer(settle)


class GraphStep:
    """The decode step of one episode captured on its StaticKV (held by the cache, dies with it)."""

    def __init__(self, graph, ids: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor, tape: _Tape,
                 capture_s: float) -> None:
        self.graph, self.ids, self.pos, self.logits, self.tape = graph, ids, pos, logits, tape
        self.capture_s = capture_s


class GraphDecoder:
    """Mode "graph" of a CpuFirstModel: `new_cache(capacity)`, `forward(ids, kv)`."""

    def __init__(self, causal_lm, slot, recorder: Recorder, device: torch.device) -> None:
        self.decoder = StaticOPT(causal_lm, slot)
        self.slot, self.recorder, self.device = slot, recorder, device

    def new_cache(self, capacity: int) -> StaticKV:
        kv = self.decoder.new_cache(capacity)
        kv.eager_reason = graph_refusal(self.slot.policy, self.device)
        return kv

    def forward(self, ids: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """One call: (1, T) ids -> (vocab,) last logits. The first call of a cache is the prefill."""
        if kv.length == 0:
            return self.decoder.prefill(ids, kv)
        if ids.shape != (1, 1):
            raise ValueError(f"a decode call takes one token, got ids of shape {tuple(ids.shape)}")
        if kv.length >= kv.capacity:
            raise ValueError(f"the static cache holds {kv.capacity} positions; the episode asked for more")
        position = kv.length
        kv.length += 1
        step = kv.graph
        if step is not None:
            step.ids.copy_(ids)
            step.pos.fill_(position)  # a kernel argument: no host-device sync
            step.tape.play(self.recorder)
            step.graph.replay()
            return step.logits
        pos = torch.full((1,), position, dtype=torch.long, device=ids.device)
        if kv.eager_reason is not None:
            return self.decoder.decode(ids, pos, kv)
        return self._warm_and_capture(ids, pos, kv)

    def _warm_and_capture(self, ids: torch.Tensor, pos: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """Run this decode call eagerly on a side stream (its logits are the call's answer), then
        capture the same step on static inputs for the calls after it."""
        static_ids, static_pos = ids.clone(), pos.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            logits = self.decoder.decode(static_ids, static_pos, kv).clone()
        torch.cuda.current_stream(self.device).wait_stream(side)
        t0 = time.perf_counter()
        recorder = self.recorder
        saved = (recorder.current, recorder.phase, recorder._deferred)
        recorder.begin(phase="decode", tokens=1)  # scratch call: what the policy's host side adds
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                # Capture records, it does not run: the KV slot written here is rewritten by
                # each replay at the position it is given.
                static_logits = self.decoder.decode(static_ids, static_pos, kv)
            tape = _Tape(recorder.current, list(recorder._deferred))
        finally:
            recorder.current, recorder.phase, recorder._deferred = saved
        kv.graph = GraphStep(graph, static_ids, static_pos, static_logits, tape, time.perf_counter() - t0)
        return logits
