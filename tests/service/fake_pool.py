"""An in-process worker pool for the dispatcher's tests: no Ray, no engine, no processes.

Each worker runs its calls one after another in the order they were sent, each taking a set
time of the real clock (`load_s`, `episode_s`): a reply is ready once its worker has spent that
long on it after its earlier calls. Records have the shape of real episode records: `ok`, with
tokens and logits that are the same for every condition of a prompt (no ledger, no memory
figures: a gate that reads them fails on them). `fault(worker, entry)` decides per episode:
None (it runs, ok), `EpisodeFails(error)` (it fails as the real worker's episodes fail: a record
with status `failed`, its cause and a traceback, no logits), `Slow(seconds)` (it runs ok, taking that
long), "hang" (it never ends: the worker replies to nothing more), "die" (the worker dies: this call
and every later one of that worker reply as died), or an exception (the call raises, the worker lives).
`load_fault(worker)` decides per load: None, or "hang" (the load never ends).

`FakePool(cuda=True)` answers as a CUDA worker does (engine/worker.py on "cuda:0"): its environment
and start record name the device and the GPU, the start imposes the protocol's allowance beside a
measured context, and each finished episode carries what only NVML and the CUDA allocator give: the
allocator's and the sampled peaks, the sampler's summary and memory trace, an energy reading,
pinned and context bytes, per-layer copy waits, and the other workers on the host.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from packbench.core.pool import NodeInfo, Reply
from packbench.core.metrics import episode_totals, opt_bytes
from packbench.core.registry import SHAPES


@dataclass(frozen=True)
class EpisodeFails:
    """A fault: the episode runs and fails with `error` (engine/worker.py Worker._failed's record)."""

    error: str


@dataclass(frozen=True)
class Slow:
    """A fault: the episode runs ok and takes `seconds` of the real clock."""

    seconds: float


@dataclass(eq=False)
class FakeWorker:
    index: int
    node: str
    free_at: float = 0.0  # when the calls sent so far are done
    dead_at: float | None = None  # dies then (every call ready after it replies as died)
    killed: bool = False
    models: set = field(default_factory=set)  # model keys loaded before (warm)
    shape: tuple[int, int, int, int] = (8, 1, 2, 8)  # (prefix, continuation, layers, vocab) of the loaded protocol
    episodes: list[int] = field(default_factory=list)  # plan indices it ran, in order
    # condition -> (policy, params) of the loaded protocol: what a real worker records (the auditor compares them)
    conditions: dict = field(default_factory=dict)
    cuda: bool = False  # answers as a CUDA worker (module docstring)
    allowance: int = 0  # the loaded protocol's allowance in bytes
    held: dict = field(default_factory=dict)  # the loaded shape's parameter bytes (core/metrics.py opt_bytes)

    @property
    def device(self) -> str:
        return "cuda:0" if self.cuda else "fake"

    @property
    def env(self) -> dict:
        return {"host": "fake-host", "pid": 1000 + self.index, "python": "", "torch": "",
                "cuda": "12.4" if self.cuda else "", "device": self.device,
                "gpu": "NVIDIA H100 80GB HBM3" if self.cuda else "fake-gpu", "gpu_index": str(self.index),
                "threads": 8, "driver": "550.54.15" if self.cuda else "", "gpu_uuid": f"GPU-fake-{self.index}",
                "node_id": self.node}


CONTEXT_BYTES = 500 << 20  # the CUDA context NVML sees beside the allocator


def cuda_measurements(worker: FakeWorker, entry: dict) -> dict:
    """What a CUDA worker's finished episode adds (engine/worker.py `_finished`): the allocator's
    and NVML's peaks (within the allowance), the sampler's summary and its memory trace, an energy
    reading, pinned and context bytes, the other workers busy on the host."""
    peak = worker.allowance // 2 + 4096 * entry["index"]
    sampled = peak + (3 << 20)
    trace = np.array([[0.0, float(peak)], [0.004, float(sampled)], [0.009, float(peak)]], dtype=np.float64)
    return {"memory": {"peak_allocated_bytes": peak - (1 << 20), "peak_reserved_bytes": peak,
                       "peak_sampled_bytes": sampled, "kv_bytes": 8192, "policy_device_bytes": 1 << 20,
                       "host_outgoing_bytes": worker.held["host_outgoing_bytes"], "pinned_bytes": 1 << 20,
                       "device_param_bytes": worker.held["device_param_bytes"],
                       "host_rss_peak_bytes": 1 << 30, "context_bytes": CONTEXT_BYTES},
            "sampler": {"samples": len(trace), "period_s": 0.005, "sampler_overhead_s": 0.0002, "scope": "process",
                        "other_processes": []},
            "energy_j": 12.5 + entry["index"] / 8, "trace": trace,
            "engine": {"mode": "eager", "decode_graph": None, "buffers": 2},
            "host_workers": [[2000 + worker.index, f"GPU-fake-{worker.index + 1}"]],
            "host_load": {"cpu_s": 0.01, "cores": 0.1, "load": [0.5, 0.4, 0.3]}}


@dataclass(eq=False)
class Pending:
    worker: FakeWorker
    tag: Any
    ready_at: float
    value: Any = None
    error: BaseException | None = None


class FakePool:
    """The dispatcher's WorkerPool (service/dispatcher/pool.py), in this process."""

    def __init__(self, *, gpus: int = 1, episode_s: float = 0.002, load_s: float = 0.0,
                 fault: Callable[[FakeWorker, dict], Any] | None = None, cuda: bool = False,
                 load_fault: Callable[[FakeWorker], Any] | None = None) -> None:
        self.n_gpus, self.episode_s, self.load_s, self.fault = gpus, episode_s, load_s, fault
        self.load_fault = load_fault  # per load: None, or "hang" (the load never ends)
        self.cuda = cuda
        self.workers: list[FakeWorker] = []
        self.pending: list[Pending] = []
        self.connected = False
        self.loads: list[tuple[int, str]] = []  # (worker index, model_state) per load

    # -- the interface

    def connect(self) -> None:
        self.connected = True

    def gpus(self) -> int:
        return self.n_gpus

    def start_worker(self, tag: Any, *, pool_size: int) -> FakeWorker:
        worker = FakeWorker(index=len(self.workers), node=f"node-{len(self.workers) % max(1, self.n_gpus)}",
                            cuda=self.cuda)
        self.workers.append(worker)
        self._send(worker, tag, 0.0, value=worker.env)
        return worker

    def load(self, worker: FakeWorker, tag: Any, protocol, model_dir, *, model_cache, reuse: bool) -> None:
        key = protocol.sha256
        state = "warm" if reuse and key in worker.models else "cold"
        worker.models.add(key)
        dims = SHAPES[protocol.model.synth.shape if protocol.model.synth else "tiny"]
        worker.shape = (protocol.prefix_tokens, protocol.continuation_tokens, dims["layers"], dims["vocab"])
        worker.conditions = {c.name: (c.policy, dict(c.params)) for c in protocol.conditions}
        worker.allowance = protocol.allowance_bytes
        self.loads.append((worker.index, state))
        shape = protocol.model.synth.shape if protocol.model.synth else "tiny"
        held = worker.held = opt_bytes(**SHAPES[shape], dtype=protocol.dtype)  # what the auditor expects of the shape
        pending = self._send(worker, tag, self.load_s, value={
            "vocab": SHAPES[shape]["vocab"], "model_dir": model_dir or "", "model_state": state, "read_s": 0.0,
            "pin_s": 0.0, "place_s": 0.0, **{k: held[k] for k in ("param_bytes", "device_param_bytes",
                                                                "host_outgoing_bytes")},
            "cpu_first": True, "allowance_bytes": protocol.allowance_bytes if worker.cuda else 0,
            "context_bytes": CONTEXT_BYTES if worker.cuda else 0, "device": worker.device,
            "entry_to_loaded_s": 0.0})
        if self.load_fault is not None and self.load_fault(worker) == "hang":  # a read that never returns
            pending.ready_at = worker.free_at = math.inf

    def run(self, worker: FakeWorker, tag: Any, entry: dict, prompt: list[int]) -> None:
        fault = self.fault(worker, entry) if self.fault else None
        record = {"plan_index": entry["index"], "condition": entry["condition"], "role": entry["role"],
                  "prompt": entry["prompt"], "episode_s": self.episode_s}
        policy, params = worker.conditions.get(entry["condition"], ("fake", {}))
        record.update(policy=policy, params=params)
        if isinstance(fault, EpisodeFails):
            record.update(status="failed", error=fault.error, traceback=f"Traceback (fake)\n{fault.error}\n",
                          logits=None, trace=None, forced_logits=None)
        else:
            prefix, calls, layers, vocab = worker.shape
            logits = np.zeros((calls, vocab), dtype=np.float32)
            logits[:, entry["prompt"] % vocab] = 1.0  # the same for every condition of a prompt: exact
            zeros = [0] * layers  # a ledger that moved nothing but its logits: what the auditor recomputes
            ledger = [{"index": k, "phase": "decode" if k else "prefill", "tokens": 1 if k else prefix,
                       "layers": layers, "active_rows": zeros, "rows_copied": zeros, "h2d_weight_bytes": zeros,
                       "h2d_index_bytes": zeros, "d2h_bytes": zeros, "logits_d2h_bytes": vocab * 4, "wall_s": 0.0}
                      for k in range(calls)]
            if worker.cuda:
                for call in ledger:
                    call["copy_wait_s"] = [0.0001 * (k + 1) for k in range(layers)]
            record.update(status="ok", error=None, tokens=[entry["prompt"] % vocab] * calls, wall_s=self.episode_s,
                          calls=ledger, **episode_totals(ledger), logits=logits, trace=None, forced_logits=None)
            if worker.cuda:
                record.update(cuda_measurements(worker, entry))
        pending = self._send(worker, tag, fault.seconds if isinstance(fault, Slow) else self.episode_s, value=record)
        if fault == "hang":  # a deadlocked call: neither this reply nor any later one of the worker comes
            pending.ready_at = worker.free_at = math.inf
        elif fault == "die":
            worker.dead_at = pending.ready_at
        elif isinstance(fault, BaseException):
            pending.value, pending.error = None, fault
        else:
            worker.episodes.append(entry["index"])

    def in_flight(self) -> int:
        return len(self.pending)

    def wait(self, timeout: float, *, every: bool = False) -> Iterator[Reply]:
        if not self.pending:
            return
        due = max(p.ready_at for p in self.pending) if every else min(p.ready_at for p in self.pending)
        pause = min(timeout, due - time.monotonic())
        if pause > 0:
            time.sleep(pause)
        clock = time.monotonic()
        for p in sorted((p for p in self.pending if p.ready_at <= clock), key=lambda p: p.ready_at):
            if p in self.pending:  # a killed worker's calls were dropped with it
                self.pending.remove(p)
                yield self._reply(p)

    def kill(self, worker: FakeWorker) -> None:
        worker.killed = True
        self.pending = [p for p in self.pending if p.worker is not worker]

    def nodes(self) -> dict[str, NodeInfo]:
        return {f"node-{i}": NodeInfo("FAKE", {}) for i in range(max(1, self.n_gpus))}

    # -- inside

    def _send(self, worker: FakeWorker, tag: Any, seconds: float, *, value: Any) -> Pending:
        worker.free_at = max(time.monotonic(), worker.free_at) + seconds
        pending = Pending(worker, tag, worker.free_at, value=value)
        self.pending.append(pending)
        return pending

    @staticmethod
    def _reply(p: Pending) -> Reply:
        if p.worker.dead_at is not None and p.ready_at >= p.worker.dead_at:
            return Reply(p.tag, error=RuntimeError(f"fake worker {p.worker.index} died"), died=True)
        return Reply(p.tag, value=p.value, error=p.error)
