"""The `zero-inference` competitor: DeepSpeed ZeRO-Inference (ZeRO stage 3, parameters offloaded to
host memory, fetched layer by layer with DeepSpeed's own prefetching).

What a user of ZeRO-Inference runs instead of a packbench loader: the checkpoint read CPU-first
(host memory) into stock transformers' OPT, then `deepspeed.initialize` with ZeRO stage 3 and
`offload_param: {device: cpu, pin_memory: true}` partitions every parameter into a host
partition (`param.ds_tensor`); DeepSpeed's module hooks gather each submodule's parameters onto
the device before it runs (prefetching the next ones from the recorded module trace) and free
them after. The arithmetic is stock OPT's on the same device, so its logits may be dense-stream's
bit for bit: on the CPU they are (tests/engine/test_zero_inference.py); the faithfulness gate
decides on the GPU.

The model is partitioned before `deepspeed.initialize` (`deepspeed.zero.Init(module=...)`, what
DeepSpeedExamples' inference/huggingface/zero_inference/run_model.py gets by building the model
under `HfDeepSpeedConfig`): handed an unpartitioned module, initialize first moves the whole model
onto the device (`_configure_distributed_model`), which no allowance below the model holds.

The configuration keeps DeepSpeed's own prefetching and pinned host memory, persistence threshold
`hidden` (vectors below it stay on the device), and sizes it from the protocol's allowance
(`ZeroBudget`): what is left after the CUDA context, persistent parameters, the KV cache and one
call's activations is the gathered-parameter budget; live parameters and prefetch bucket are that
budget less the largest module (the tied embedding, which DeepSpeed fetches whatever the limit
says), reuse distance 0. An allowance below that minimum is refused in one line naming the
allowance it needs. Without an allowance it is DeepSpeedExamples' latency setting (prefetch
bucket and live parameters 2 x hidden^2). Both the configuration and the arithmetic are written
into every episode record (`ZeroStats.ds_config`, `ZeroStats.budget`).

Bytes are COUNTED, not estimated: the coordinator's gather of a set of parameters
(`PartitionedParameterCoordinator.__all_gather_params_`, fetches and prefetches alike) is wrapped
(`count_gathers`); every parameter it gathers that is not yet available and whose host partition
lives on another device than the execution device is one copy of `ds_tensor` (at world size 1
DeepSpeed's gather is `ds_tensor.to(device)`, partition_parameters.NoGatherHandle), and its bytes
go to the ledger of the parameter's decoder layer, as whole `hidden`-sized rows (remainder to
`h2d_index_bytes`), as accelerate's are. On the CPU the partition already lives on the execution
device: the gathers are counted (`ZeroInferenceModel.gathered_bytes`) but nothing crosses a link
(0 bytes in the ledger).

DeepSpeed reads its accelerator once, at import: the worker sets `DS_ACCELERATOR` to its device's
type before the first import and refuses (one line) a process where DeepSpeed already chose another.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from packbench.core.conditions.zero_inference import SLACK, ZeroBudget, replay_budget, zero_config
from packbench.core.errors import PackbenchError
from packbench.engine.accelerate import layer_of
from packbench.engine.checkpoint import build_weights
from packbench.engine.hf import cache_keyword
from packbench.engine.ledger import Recorder
from packbench.engine.opt_weights import stock_model

OFFLOAD_EXTRA = "offload"
GATHER = "_PartitionedParameterCoordinator__all_gather_params_"  # DeepSpeed 0.19's one gather path


class ZeroInferenceUnavailable(PackbenchError):
    """deepspeed is not installed on this worker, or chose another accelerator (one line, with the fix)."""


def fix() -> str:
    return f"pip install --no-build-isolation 'packbench[{OFFLOAD_EXTRA}]' (deepspeed is an sdist whose build imports torch)"


def library(device: torch.device):
    """deepspeed, imported for `device`'s type (DS_ACCELERATOR); ZeroInferenceUnavailable where it
    is missing or already bound to another accelerator."""
    want = "cuda" if device.type == "cuda" else "cpu"
    os.environ.setdefault("DS_ACCELERATOR", want)  # read once, at DeepSpeed's first import
    try:
        ds = importlib.import_module("deepspeed")
    except ImportError as e:
        raise ZeroInferenceUnavailable(f"condition policy zero-inference requires deepspeed ({e}): {fix()}") from None
    from deepspeed.accelerator import get_accelerator

    got = get_accelerator().device_name()
    if got != want:
        raise ZeroInferenceUnavailable(f"deepspeed chose accelerator {got} in this process but the worker runs on "
                                       f"{want}: start the worker with DS_ACCELERATOR={want}")
    return ds


MIB = 1 << 20


def budget(model: torch.nn.Module, config, *, dtype: torch.dtype, allowance: int, context: int, held: int,
           capacity: int, batch: int, cuda: bool) -> ZeroBudget:
    """`model`'s budget under `allowance` (ZeroBudget); `model` not yet partitioned."""
    from packbench.core.conditions.zero_inference import activation_bytes
    from packbench.engine.accelerate import kv_bytes

    threshold = config.hidden_size
    seen = {id(p): p for p in model.parameters()}.values()
    persistent = sum(p.numel() * p.element_size() for p in seen if p.numel() <= threshold)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False) if p.numel() > threshold)
                  for m in model.modules())
    return ZeroBudget(allowance=allowance, context=context, held=held, persistent=persistent,
                      kv=kv_bytes(config, capacity, dtype) * batch,
                      activations=activation_bytes(vars(config), capacity=capacity, batch=batch,
                                                   element_bytes=torch.finfo(dtype).bits // 8) + (SLACK if cuda else 0),
                      largest_module=largest, element_bytes=torch.finfo(dtype).bits // 8, threshold=threshold)


class AllowanceTooSmall(ZeroInferenceUnavailable):
    """The allowance cannot hold DeepSpeed's minimum (one line, naming the allowance it needs)."""


def ds_config(*, hidden: int, dtype: torch.dtype, pin_memory: bool, plan: ZeroBudget | None = None) -> dict:
    """DeepSpeed's ZeRO-Inference configuration, a plain dict (core/conditions/zero_inference.py
    zero_config, which the auditor recomputes from the recorded budget). AllowanceTooSmall (one
    line) where `plan` cannot hold the largest module gathered."""
    if plan is not None and not plan.fits:
        raise AllowanceTooSmall(
            f"condition policy zero-inference needs an allowance of at least {-(-plan.needed // MIB)} MiB "
            f"(the largest module's {plan.largest_module} parameters gathered beside the KV cache, "
            f"activations and persistent parameters), the protocol gives {plan.allowance // MIB} MiB: "
            f"raise allowance_mib or drop the condition")
    return zero_config(hidden=hidden, dtype=str(dtype).removeprefix("torch."), pin_memory=pin_memory, plan=plan)


def init_process_group(ds, device: torch.device) -> None:
    """A one-process group for DeepSpeed (world size 1, rank 0) where none exists, gloo on either
    device, rendezvous over an explicit TCP address on a free port. Not nccl on CUDA: at world size 1
    ZeRO's gathers are plain copies and no collective needs it, while its communicator took about
    480 MiB of device memory outside PyTorch's allocator for the rest of the worker's life (the H200:
    the cap every later episode runs under fell from 3.95 to 3.47 GiB at 4800 MiB, and dense-stream,
    packet and phase-switched, which use nearly all of it, ran out of memory). Nothing of the rendezvous goes into the process environment: MASTER_ADDR /
    MASTER_PORT / RANK / WORLD_SIZE left behind there would reach every process this one starts (a
    Ray head started later hands them to its workers, whose own group then rendezvoused on a port
    this process still holds). Only LOCAL_RANK is set, where absent: DeepSpeed's engine reads it
    from the environment and has no other way to be told."""
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", "0")
    if device.type == "cpu":
        # DeepSpeed's CPU backend JIT-compiles a C++ op for shared-memory collectives between the
        # ranks of one host (deepspeed.comm.torch.build_shm_op, tens of seconds of g++ per fresh
        # machine); at world size 1 there is no other rank and ZeRO's gather is a plain copy
        # (NoGatherHandle), so the op is marked unusable and gloo's one-rank group serves instead.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        with socket.socket() as s:  # a free port on this host, for the one-rank rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    # DeepSpeed adopts the group torch already has (no MPI discovery, no environment rendezvous).
    ds.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                        verbose=False)


def moved_bytes(params, device: torch.device) -> list[tuple[torch.nn.Parameter, int]]:
    """(parameter, bytes) of each parameter in `params` a gather will copy across devices: not yet
    available, host partition on another device than `device`."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    out = []
    for p in params:
        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.ds_tensor.device != device:
            out.append((p, p.ds_tensor.numel() * p.ds_tensor.element_size()))
    return out


def count_gathers(coordinator, owners: dict[int, int], recorder: Recorder, *, device: torch.device,
                  row_bytes: int, tally: list[int]) -> None:
    """Wrap `coordinator`'s gather so that each parameter copied to `device` adds its bytes to the
    ledger of its layer (`owners`: id(param) -> layer); `tally[0]` adds every gathered partition's
    bytes, moved or not (module docstring)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    inner = getattr(coordinator, GATHER)

    def gather(params, forward, quantize=False):
        params = list(params)
        tally[0] += sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params
                        if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        per_layer: dict[int, int] = {}
        for p, n in moved_bytes(params, device):
            per_layer[owners[id(p)]] = per_layer.get(owners[id(p)], 0) + n
        for layer, n in per_layer.items():
            rows, rest = divmod(n, row_bytes)
            recorder.add(layer, rows=rows, weight_bytes=rows * row_bytes, index_bytes=rest)
        return inner(params, forward, quantize)

    setattr(coordinator, GATHER, gather)  # an instance attribute: the class's own calls find it


@dataclass(frozen=True)
class ZeroStats:
    """What partitioning the model cost and how it was configured, recorded in every episode."""

    library_version: str
    load_s: float  # host read + partitioning, to the last synchronisation
    ds_config: dict  # the DeepSpeed configuration, verbatim
    budget: dict | None  # ZeroBudget.as_dict(): the allowance's arithmetic behind ds_config (None: no allowance)
    device_bytes: int  # what the device holds after partitioning (persistent parameters), measured
    offloaded_bytes: int  # the host partitions of every parameter, each once

    def as_dict(self) -> dict:
        return asdict(self)


class ZeroInferenceModel:
    """The checkpoint under DeepSpeed ZeRO-3 parameter offload on `device`. Eager mode only."""

    mode = "eager"
    can_shelve = False

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device, allowance_bytes: int | None = None,
                 context_bytes: int = 0, capacity: int = 0, batch: int = 1, archived: dict | None = None) -> None:
        """`archived`: an archived episode's `offload` section, whose budget a re-execution configures
        DeepSpeed with again instead of sizing one at this worker's context (replay_budget)."""
        ds = library(device)
        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        weights = build_weights(model_dir, dtype=dtype)  # CPU-first: every tensor in host memory
        self.config = weights.config
        model = stock_model(weights, vars(self.config)).eval()
        hidden = self.config.hidden_size
        before = torch.cuda.memory_allocated(device) if cuda else 0
        if archived and archived.get("budget") is not None:
            self.budget = replay_budget(archived["budget"], context=context_bytes, held=before)
        else:
            self.budget = None if allowance_bytes is None else budget(
                model, self.config, dtype=dtype, allowance=allowance_bytes, context=context_bytes, held=before,
                capacity=capacity, batch=batch, cuda=cuda)
        # pinning needs a device; AllowanceTooSmall (one line) where the allowance cannot hold DeepSpeed's minimum
        self.ds_config = ds_config(hidden=hidden, dtype=dtype, pin_memory=cuda, plan=self.budget)
        init_process_group(ds, device)
        # Partition first, as ZeRO-Inference's users do (DeepSpeedExamples' run_model.py builds the model
        # under HfDeepSpeedConfig, i.e. deepspeed.zero.Init): each parameter goes to its pinned host
        # partition one at a time. Handed an unpartitioned module, deepspeed.initialize moves the whole
        # model onto the device first (engine._configure_distributed_model: module.to(device)), which
        # no allowance below the model's size holds: on the H200 it filled 3.91 of 3.95 GiB and failed.
        ds.zero.Init(module=model, config_dict_or_path=self.ds_config, remote_device="cpu", pin_memory=cuda)
        engine = ds.initialize(model=model, config_params=self.ds_config)[0]
        engine.module.eval()
        if cuda:
            torch.cuda.synchronize(device)
        self.device, self.dtype, self.vocab = device, dtype, self.config.vocab_size
        self.recorder = Recorder(self.config.num_hidden_layers)
        self._engine, self._model = engine, engine.module
        layers = self.config.num_hidden_layers
        # id(param) -> the layer whose ledger its gathers go to; a tied parameter to its first name's
        # (OPT's embedding, which lm_head gathers again at the end of every call)
        self.owners: dict[int, int] = {}
        for n, p in self._model.named_parameters(remove_duplicate=False):
            self.owners.setdefault(id(p), layer_of(n, layers))
        self._tally = [0]
        self._cache_kw = cache_keyword(self._model)
        coordinator = engine.optimizer.get_param_coordinator()
        row_bytes = hidden * torch.finfo(dtype).bits // 8
        count_gathers(coordinator, self.owners, self.recorder, device=device, row_bytes=row_bytes, tally=self._tally)
        seen = {id(p): p for p in self._model.parameters()}
        self.stats = ZeroStats(
            library_version=ds.__version__, load_s=time.perf_counter() - t0, ds_config=self.ds_config,
            budget=None if self.budget is None else self.budget.as_dict(),
            device_bytes=(torch.cuda.memory_allocated(device) - before) if cuda else 0,
            offloaded_bytes=sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in seen.values()))

    def release(self) -> None:
        """Let the model and every parameter it holds gathered be freed (the worker calls this when
        another condition takes the device): DeepSpeed's hooks removed (`DeepSpeedEngine.destroy`) and
        the model taken off DeepSpeed's module-level stack (`parameter_offload.FWD_MODULE_STACK`, to
        which `deepspeed.initialize` appends the top module for good) and out of the coordinator's
        class-wide `lru_cache` of the parameters to release per submodule, keyed by coordinator and
        module (emptied whole: a worker holds one zero-inference model at a time). Without it the
        engine outlived the condition: on the H200 its gathered parameters held 3.4 GiB of a 4800 MiB
        allowance and every later episode of the screen ran out of memory."""
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        if self._engine is None:
            return
        self._engine.destroy()
        stack = parameter_offload.FWD_MODULE_STACK
        stack[:] = [m for m in stack if m is not self._model]
        cached = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
        while not hasattr(cached, "cache_clear"):  # inside DeepSpeed's instrument_w_nvtx: its closure holds it
            cached = next(c.cell_contents for c in cached.__closure__ if callable(c.cell_contents))
        cached.cache_clear()
        self._engine = self._model = None

    @property
    def gathered_bytes(self) -> int:
        """Every host partition DeepSpeed's hooks have gathered so far, moved or not."""
        return self._tally[0]

    def new_cache(self, capacity: int | None = None, *, mode: str | None = None, batch: int = 1):
        if (mode or self.mode) != "eager":
            raise ValueError("a zero-inference condition runs in mode eager only")
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One call: (B, T) token ids in, last-position logits out: (vocab,) at batch 1, (B, vocab) for a batch."""
        out = self._model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1] if ids.shape[0] == 1 else out.logits[:, -1]
