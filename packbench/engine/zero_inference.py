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

The configuration is DeepSpeed's own for ZeRO-Inference (DeepSpeedExamples,
inference/huggingface/zero_inference/run_model.py): prefetch bucket and live parameters
2 x hidden^2, persistence threshold `hidden` (vectors below it stay on the device), pinned host
memory. It is written into every episode record (`ZeroStats.ds_config`).

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
import inspect
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from packbench.core.errors import PackbenchError
from packbench.engine.accelerate import layer_of
from packbench.engine.checkpoint import build_weights
from packbench.engine.ledger import Recorder
from packbench.engine.opt_weights import stock_model

OFFLOAD_EXTRA = "offload"
GATHER = "_PartitionedParameterCoordinator__all_gather_params_"  # DeepSpeed 0.19's one gather path


class ZeroInferenceUnavailable(PackbenchError):
    """deepspeed is not installed on this worker, or chose another accelerator (one line, with the fix)."""


def fix() -> str:
    return f"pip install 'packbench[{OFFLOAD_EXTRA}]' (deepspeed is an sdist: pip install --no-build-isolation deepspeed)"


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


def ds_config(*, hidden: int, dtype: torch.dtype, pin_memory: bool) -> dict:
    """DeepSpeed's ZeRO-Inference configuration for batch-1 latency (module docstring), a plain dict."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": dtype == torch.float16},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": pin_memory},
            "stage3_prefetch_bucket_size": 2 * hidden * hidden,
            "stage3_param_persistence_threshold": hidden,
            "stage3_max_live_parameters": 2 * hidden * hidden,
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def init_process_group(ds, device: torch.device) -> None:
    """A one-process group for DeepSpeed (world size 1, rank 0) where none exists: gloo on the CPU,
    nccl on CUDA (the worker's one visible GPU is cuda:0), rendezvous over an explicit TCP address on
    a free port. Nothing of the rendezvous goes into the process environment: MASTER_ADDR /
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
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    # DeepSpeed adopts the group torch already has (no MPI discovery, no environment rendezvous).
    ds.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False,
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
    device_bytes: int  # what the device holds after partitioning (persistent parameters), measured
    offloaded_bytes: int  # the host partitions of every parameter, each once

    def as_dict(self) -> dict:
        return asdict(self)


class ZeroInferenceModel:
    """The checkpoint under DeepSpeed ZeRO-3 parameter offload on `device`. Eager mode only."""

    mode = "eager"
    can_shelve = False

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device) -> None:
        ds = library(device)
        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        weights = build_weights(model_dir, dtype=dtype)  # CPU-first: every tensor in host memory
        self.config = weights.config
        model = stock_model(weights, vars(self.config)).eval()
        hidden = self.config.hidden_size
        before = torch.cuda.memory_allocated(device) if cuda else 0
        self.ds_config = ds_config(hidden=hidden, dtype=dtype, pin_memory=cuda)  # pinning needs a device
        init_process_group(ds, device)
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
        self._cache_kw = "cache" if "cache" in inspect.signature(self._model.forward).parameters else "past_key_values"
        coordinator = engine.optimizer.get_param_coordinator()
        row_bytes = hidden * torch.finfo(dtype).bits // 8
        count_gathers(coordinator, self.owners, self.recorder, device=device, row_bytes=row_bytes, tally=self._tally)
        seen = {id(p): p for p in self._model.parameters()}
        self.stats = ZeroStats(
            library_version=ds.__version__, load_s=time.perf_counter() - t0, ds_config=self.ds_config,
            device_bytes=(torch.cuda.memory_allocated(device) - before) if cuda else 0,
            offloaded_bytes=sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in seen.values()))

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
