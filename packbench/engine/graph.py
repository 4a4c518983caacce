"""Execution modes of a forward call, and the CUDA-graph decode step of mode "graph".

MODES:
- "eager": stock transformers' OPT forward with a DynamicCache (packbench's first path; every
  protocol written before modes existed means this).
- "graph": packbench's own decoder (`engine/static_opt.py`) on a static KV cache. Prefill runs
  eagerly; on CUDA, for a policy whose decode step makes no host decision (a kind's `graph_safe`, engine/conditions/: resident, dense-stream
  (int8 too), packet (int8 too), early-forecast and phase-switched with `gather: device`), the step is captured once per episode, in pieces around
  attention (one graph per layer boundary). The first time a decoder meets a policy class, the
  episode's first decode call runs eagerly on the side stream before the capture (the warm-up:
  Triton specialises and compiles, the side stream gets its cuBLAS workspace); later episodes
  capture at their first decode call and replay it at once. Every captured decode call copies
  its token id and position into the static inputs and replays the pieces, running each
  layer's attention over the live keys between them (vLLM's piecewise graphs): stock's shapes,
  so stock's bits. Inside the pieces a layer's k and v run on a branch stream beside q (the same
  kernels, so the same bits). Policies with host decisions (a mask readback,
  an LRU plan, a forecast) run the same decoder eagerly: the same math, so exactness against
  dense-stream within the mode still holds. On the CPU nothing is captured (the CPU twin).

dense-stream copies on a stream of its own (engine/policies/dense.py), and so does early-forecast's device
gather for its forecasts. Inside a capture each copy is
forked from the capturing stream and rejoined before its piece ends (`rejoin`): the copy of
layer l+1, issued at layer l's fc1, overlaps the rest of that piece (fc1, fc2, layer l+1's
q/k/v) but not the attention run between pieces, which waits for it.

A replay runs no policy code, so the ledger cannot be written by the policy as it goes. The
host side of a graph-safe policy's call is the same every call (sizes it knows; the device
gather's counts are read after the call by a deferred settle), so the capture runs inside a
scratch call of the recorder and its ledger and deferred settles are the TAPE each replay adds
to its own call. Nothing inside the step reads the host: counts come back once per call, after
the logits, as in eager mode.
"""

import contextlib
import functools
import time

import torch

from packbench.core.protocol.schema import ENGINE_MODES
from packbench.engine.ledger import CallLedger, Recorder
from packbench.engine.static_opt import StaticKV, StaticOPT

MODES = ENGINE_MODES  # one list: what a protocol's engine.mode may say is what the engine runs



@contextlib.contextmanager
def ending_capture(graph: "torch.cuda.CUDAGraph"):
    """A capture that raises (an out-of-memory under the allowance, say) is ended before the error
    goes on: left open, its stream stays capturing and every later CUDA call of the worker fails
    ("operation not permitted when stream is capturing"), as 19 episodes after one OOM did on the H200."""
    try:
        yield
    except BaseException:
        try:
            graph.capture_end()
        except Exception:  # noqa: BLE001 - the capture is invalid anyway; the first error is the one to report
            pass
        raise


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown engine mode {mode!r}; use one of {', '.join(MODES)}")
    return mode


def rejoin(policy, stream) -> None:
    """Before a capture ends, every stream forked from the capturing one must have rejoined it
    (else capture_end fails). A policy that copies on a stream of its own inside the step
    (dense-stream) has `join(stream)`; the others fork nothing."""
    join = getattr(policy, "join", None)
    if join is not None:
        join(stream)


def graph_refusal(policy, device: torch.device) -> str | None:
    """Why this policy's decode step is not captured on `device` (None: it is captured)."""
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    from packbench.engine.conditions import RUNTIMES  # the kinds' table imports every policy module

    # A kind says whether its policy's decode step may be captured (LoaderRuntime.graph_safe): no
    # host reads, no host decisions, every buffer fixed for the episode. Anything else stays eager.
    safe = getattr(RUNTIMES.get(policy.name), "graph_safe", None)
    if safe is None or not safe(policy):
        return f"{policy.name} decides on the host"
    return None


@functools.cache
def capture_streams(device_index: int) -> tuple["torch.cuda.Stream", "torch.cuda.Stream"]:
    """The side stream every warm-up and capture runs on, and the branch stream k and v run on
    inside the captured pieces (StaticOPT.pre): one pair per device for the process's life.

    PyTorch keeps a cuBLAS workspace per stream for the process's life, so fresh streams leak:
    one per episode cost ~32 MiB each (the first H200 run: 198 MiB more allocator peak, then OOM
    under the allowance), and one per model would grow a long-lived worker's memory with every
    cold load. The branch gets its workspace here, from a tiny matmul: made inside a capture it
    would come from that graph's pool. The side stream's comes with the first eager warm-up.
    """
    device = torch.device("cuda", device_index)
    side, branch = torch.cuda.Stream(device), torch.cuda.Stream(device)
    branch.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(branch):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):  # with a bias, as q/k/v have
            one = torch.ones((1, 8), dtype=dtype, device=device)
            torch.nn.functional.linear(one, one, one[0, :1])
    torch.cuda.synchronize(device)
    return side, branch


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
    """The decode step of one episode captured on its StaticKV (held by the cache, dies with it).

    `graphs[0]` embeds and runs layer 0 up to attention; `graphs[i]` finishes layer i-1 and
    runs layer i up to attention; the last finishes the last layer and computes the logits.
    Between two graphs the host runs the layer's attention over the live keys into `attn`.
    With attention="static" there is one graph for the whole step.
    """

    def __init__(self, graphs: list, ids: torch.Tensor, pos: torch.Tensor, queries: list, attn: torch.Tensor | None,
                 logits: torch.Tensor, tape: _Tape, capture_s: float, end_s: float, warmed: bool) -> None:
        self.graphs, self.ids, self.pos, self.queries, self.attn = graphs, ids, pos, queries, attn
        self.views: list[tuple] = []  # per layer, StaticOPT.attention_views (set by the capture)
        self.logits, self.tape, self.capture_s = logits, tape, capture_s
        self.end_s = end_s  # of capture_s, in capture_end: ending the captures and instantiating the graphs
        self.warmed = warmed  # this episode's first decode call ran eagerly before the capture

    def describe(self) -> str:
        """What the archive records as the episode's `decode_graph`."""
        return (f"captured ({self.capture_s * 1e3:.1f} ms, {self.end_s * 1e3:.1f} of them instantiating"
                f"{', after an eager warm-up call' if self.warmed else ''})")


class GraphDecoder:
    """Mode "graph" of a CpuFirstModel: `new_cache(capacity)`, `forward(ids, kv)`.

    attention="live" (the mode's meaning): each decode call replays the captured pieces and
    runs attention between them over the live keys, stock's shapes, so logits are stock's bit
    for bit. attention="static" (measured, not a protocol mode): the whole step is one graph
    attending over the full static span; faster, but tokens may leave stock's at near ties.
    """

    ATTENTION = ("live", "static")

    def __init__(self, causal_lm, slot, recorder: Recorder, device: torch.device) -> None:
        self.decoder = StaticOPT(causal_lm, slot)
        self.slot, self.recorder, self.device = slot, recorder, device
        self.attention = "live"
        # Policy classes whose decode step has run eagerly on the side stream in this process
        # (Triton's decode specialisation compiled, cuBLAS's side-stream workspace allocated):
        # their later episodes capture without the eager warm-up call.
        self._warm: set[type] = set()
        self.parallel_kv = True  # False: a capture runs k and v after q (bench.engine's `+kv=serial`)
        self.attend_views = True  # False: replays attend as eager calls do (bench.engine's `+attend=matmul`)

    def forget_warm_ups(self) -> None:
        """The next episode of every policy class warms up eagerly again (a bench that swaps a
        kernel under a policy, e.g. the gather's tile, must not capture its first launch)."""
        self._warm.clear()

    def new_cache(self, capacity: int, batch: int = 1) -> StaticKV:
        if self.attention not in self.ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(self.ATTENTION)}, got {self.attention!r}")
        kv = self.decoder.new_cache(capacity, batch)
        kv.eager_reason = graph_refusal(self.slot.policy, self.device)
        kv.attention = self.attention
        return kv

    def forward(self, ids: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """One call: (B, T) ids -> last logits ((vocab,) at batch 1, else (B, vocab)). The first
        call of a cache is the prefill."""
        if kv.length == 0:
            return self.decoder.prefill(ids, kv)
        if ids.shape != (kv.batch, 1):
            raise ValueError(f"a decode call takes one token per sequence ({kv.batch}), got ids of shape "
                             f"{tuple(ids.shape)}")
        if kv.length >= kv.capacity:
            raise ValueError(f"the static cache holds {kv.capacity} positions; the episode asked for more")
        position = kv.length
        kv.length += 1
        span = kv.capacity if kv.attention == "static" else position + 1
        step = kv.graph
        if step is None and kv.eager_reason is None and type(self.slot.policy) in self._warm:
            step = kv.graph = self._capture(None, None, kv)
        if step is not None:
            step.ids.copy_(ids)
            step.pos.fill_(position)  # a kernel argument: no host-device sync
            graphs = step.graphs
            graphs[0].replay()
            step.tape.play(self.recorder)  # host bookkeeping while the GPU runs the first piece
            for i in range(1, len(graphs)):  # layer i-1's attention over the live keys, then piece i
                if step.views:
                    StaticOPT.attend_views(step.views[i - 1], span)
                else:  # bench.engine's `+attend=matmul`: eager calls' attend, then a copy into the buffer
                    self.decoder.attend(step.queries[i - 1], kv.layers[i - 1], span, None, out=step.attn)
                graphs[i].replay()
            return step.logits
        pos = torch.full((1,), position, dtype=torch.long, device=ids.device)
        if kv.eager_reason is not None:
            return self.decoder.decode(ids, pos, kv, span=span)
        return self._warm_and_capture(ids, pos, kv, span)

    def _warm_and_capture(self, ids: torch.Tensor, pos: torch.Tensor, kv: StaticKV, span: int) -> torch.Tensor:
        """Run this decode call eagerly on the side stream (its logits are the call's answer),
        then capture the step's pieces on static inputs for the calls after it."""
        side, main = self.streams()[0], torch.cuda.current_stream(self.device)
        static_ids, static_pos = ids.clone(), pos.clone()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            logits = self.decoder.decode(static_ids, static_pos, kv, span=span).clone()
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)
        self._warm.add(type(self.slot.policy))
        kv.graph = self._capture(static_ids, static_pos, kv)
        return logits

    def streams(self) -> tuple["torch.cuda.Stream", "torch.cuda.Stream"]:
        """(side, branch): the process's capture streams for this device (`capture_streams`)."""
        return capture_streams(self.device.index or 0)

    def _capture(self, static_ids: torch.Tensor | None, static_pos: torch.Tensor | None, kv: StaticKV) -> GraphStep:
        """Capture the decode step's pieces on static inputs: the warm-up call's, or fresh ones
        (None) that the first replay fills. Nothing runs here: capture records."""
        warmed = static_ids is not None  # the episode's first decode call ran eagerly already
        (side, branch), main = self.streams(), torch.cuda.current_stream(self.device)
        if static_ids is None:
            static_ids = torch.zeros((kv.batch, 1), dtype=torch.long, device=self.device)
            static_pos = torch.zeros((1,), dtype=torch.long, device=self.device)
            side.wait_stream(main)  # the prefill's writes and the zeros above come first
        t0, end_s = time.perf_counter(), 0.0
        recorder = self.recorder
        saved = (recorder.current, recorder.phase, recorder._deferred)
        recorder.begin(phase="decode", tokens=1)  # scratch call: what the policy's host side adds
        d = self.decoder
        d.branch = branch if self.parallel_kv else None
        try:
            # Capture records, it does not run: the KV slot written here is rewritten by each
            # replay at the position it is given. torch.cuda.graph() would gc.collect() and
            # empty the cache for each piece; capture_begin on one stream and one pool does not.
            attn = torch.zeros((kv.batch, 1, d.hidden), dtype=d.dtype, device=self.device)
            with torch.cuda.stream(side):
                if kv.attention == "static":
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin()
                    with ending_capture(graph):
                        static_logits = d.decode(static_ids, static_pos, kv, span=kv.capacity)
                        rejoin(self.slot.policy, side)
                    t = time.perf_counter()
                    graph.capture_end()
                    end_s += time.perf_counter() - t
                    graphs, queries, attn = [graph], [], None
                else:
                    graphs, queries, pool = [], [], None
                    h = None
                    for i in range(len(d.layers) + 1):
                        graph = torch.cuda.CUDAGraph()
                        graph.capture_begin(pool=pool)
                        with ending_capture(graph):
                            h = d.embed(static_ids, static_pos) if i == 0 else d.post(i - 1, h, attn)
                            if i < len(d.layers):
                                queries.append(d.pre(i, h, static_pos, kv))
                            else:
                                static_logits = d.head(h)
                            rejoin(self.slot.policy, side)  # dense-stream's copy of the next layer ends here
                        t = time.perf_counter()
                        graph.capture_end()
                        end_s += time.perf_counter() - t
                        pool = graph.pool() if pool is None else pool
                        graphs.append(graph)
            main.wait_stream(side)
            tape = _Tape(recorder.current, list(recorder._deferred))
        finally:
            recorder.current, recorder.phase, recorder._deferred = saved
            d.branch = None
        step = GraphStep(graphs, static_ids, static_pos, queries, attn, static_logits, tape,
                         time.perf_counter() - t0, end_s, warmed)
        # Batch 1 attends on 3D views (the same kernels, half the host ops); a batch, or a bench's
        # `+attend=matmul`, attends as eager calls do: eager decode's own ops, so its bits.
        if attn is not None and self.attend_views and kv.batch == 1:
            step.views = [d.attention_views(q, kv.layers[i], attn) for i, q in enumerate(queries)]
        return step
