"""The `accelerate` competitor: Hugging Face accelerate's big-model offload (tier exact).

What a user of accelerate runs instead of a packbench loader: the checkpoint read CPU-first
(host memory) into stock transformers' OPT, then `infer_auto_device_map` places whole decoder
layers on the device until `max_memory` is spent and leaves the rest on the host, and
`dispatch_model` hooks every offloaded block (`AlignDevicesHook`) so that each forward call
copies its weights to the device before it runs and drops them after. The arithmetic is stock
OPT's on the same device, so its logits are dense-stream's bit for bit (tests/engine/test_accelerate.py).

Where the allowance leaves accelerate no room for even one decoder layer beside the one it keeps
free for its hooks, its map places nothing on the device; the model then runs under accelerate's
full offload (`cpu_offload`: every module copied each call, `device_bytes` 0) rather than left on
the host, where its first call would fail on mixed devices (`places_on_device`, `full_offload`).

`max_memory` for the device is the protocol's allowance less what the worker holds there beside
the weights: the CUDA context (measured, `context_bytes`), whatever is allocated already
(`held_bytes`), the episode's KV cache at the protocol's batch and a working margin for activations (KV_MARGIN). Given the whole allowance, accelerate fills it with weights
and the first call's KV cache has no room under the imposed cap.

Bytes are COUNTED, not estimated: every offloading hook's `pre_forward` is wrapped
(`count_copies`); after accelerate placed the block's tensors, each one now on another device
than its host copy was copied, and its bytes go to the ledger of the block's decoder layer.
accelerate moves whole tensors, and every OPT tensor holds a whole number of `hidden`-sized
rows, so the ledger's `rows_copied` counts those rows (weight bytes = rows x row bytes, as the
auditor checks); a remainder that is not a whole row would go to `h2d_index_bytes`. A tied
tensor accelerate already holds on the device in the same call is not counted again. Inputs are
not counted: token ids are made on the device and every module runs there.

**MoE checkpoints** (Mixtral, Qwen3-MoE, OLMoE: core/moe.py FAMILIES) run the same way, as
accelerate's users run them: transformers' own `from_pretrained` into host memory (eager attention
and the eager expert loop, as CpuFirstMoE forces them, so the arithmetic is the loader policies'),
then `infer_auto_device_map` with the model class's own `_no_split_modules` (its whole decoder
layer: what `from_pretrained(device_map="auto", max_memory=...)` uses) fills the allowance with
whole layers, embeddings first, and leaves the rest, experts and all, on the host for its hooks to
copy every call. A row of the ledger is then one expert (`3 x hidden x intermediate` values, the
row of every MoE loader policy, so the auditor's row check holds across the screen): an offloaded
layer's fused experts tensors move as E whole rows; attention, norms and routers (not whole
experts) go to `h2d_index_bytes`.

`AcceleratedModel` offers what the episode loop (engine/episode.py) reads: `device`,
`recorder`, `mode`, `new_cache`, `forward`. Mode eager only (core.registry.CAPTURE_REFUSALS).
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import asdict, dataclass
from collections.abc import Callable
from pathlib import Path

import torch

from packbench.core.errors import PackbenchError
from packbench.core.registry import lowbit_fix
from packbench.engine.checkpoint import build_weights
from packbench.engine.hf import cache_keyword
from packbench.engine.ledger import Recorder
from packbench.engine.opt_weights import stock_model

NO_SPLIT = ["OPTDecoderLayer"]  # accelerate places whole decoder layers
KV_MARGIN = 256 << 20  # activations of a call beside the weights (a 2048-token prefill of OPT-13B: ~200 MiB)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
# An MoE layer's fused experts tensors (transformers >= 5): a hook's bytes of these are whole experts.
EXPERT_TENSOR = re.compile(r"(?:^|\.)experts\.(?:gate_up_proj|down_proj)$")


class AccelerateUnavailable(PackbenchError):
    """accelerate is not installed on this worker (one line, with the fix)."""


@dataclass(frozen=True)
class OffloadStats:
    """What placing the model cost and where it went, recorded in every episode of the condition."""

    library_version: str
    load_s: float  # host read + placement + moving the device part, to the last synchronisation
    max_memory_bytes: int  # what accelerate was given for the device (module docstring)
    held_bytes: int  # what the device already held when accelerate placed the model (subtracted from max_memory)
    device_bytes: int  # parameters and buffers accelerate placed on the device
    # Those it left on the host, copied in by its hooks every call, each tensor once. A tensor two
    # offloaded modules share is copied for each (OPT's tied embedding for lm_head as well): the
    # ledger counts every copy, so a call may move more than this.
    offloaded_bytes: int
    offloaded_modules: int  # blocks its hooks move (0 when everything fits, or on the CPU)

    def as_dict(self) -> dict:
        return asdict(self)


def library():
    """accelerate, imported; AccelerateUnavailable (one line, with the fix) where it is not installed."""
    try:
        return importlib.import_module("accelerate")
    except ImportError as e:
        raise AccelerateUnavailable(f"condition policy accelerate requires accelerate ({e}): {lowbit_fix()}") from None


def layer_of(name: str, layers: int) -> int:
    """The decoder layer whose ledger a hooked module's bytes go to: its own, else the last
    (final norm, head) or the first (embeddings)."""
    m = _LAYER.search(name)
    if m:
        return int(m.group(1))
    return layers - 1 if ("final_layer_norm" in name or "lm_head" in name or name == "model.norm") else 0


def kv_bytes(config, capacity: int, dtype: torch.dtype) -> int:
    """An episode's KV cache: keys and values of every layer for `capacity` positions (grouped-query
    attention: the key-value heads' width, where the config says it)."""
    heads = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    width = heads * head_dim if heads and head_dim else config.hidden_size
    return 2 * config.num_hidden_layers * capacity * width * torch.finfo(dtype).bits // 8


def _opt_model(model_dir: Path, dtype: torch.dtype):
    """(stock OPT over the checkpoint's weights in host memory, the weights, a ledger row's bytes:
    one `hidden`-sized row, whole decoder layers kept together)."""
    weights = build_weights(model_dir, dtype=dtype)  # CPU-first: every tensor in host memory
    model = stock_model(weights, vars(weights.config))
    return model, weights, weights.config.hidden_size * torch.finfo(dtype).bits // 8, NO_SPLIT


def _moe_model(model_dir: Path, dtype: torch.dtype, family: str):
    """(the stock MoE model in host memory, eager attention and expert loop, None, a ledger row's
    bytes: one expert, the model class's own unsplittable modules)."""
    from packbench.engine.moe.model import force_eager, model_class

    cls = model_class(family)
    model = cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    force_eager(model.config)
    c = model.config
    intermediate = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    row = 3 * c.hidden_size * intermediate * torch.finfo(dtype).bits // 8
    return model.eval(), None, row, list(cls._no_split_modules)


def count_copies(model: torch.nn.Module, recorder: Recorder, *, row_bytes: int,
                 is_row: Callable[[str], bool] | None = None) -> int:
    """Wrap the pre_forward of every offloading AlignDevicesHook in `model` so that the bytes it
    copies to another device are added to `recorder`'s current call (module docstring).
    `is_row(full tensor name)`: the tensors whose bytes count as rows (an MoE layer's fused
    experts tensors, EXPERT_TENSOR), every other one's going to the index bytes; None: all of a
    hook's bytes, in whole rows and a remainder (OPT). Returns how many hooks were wrapped."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    layers = recorder.layers
    wrapped = 0
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        for h in (hook.hooks if isinstance(hook, SequentialHook) else [hook]):
            if isinstance(h, AlignDevicesHook) and h.offload:
                _wrap(h, recorder, layer_of(name, layers), row_bytes, prefix=name, is_row=is_row)
                wrapped += 1
    return wrapped


def _wrap(hook, recorder: Recorder, layer: int, row_bytes: int, *, prefix: str = "",
          is_row: Callable[[str], bool] | None = None) -> None:
    from accelerate.utils import named_module_tensors

    inner = hook.pre_forward

    def pre_forward(module, *args, **kwargs):
        names = [n for n, _ in named_module_tensors(module, include_buffers=hook.offload_buffers,
                                                    recurse=hook.place_submodules, remove_non_persistent=True)]
        sources = {n: hook.weights_map[n] for n in names}
        tied = hook.tied_params_map or {}
        # A tied tensor accelerate already put on the execution device is reused, not copied.
        reused = {n for n, s in sources.items() if hook.execution_device in tied.get(s.data_ptr(), {})}
        out = inner(module, *args, **kwargs)
        placed = dict(named_module_tensors(module, include_buffers=hook.offload_buffers,
                                           recurse=hook.place_submodules, remove_non_persistent=True))
        moved = {n: placed[n].numel() * placed[n].element_size() for n in names
                 if n not in reused and placed[n].device != sources[n].device}
        if is_row is None:
            rows, rest = divmod(sum(moved.values()), row_bytes)
        else:  # a whole layer's hook moves its experts (whole rows) and its attention, norms, router
            row_part = sum(b for n, b in moved.items() if is_row(f"{prefix}.{n}" if prefix else n))
            rows, extra = divmod(row_part, row_bytes)
            rest = sum(moved.values()) - row_part + extra
        recorder.add(layer, rows=rows, weight_bytes=rows * row_bytes, index_bytes=rest)
        return out

    hook.pre_forward = pre_forward


class AcceleratedModel:
    """The checkpoint under accelerate's offload on `device` (module docstring). Eager mode only."""

    mode = "eager"

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device, allowance_bytes: int,
                 context_bytes: int = 0, capacity: int = 0, batch: int = 1, host_bytes: int | None = None,
                 archived: dict | None = None) -> None:
        """`archived`: an archived episode's `offload` section, whose device budget a re-execution
        places the model by again instead of sizing one at this worker's context (replay_max_memory)."""
        lib = library()
        from accelerate import dispatch_model, infer_auto_device_map

        from packbench.engine.moe.model import moe_family

        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        family = moe_family(model_dir)
        model, weights, row_bytes, no_split = (_opt_model(model_dir, dtype) if family is None
                                               else _moe_model(model_dir, dtype, family))
        self.config = model.config
        # What the worker still holds on the device counts too: a torchao model shelved on the host
        # left 258 MiB there on the H200 (docs/benchmarks.md), and accelerate, told the device was
        # empty, placed weights into it until the allowance's cap refused an allocation.
        held = torch.cuda.memory_allocated(device) if cuda else 0
        reserve = context_bytes + kv_bytes(self.config, capacity, dtype) * batch + KV_MARGIN + held
        max_memory = max(0, allowance_bytes - reserve) if cuda else 0
        if cuda and archived is not None:
            from packbench.core.conditions.accelerate import replay_max_memory

            max_memory = replay_max_memory(archived, allowance=allowance_bytes, reserve=reserve)
        if cuda:
            # Every host byte accelerate may use: the model is in host memory already.
            budget = {device.index or 0: max_memory, "cpu": host_bytes or (1 << 50)}
            device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split,
                                               dtype=dtype)
        else:
            device_map = {"": "cpu"}  # no device to offload to: accelerate places everything on the CPU
        if cuda and not places_on_device(device_map):
            full_offload(model, device)
        else:
            dispatch_model(model, device_map=device_map, main_device=device if cuda else None)
        if cuda:
            torch.cuda.synchronize(device)
        self.device, self.dtype = device, dtype
        self.weights = weights
        self.vocab = self.config.vocab_size
        self.recorder = Recorder(self.config.num_hidden_layers)
        self._model = model
        self.row_bytes = row_bytes
        hooked = count_copies(model, self.recorder, row_bytes=row_bytes,
                              is_row=None if family is None else EXPERT_TENSOR.search)
        on_device, offloaded = placed_bytes(model, device_map) if cuda else (0, 0)
        self._cache_kw = cache_keyword(model)
        self.stats = OffloadStats(
            library_version=str(getattr(lib, "__version__", "")), load_s=time.perf_counter() - t0,
            max_memory_bytes=max_memory, held_bytes=held, device_bytes=on_device,
            offloaded_bytes=offloaded, offloaded_modules=hooked)

    def new_cache(self, capacity: int | None = None, *, mode: str | None = None, batch: int = 1):
        if (mode or self.mode) != "eager":
            raise ValueError("an accelerate condition runs in mode eager only")
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One call: (B, T) token ids in, last-position logits out (on the device): (vocab,) at
        batch 1, (B, vocab) for a batch."""
        out = self._model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1] if ids.shape[0] == 1 else out.logits[:, -1]


def places_on_device(device_map: dict) -> bool:
    """Whether accelerate's device map puts any module on a device. Under an allowance too small
    for one decoder layer beside the room `infer_auto_device_map` keeps for its largest one (a
    Mixtral-8x7B layer is 2.7 GiB), the map is `{"": "cpu"}`; `dispatch_model` then moves the model
    to the host whole and attaches no hook, and the first call fails on mixed devices (token ids on
    the GPU, the embedding on the host); forced to hook it (`force_hooks`), it would extract the
    offloaded weights of module "" by the prefix "." and find none. Such a model runs under
    accelerate's full offload instead (`full_offload`)."""
    return any(where not in ("cpu", "disk") for where in device_map.values())


def full_offload(model: torch.nn.Module, device: torch.device) -> None:
    """accelerate's `cpu_offload`: every module with weights hooked to copy them from the host
    state dict to `device` before it runs and drop them after (the hooks `count_copies` counts),
    the model's inputs and outputs on `device`."""
    from accelerate import cpu_offload

    cpu_offload(model, execution_device=device)


def placed_bytes(model: torch.nn.Module, device_map: dict) -> tuple[int, int]:
    """(bytes on the device, bytes offloaded to the host) once `model` is placed by `device_map`.
    Under full offload (a map that places nothing, `full_offload`) `cpu_offload` hooks only the
    parameters and moves buffers (a rotary embedding's inv_freq) to the device: they are the
    device's, or the offloaded bytes would exceed what the hooks copy a call."""
    if not places_on_device(device_map):
        params = _bytes(model, "", buffers=False)
        return _bytes(model, "") - params, params
    on_device = sum(_bytes(model, prefix) for prefix, where in device_map.items() if where not in ("cpu", "disk"))
    return on_device, _bytes(model, "") - on_device


def _bytes(model: torch.nn.Module, prefix: str, *, buffers: bool = True) -> int:
    """Bytes of the checkpoint's tensors under module `prefix` ("" = all), tied ones once, read
    from the host copies accelerate keeps (an offloaded tensor's own storage is `meta`);
    `buffers=False`: parameters only."""
    module = model.get_submodule(prefix) if prefix else model
    seen: set[int] = set()
    total = 0
    for name, t in [*module.named_parameters(), *(module.named_buffers() if buffers else ())]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
