"""The plain worker class behind the Ray GPU actor (cluster/worker.py wraps it, nothing more).

It loads one checkpoint CPU-first, then runs planned episodes one at a time and returns each
as a record (plain dict + a numpy logits array). An episode that raises (an out-of-memory under
the allowance, say) comes back as a failed record with its cause; the worker stays usable.
"""

import gc
import os
import platform
import resource
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from packbench.core.canonical import canonical_sha256
from packbench.core.reexecute import placement_identity
from packbench.core.files import read_json_object
from packbench.core.errors import CheckpointError
from packbench.core.metrics import episode_totals
from packbench.core.provenance import checkpoint_digest
from packbench.core.registry import mode_refusal, tier_of
from packbench.core.trace import trace_bytes
from packbench.core.protocol import Protocol, expand
from packbench.engine.conditions import RUNTIMES
from packbench.engine.conditions.base import CompetitorRuntime
from packbench.engine.episode import EpisodeOutput, run_episode
from packbench.engine.gpu_lock import GpuLock, HostPresence, host_gpu_index, host_gpus
from packbench.engine.graph import check_mode
from packbench.engine.model import CpuFirstModel
from packbench.engine.passes import PassMismatch, two_passes
from packbench.engine.placed import place_once
from packbench.engine.policies.base import BUFFERS_LAYOUT
from packbench.engine.allowance import impose, lift
from packbench.engine.sampler import MemorySampler, device_uuid, nvml_handle
from packbench.engine.dtypes import dtype_of
from packbench.engine.synth import synth_checkpoint
from packbench.engine.checkpoint import reads_whole
from packbench.engine.config import MAX_CONFIG_BYTES



def environment(device: torch.device) -> dict:
    """What the archive manifest says about where a screen ran."""
    env = {
        "host": platform.node(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a TorchVersion would make the driver import torch to unpickle it
        "cuda": torch.version.cuda or "",
        "device": str(device),
        "gpu": "",
        "gpu_index": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "threads": torch.get_num_threads(),  # the host threads its gathers run on
        "driver": "",
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing: the driver is unknown, not fatal
            env["driver"] = "unknown"
    return env


DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "packbench" / "models"


def synth_dir(spec: dict, cache: Path | None = None) -> Path:
    """Where a synthetic model spec is generated on this node (one folder per spec)."""
    return Path(cache or DEFAULT_MODEL_CACHE) / canonical_sha256(spec)[:16]


def model_dir_for(protocol: Protocol, model_dir: str | None, *, cache: Path | None = None) -> Path:
    """The checkpoint directory: the submitted one, or a synthetic spec generated here once
    (under `cache`, Settings.model_cache, forwarded by the dispatcher)."""
    synth = protocol.model.synth
    if synth is None:
        return Path(model_dir)
    spec = synth.as_dict()
    out = synth_dir(spec, cache)

    def build(tmp: Path) -> None:
        if synth.is_moe:  # a routing-calibrated MoE checkpoint, drawn on the CPU: the same bytes on every node
            from packbench.engine.moe.synth import synth_moe

            synth_moe(tmp, shape=spec["shape"], seed=spec["seed"], dtype=spec["dtype"], layers=spec["layers"],
                      profile=spec["routing"])
        else:
            synth_checkpoint(tmp, **spec)

    # One folder per spec, built once per node (engine/placed.py). A cached checkpoint damaged after
    # it was placed (a file truncated or half-copied by hand, a disk that lost its tail, a removal cut
    # short) is generated again: before, every screen of the spec failed on it, told to run `packbench
    # model synth`, which never writes here. Two workers writing one folder let one read a
    # half-written checkpoint.
    try:
        return place_once(out, build, whole=_whole)
    except OSError as e:  # a full or read-only cache
        raise CheckpointError(f"cannot write the synthetic checkpoint into the model cache {out.parent} "
                              f"({e.strerror or e}); free space there, or give --model-cache "
                              f"(PACKBENCH_MODEL_CACHE) a writable directory with room") from None


def _whole(out: Path) -> bool:
    """Whether a cached synthetic checkpoint folder is still whole: its config.json reads as a JSON
    object and its safetensors read whole (`reads_whole`). Every worker renames a finished folder
    into place, so one that exists and is not whole was damaged after it was placed."""
    try:
        read_json_object(out / "config.json", limit=MAX_CONFIG_BYTES)
    except (OSError, ValueError):  # missing, unreadable, not a regular file, not a JSON object
        return False
    return reads_whole(out)


def load_model(path: Path, *, dtype: torch.dtype, device: torch.device, mode: str):
    """The CPU-first model of a checkpoint: OPT (CpuFirstModel) or an MoE family (CpuFirstMoE,
    engine/moe/), which runs the same condition runtimes at expert granularity."""
    from packbench.engine.moe.model import CpuFirstMoE, moe_family

    if moe_family(path) is not None:
        return CpuFirstMoE(path, dtype=dtype, device=device, mode=mode)
    return CpuFirstModel(path, dtype=dtype, device=device, mode=mode)


def checkpoint_key(path: Path) -> tuple:
    """What identifies a checkpoint's bytes cheaply: its folder and each file's name, size, mtime."""
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    return (str(path), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def host_rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def release(model) -> None:
    """Let a dropped competitor go: one whose library holds it from process-wide state (DeepSpeed's
    module-level stack and caches) frees what it holds there, through its own `release`."""
    if hasattr(model, "release"):
        model.release()


def core_share(cores: list[int], index: int, count: int) -> list[int]:
    """The `index`-th of `count` contiguous, near-equal slices of `cores` (never empty)."""
    if not 0 <= index < count:
        raise ValueError(f"GPU index {index} is not one of {count}")
    start, end = len(cores) * index // count, len(cores) * (index + 1) // count
    return cores[start:end] or cores[index % len(cores):][:1]


class Worker:
    def __init__(self, device: str | None = None, *, threads: int | None = None, pin: bool = False) -> None:
        """`threads`: host threads of a CUDA worker's gathers, or of a CPU worker's arithmetic (None:
        a CUDA worker's share of the host's cores, a CPU worker's OMP_NUM_THREADS or torch's default);
        `pin`: pin a CUDA worker to its GPU's share of the cores (Settings.worker_threads/worker_pin)."""
        self.t_entry = time.perf_counter()
        # Under Ray, CUDA_VISIBLE_DEVICES holds only the assigned GPU: it is index 0 here.
        self.device = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self.model: CpuFirstModel | None = None
        self.model_key: tuple | None = None
        self.digests: dict[tuple, str] = {}  # checkpoint_key -> content digest (core.provenance)
        # The device holds one condition's state at a time, so each fits the allowance alone:
        # the CPU-first model's device part (parked on the host while a competitor runs) or ONE
        # competitor (a CompetitorRuntime's model, engine/conditions/), built CPU-first from the
        # same checkpoint when its episode needs it and released when another condition runs.
        # Before, every quantized model stayed on the device beside the CPU-first model's (about
        # 3.6 GB at OPT-2.7B fp16): the H200 screen of bench/competitors_device.sh needed 16000 MiB.
        # This worker is the one owner of that state; runtimes reach it through `hold`,
        # `release_competitor`, `unpark` (engine/conditions/base.py Holder).
        self.competitor: tuple[tuple, Any] | None = None
        self.parked = False  # the CPU-first model's device tensors are on the host
        # Competitors that moved to the host when another condition took the device, kept with
        # their build and compiled step (a model whose `can_shelve` is true: QuantizedModel's).
        self.shelf: dict[tuple, Any] = {}
        # The start record's figures of each kind that prepares ahead (its runtime's start_key),
        # from load(): the quantized build figures per method.
        self.prepared: dict[str, dict] = {}
        # prompt -> (plan index, tokens) of the first finished reference episode of the current
        # screen: what an approximate episode of that prompt is teacher-forced on.
        self.reference_runs: dict[int, tuple[int, list[int]]] = {}
        self.reference: str | None = None
        self.loads = 0
        self.previous: dict | None = None  # the last episode this worker ran: each record names it
        self.placement: dict | None = None  # the running episode's archived placement (run's `placement`)
        self.conditions: dict[str, tuple[str, dict]] = {}
        self.separate_passes = False  # the loaded protocol's `passes: separate` (engine/passes.py)
        self.traced, self.protocol_sha = False, None  # the loaded protocol's `trace: true`, its hash
        uuid = device_uuid(self.device.index) if self.device.type == "cuda" else None
        self.gpu_uuid = uuid  # which physical GPU: two workers on one GPU would share it
        # One worker per physical GPU on this host, even across clusters (engine/gpu_lock.py).
        self.gpu_lock = GpuLock(uuid) if uuid else None
        self.gpu_busy = self.gpu_lock.busy_message(uuid) if self.gpu_lock and not self.gpu_lock.held else None
        if self.device.type == "cpu" and device is None and host_gpus() > 0:
            # Given a GPU id the host does not have (a cluster declaring more GPUs than exist):
            # running on the CPU instead would be a silent, different benchmark.
            self.gpu_busy = (f"no usable CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}) "
                             f"on a host with {host_gpus()} GPU(s); declare no more GPUs than the host has")
        self.nvml = nvml_handle(uuid)
        if self.device.type == "cuda":
            # Host gathers run on OMP threads. One worker per GPU shares the host's cores with the
            # others: two workers of 32 threads each on a 32-core host ran a screen 7x slower than
            # one alone (nvidia-h200-x2, docs/experiments/queue.md "Queue on two GPUs").
            # `threads` (--worker-threads, core/settings.py) fixes the count instead.
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, host_gpus())))
            index = host_gpu_index(uuid) if uuid and pin else None
            if index is not None:  # threads made from here on (the host gathers' OMP pool) inherit it
                os.sched_setaffinity(0, core_share(sorted(os.sched_getaffinity(0)), index, host_gpus()))
        elif threads:
            # A CPU worker's logits come from host arithmetic, and some of its kernels split their
            # sums by thread count: a tiny Qwen3-MoE's float32 logits at 2 threads differed from
            # those at 1, 3 and 4 (tests/engine/test_cpu_threads.py). A re-execution runs on the
            # archive's count (service/audit.py).
            torch.set_num_threads(threads)
        self.sampler = MemorySampler(uuid)  # one helper process for the worker's life
        # Other packbench workers on this host share its cores and memory, whatever their device
        # or cluster: each episode records which were busy meanwhile (engine/gpu_lock.py).
        self.presence = HostPresence(uuid or self.device.type)

    def describe(self) -> dict:
        """Where this worker runs; `gpu_busy` says why it must not run anything (its GPU is taken)."""
        return {**environment(self.device), "gpu_busy": self.gpu_busy}

    def load(self, protocol: Protocol | dict, model_dir: str | None, *, model_cache: str | None = None,
             reuse: bool = True, mode: str | None = None) -> dict:
        """Make the CPU-first model for a frozen protocol ready and impose its allowance on CUDA.

        A worker lives across screens: with `reuse`, a model already loaded from the same
        checkpoint (same files, sizes and mtimes) in the same dtype is kept ("warm"); otherwise
        it is dropped and the new one read ("cold"). `model_state` says which, and the start
        times are those of the load that read it. The clock of `first_logit_since_entry_s`
        starts at the actor's entry for its first load and at this call for later ones.

        `mode` is the execution mode of every episode (engine/graph.py MODES): the argument if
        given, else the protocol's `engine.mode` ("eager" for every protocol frozen before modes
        existed). The reference runs in the same mode as the conditions it judges.
        """
        self.presence.busy()  # a read loads the host's memory: other workers' records name this one
        try:
            return self._load(protocol, model_dir, model_cache=model_cache, reuse=reuse, mode=mode)
        finally:
            gc.freeze()  # the model and libraries live on: out of every later collection's scan
            self.presence.idle()

    def _load(self, protocol: Protocol | dict, model_dir: str | None, *, model_cache: str | None, reuse: bool,
              mode: str | None) -> dict:
        t_call = time.perf_counter()
        if self.loads:
            self.t_entry = t_call
        self.loads += 1
        if mode is None and isinstance(protocol, dict):
            mode = (protocol.get("engine") or {}).get("mode")
        protocol = expand(protocol)  # a typed Protocol passes through; a stored body is validated once
        self.mode = check_mode(mode or protocol.engine_mode)
        path = model_dir_for(protocol, model_dir, cache=None if model_cache is None else Path(model_cache))
        self.model_cache = None if model_cache is None else Path(model_cache)  # flexgen converts its layout there
        key = (checkpoint_key(path), protocol.dtype, self.mode)
        # What is measured is pinned: the content digest of every checkpoint file, hashed once
        # per checkpoint_key (a warm model keeps it). A cold load hashes while it reads (hashlib
        # and the reads release the interpreter lock): hashing 2.6 GB first added about 1.3 s
        # to every cold start. A protocol pinning another digest is refused before any episode,
        # and the model just read is dropped.
        digest = self.digests.get(key[0])
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-digest") as hashing:  # waits, even on failure
            pending = hashing.submit(checkpoint_digest, path) if digest is None else None
            warm = reuse and self.model is not None and self.model_key == key
            if not warm and self.model is not None:
                self.drop_model()  # before the new allowance: the old model must not count against it
            allowance = protocol.allowance_bytes
            self.allowance = allowance
            context = impose(self.device, allowance, self.nvml) if self.device.type == "cuda" else 0
            if not warm:
                self.model = load_model(path, dtype=dtype_of(protocol.dtype), device=self.device, mode=self.mode)
                self.model_key = key
        if pending is not None:
            try:
                digest = self.digests[key[0]] = pending.result()
            except BaseException:
                self.drop_model()
                raise
        if protocol.model.sha256 is not None and protocol.model.sha256 != digest:
            self.drop_model()
            raise CheckpointError(f"{path} has content digest {digest}, the protocol pins {protocol.model.sha256}: "
                                  f"the checkpoint changed since the protocol was written; restore it or freeze "
                                  f"a new protocol")
        self.model.recorder.enabled = protocol.recording
        self.separate_passes = protocol.separate_passes  # a timing pass, then a recording pass (engine/passes.py)
        self.traced = protocol.traced  # each episode's trace of active sets archived (docs/traces.md)
        self.protocol_sha = protocol.sha256
        self.conditions = {c.name: (c.policy, dict(c.params)) for c in protocol.conditions}
        self.reference, self.reference_runs = protocol.reference, {}
        self.path, self.dtype, self.capacity = path, dtype_of(protocol.dtype), protocol.prefix_tokens + protocol.continuation_tokens
        self.context = context
        self.batch = protocol.batch  # sequences decoded together: a competitor sizes its KV cache by it
        self.continuation = protocol.continuation_tokens
        self._prepare(protocol)
        s = self.model.start
        return {"read_s": s.read_s, "pin_s": self.model.host.pin_s, "place_s": s.place_s,
                "device_param_bytes": s.device_param_bytes, "host_outgoing_bytes": s.host_outgoing_bytes,
                "param_bytes": s.device_param_bytes + s.host_outgoing_bytes,
                "cpu_first": True,  # CpuFirstModel never places the outgoing weights on the device
                "allowance_bytes": allowance, "context_bytes": context, "device": str(self.device),
                "vocab": self.model.vocab, "model_dir": str(path), "model_state": "warm" if warm else "cold",
                # what an active row is: an MoE model's expert or OPT's neuron (core/report.py unit_name)
                "unit": "expert" if hasattr(self.model, "expert_record") else "row",
                "engine": {"mode": self.mode}, "model_sha256": digest,
                **self.prepared,
                "entry_to_loaded_s": time.perf_counter() - self.t_entry}

    def _prepare(self, protocol: Protocol) -> None:
        """Every kind the protocol names checks and builds what it needs before any episode (a
        missing library or kernel, a mode the CUDA stack refused: ConditionRuntime.check and
        prepare raise); their figures go to the start record. With no kind holding a model of its
        own, the device is the CPU-first model's again."""
        by_kind: dict[str, list] = {}
        for c in protocol.conditions:
            by_kind.setdefault(c.policy, []).append(c)
        self.prepared = {r.start_key: {} for r in RUNTIMES.values() if r.start_key is not None}
        for policy, conditions in by_kind.items():
            RUNTIMES[policy].check(self, conditions)
        for policy, conditions in by_kind.items():
            figures = RUNTIMES[policy].prepare(self, conditions)
            if figures is not None:
                self.prepared[RUNTIMES[policy].start_key] = figures
        keys = {self._competitor_key(c.policy, dict(c.params), RUNTIMES[c.policy]) for c in protocol.conditions
                if isinstance(RUNTIMES[c.policy], CompetitorRuntime)}
        self.shelf = {k: m for k, m in self.shelf.items() if k in keys}
        if not keys:
            self.release_competitor()
            self.unpark()

    def hold(self, policy: str, params: dict, runtime: CompetitorRuntime) -> tuple[Any, str]:
        """The device holding only condition (`policy`, `params`)'s own model: the CPU-first
        model parked, another competitor released, this one built (`runtime.build`) if it is not
        the one held. Returns it and "warm" (held already), "shelved" (moved back from the host)
        or "cold" (built now)."""
        key = self._competitor_key(policy, params, runtime)
        self.model.release_policy()  # the last exact condition's buffers are not its to hold
        self.park()
        if self.competitor is not None and self.competitor[0] == key:
            return self.competitor[1], "warm"
        self.release_competitor()
        if key in self.shelf:
            model = self.shelf.pop(key)
            model.unshelve()
            self.competitor = (key, model)
            return model, "shelved"
        model = runtime.build(self, params)
        self.competitor = (key, model)
        return model, "cold"

    def _competitor_key(self, policy: str, params: dict, runtime: CompetitorRuntime) -> tuple:
        """What identifies a built competitor: its policy, its runtime's identity of the params
        (a low-bit method, say), dtype and checkpoint."""
        # An archived placement is another build: a competitor placed otherwise is not reused.
        placed = None if self.placement is None else placement_identity(self.placement)
        return (policy, runtime.identity(params), self.dtype, str(self.path), placed)

    def lift_allowance(self) -> None:
        """No device cap for this episode (a speed reference): re-imposed after it, as after every one."""
        lift(self.device)

    def park(self) -> None:
        """Move the CPU-first model's device tensors (everything but the outgoing weights, which
        stay on the host anyway) to the host, so a competitor has the allowance to itself."""
        if not self.parked and self.model is not None:
            self.model.weights.to("cpu")
            self.parked = True
            self._free()

    def unpark(self) -> None:
        if self.parked and self.model is not None:
            self.model.weights.to(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.parked = False

    def release_competitor(self) -> None:
        """Free the device of the competitor it holds: shelved on the host where it can be
        (QuantizedModel.can_shelve), else dropped and rebuilt when its condition runs again."""
        if self.competitor is not None:
            key, model = self.competitor
            self.competitor = None
            outside = getattr(model, "outside_allocator", False)
            if getattr(model, "can_shelve", False):
                model.shelve()
                self.shelf[key] = model
            else:
                release(model)
            del model
            self._free()
            if outside and self.device.type == "cuda":
                # its memory was measured as context while it was held (engine/llama_cpp.py): measured
                # again now it is gone, so the next condition's cap and sizing are not short of it
                self.context = impose(self.device, self.allowance, self.nvml)

    def _free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_model(self) -> None:
        """Release the loaded model (host and device memory) before another one is read."""
        if self.model is not None:
            self.model.release_policy()
        if self.competitor is not None:
            release(self.competitor[1])
        self.model, self.model_key = None, None
        self.competitor, self.parked, self.shelf = None, False, {}
        gc.unfreeze()  # the dropped model's cycles must be collectable
        self._free()

    def run(self, entry: dict, prompt: list[int] | list[list[int]], *, placement: dict | None = None) -> dict:
        """One planned episode -> record (see core/gates.py for the fields the gates read).

        `prompt` is the entry's prompt token ids, or for a batch entry (one with `prompts`,
        core/plan.py) the list of its prompts' ids (core.plan.episode_input): then the record's
        tokens hold one list per sequence and its logits are (batch, calls, vocab).

        `host_workers` names the other packbench workers on this host that were busy (loading or
        running an episode) at some moment of this one: they shared its cores and memory.
        `host_load` is what any other process took meanwhile (engine/host_load.py).

        `placement`: the archived episode's `offload` section, handed over by a re-execution
        (core/reexecute.py): a competitor is then placed as the archive says, not chosen again at
        this worker's context, or fails with PlacementDoesNotFit where its device cannot hold it."""
        from packbench.engine.host_load import cpu_snapshot, host_load

        started = time.time()
        before = cpu_snapshot()
        self.presence.busy()
        collecting = gc.isenabled()
        gc.disable()  # no collection inside an episode's wall (docs/metrics.md, "Plan position")
        self.placement = placement
        try:
            record = self._run(entry, prompt)
        finally:
            self.placement = None
            if collecting:
                gc.enable()
            self.presence.idle()
        previous, self.previous = self.previous, {"condition": entry["condition"], "plan_index": entry["index"],
                                                  "load": self.loads}
        return {**record, "previous": previous, "host_workers": self.presence.others(since=started),
                "host_load": host_load(before, cpu_snapshot())}

    def _run(self, entry: dict, prompt: list[int] | list[list[int]]) -> dict:
        assert self.model is not None, "load() first"
        policy, params = self.conditions[entry["condition"]]
        tier = tier_of(policy)
        record = {"plan_index": entry["index"], "condition": entry["condition"], "role": entry["role"],
                  "prompt": entry["prompt"], "policy": policy, "params": params, "engine": {"mode": self.mode},
                  "tier": tier, **({"prompts": entry["prompts"]} if "prompts" in entry else {})}
        t0 = time.perf_counter()
        forced, forced_from, forced_s = None, None, None
        try:
            model, mode, built = RUNTIMES[policy].enter(self, policy, params)
            # Exact episodes only (docs/archive.md): host-experts computes on the CPU-first model
            # too, yet is approximate, and its trace was a member the auditor refused.
            tracer = self._tracer(entry) if model is self.model and tier == "exact" else None
            try:
                out, sampled, passes = self._measure(model, prompt, mode, policy=policy, params=params)
            finally:
                if tracer is not None:
                    tracer.close()
            if tracer is not None:
                record["active_sets"] = trace_bytes(tracer.trace())
            if built is not None and out.decode_graph is None:  # a competitor in mode eager: say why
                why = mode_refusal(policy, params, "graph")
                out.decode_graph = f"eager: {why or 'the mode its condition froze'}"
            if tier == "approximate" and entry["prompt"] in self.reference_runs:
                # Teacher-forced on the reference's tokens, after the measured free run (its time
                # and peaks are the free run's): the logits fidelity is judged on. With separate
                # passes, once, after both.
                forced_from, ref_tokens = self.reference_runs[entry["prompt"]]
                t_forced = time.perf_counter()
                forced = run_episode(model, prompt, continuation=self.continuation, mode=mode,
                                     forced=ref_tokens).logits
                forced_s = time.perf_counter() - t_forced
        except Exception as e:  # recorded, never retried into a pass
            failure = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                       "traceback": traceback.format_exc(limit=5),
                       **({"passes": e.passes} if isinstance(e, PassMismatch) else {})}
        else:
            failure = None
        if failure is not None:  # out of the except block: its traceback's frames, which held the
            model = None  # model (a failed competitor, a half-made graph), are gone before the device is freed
            return self._failed(record, failure, t0)
        if entry["condition"] == self.reference:
            self.reference_runs.setdefault(entry["prompt"], (entry["index"], list(out.tokens)))
        p = self.model.slot.policy if model is self.model else None
        # An expert cache or forecast: its counts, the episode's routing and the figures replayed
        # from it (core/expert_cache.py); None for every other policy and model.
        experts = getattr(model, "expert_record", lambda: None)()
        # the context as it is now (it grows as kernels load): what the next competitor is sized from
        context = self.context = impose(self.device, self.allowance, self.nvml) if self.device.type == "cuda" else 0
        record["episode_s"] = time.perf_counter() - t0  # wall_s plus activation and measurement
        return {**record, **self._finished(out, sampled, policy=p, built=built, context=context),
                **({"experts": experts} if experts is not None else {}),
                **({"passes": passes} if passes is not None else {}),
                **({RUNTIMES[policy].record_key: built} if RUNTIMES[policy].record_key is not None else {}),
                **({"forced_from": forced_from, "forced_s": forced_s} if tier == "approximate" else {}),
                "forced_logits": forced}

    def _tracer(self, entry: dict):
        """A Tracer on the model for this episode when the protocol says `trace: true`, else None.
        Its readbacks are not charged to the ledger; they run inside the timed calls."""
        if not self.traced:
            return None
        from packbench.engine.tracing import Tracer

        return Tracer(self.model, source={"checkpoint": str(self.path), "protocol": self.protocol_sha,
                                          "episode": entry["index"], "condition": entry["condition"],
                                          "tool": "packbench worker"})

    def _measure(self, model, prompt: list[int] | list[list[int]], mode: str, *, policy: str,
                 params: dict) -> tuple[EpisodeOutput, dict, dict | None]:
        """The measured run(s) of an episode: (output, the sampler's summary, passes). One run
        with the sampler around it, or with separate passes (engine/passes.py) a timing run and
        a recording run, whose figures `passes` keeps (None for one run)."""
        def run() -> EpisodeOutput:
            return run_episode(model, prompt, continuation=self.continuation, mode=mode)

        if not self.separate_passes:
            self.sampler.start()
            out = run()
            return out, self.sampler.stop(), None
        # The recording pass starts from the state the timing pass started from: a fresh policy
        # (an LRU cache, a forecast); a competitor keeps no state between episodes.
        fresh = (lambda: self.model.use(policy, **params)) if model is self.model else (lambda: None)
        return two_passes(run, recorder=model.recorder, fresh=fresh, sampler=self.sampler)

    def _failed(self, record: dict, failure: dict, t0: float) -> dict:
        """A failed episode's record, its cause on one line; the device freed of whatever the episode left."""
        self.sampler.stop()
        self.model.release_policy()
        # A failed competitor is dropped, not kept or shelved: it may be half built or half
        # moved, and it must not hold the device the next condition needs (an OOM must not
        # poison the episodes after it).
        if self.competitor is not None:
            try:
                release(self.competitor[1])
            except Exception:  # noqa: BLE001 - half built: what could be released was
                pass
        self.competitor = None
        self._free()
        if self.device.type == "cuda":
            try:
                # lifted for an unbounded resident; the context as it is now, for the next competitor's sizing
                self.context = impose(self.device, self.allowance, self.nvml)
            except Exception:  # noqa: BLE001 - a broken context fails the next episode, with its own words
                pass
        return {**record, "status": "failed", **failure, "episode_s": time.perf_counter() - t0,
                "logits": None, "trace": None, "forced_logits": None}

    def _finished(self, out: EpisodeOutput, sampled: dict, *, policy, built: dict | None, context: int) -> dict:
        """A finished episode's measurements: times, ledger totals, memory, sampler, logits."""
        calls = [c.to_dict() for c in out.calls]
        return {"status": "ok", "error": None, "tokens": out.tokens, "wall_s": out.wall_s,
                "engine": {"mode": out.mode, "decode_graph": out.decode_graph, "buffers": BUFFERS_LAYOUT},
                "first_logit_since_entry_s": out.first_logit_at - self.t_entry,
                **episode_totals(calls),
                "memory": {"peak_allocated_bytes": out.peak_allocated_bytes,
                           "peak_reserved_bytes": out.peak_reserved_bytes,
                           "peak_sampled_bytes": sampled["peak_sampled_bytes"],
                           "kv_bytes": out.kv_bytes,
                           "policy_device_bytes": policy.device_bytes() if policy is not None else built["device_bytes"],
                           "host_outgoing_bytes": self.model.host.host_bytes,
                           "pinned_bytes": self.model.host.pinned_bytes + (policy.pinned_bytes() if policy is not None else 0),
                           "device_param_bytes": self.model.start.device_param_bytes,
                           "host_rss_peak_bytes": host_rss_peak_bytes(), "context_bytes": context},
                "sampler": {k: sampled[k] for k in ("samples", "period_s", "sampler_overhead_s", "scope",
                                                    "other_processes")},
                "energy_j": sampled["energy_j"],
                "calls": calls, "logits": out.logits, "trace": sampled["trace"]}
