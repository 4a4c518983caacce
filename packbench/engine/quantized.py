"""The `quantized` competitor: a low-bit model resident on the device (tier approximate).

Not a loader policy: nothing is offloaded, every layer's linear weights are quantized and live
on the device. It is read CPU-first from the same checkpoint as the screen's CPU-first model
(host memory first), then moved to the device one decoder layer at a time and quantized there
(torchao) or as it moves (bitsandbytes), so the device never holds more than one layer in the
checkpoint's precision on top of what is already quantized. Embeddings, LayerNorms and the (tied) lm_head stay in the protocol's dtype:
the logits are read from the same head as the reference's.

Methods (core.registry.QUANT_METHODS): torchao's `int8-weight-only` and `int4-weight-only`,
bitsandbytes' `nf4` and `llm-int8`. A library or kernel that is missing raises
`QuantizationUnavailable`, one line naming what it needs and the extra that brings it.

`QuantizedModel` offers what the episode loop (engine/episode.py) reads from a model: `device`,
`recorder`, `mode`, `new_cache`, `forward`; its ledger records no copies (it moves nothing).
The worker (engine/worker.py) holds one competitor on the device at a time, with the CPU-first
model's device tensors parked on the host meanwhile, so a quantized condition's device memory is
its own model, its KV cache and the CUDA context.
"""

from __future__ import annotations

import gc
import importlib
import time
import types
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from packbench.core.errors import PackbenchError
from packbench.core.registry import COMPETITOR_MODES, QUANT_METHODS, lowbit_fix
from packbench.engine.checkpoint import build_weights
from packbench.engine.hf import cache_keyword
from packbench.engine.ledger import Recorder
from packbench.engine.opt_weights import stock_model


class QuantizationUnavailable(PackbenchError):
    """A quantization method's library or kernel is missing on this worker (one line, with the fix)."""


@dataclass(frozen=True)
class QuantizationStats:
    """What building the model cost, charged in every episode record of the condition."""

    method: str
    library: str
    library_version: str
    quantize_s: float  # host read + per-layer move and quantization, to the last synchronisation
    device_bytes: int  # the quantized model's device footprint (its tensors' storage)
    device_peak_bytes: int  # allocator peak while building (CUDA; 0 on the CPU)
    host_rss_peak_bytes: int  # the worker's host RSS peak after building (read + quantize)

    def as_dict(self) -> dict:
        return asdict(self)


def _library(method: str):
    name = QUANT_METHODS[method]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise QuantizationUnavailable(f"quantized method {method} requires {name} ({e}): {lowbit_fix()}") from None


INT4_GROUP = 128  # int4 weight-only's quantization group along the input features


def own_code(method):
    """A bound method over its own copy of the function's code object. torch.compile keeps compiled
    code per code object and counts each recompilation of it toward
    `torch._dynamo.config.recompile_limit` (8), a hard failure under `fullgraph=True`: compiling the
    one `_call` shared by every QuantizedModel, a long-lived worker's 9th model of another shape or
    method would fail (`FailOnRecompileLimitHit`). With a copy per model each model's compiled
    code counts alone and goes when the model goes."""
    f = method.__func__
    copy = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(copy, method.__self__)


def _torchao(method: str, layer: torch.nn.Module) -> None:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    if method == "int8-weight-only":
        quantize_(layer, Int8WeightOnlyConfig())
        return
    # int4 in tinygemm's tile-packed layout: torch's own `_weight_int4pack_mm` (CUDA, compute
    # capability >= 8.0), from bfloat16 weights; activations go to bfloat16 and the output back to
    # the model's dtype inside the op. torchao's default int4 packing needs the mslk kernel package.
    if layer.fc1.weight.device.type != "cuda":
        raise QuantizationUnavailable(
            f"quantized method int4-weight-only runs tinygemm's CUDA kernel (compute capability >= 8.0); this "
            f"worker's device is {layer.fc1.weight.device.type}: run the screen on a CUDA worker, or pick another "
            f"method (int8-weight-only runs on the CPU)")
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear) and m.in_features % INT4_GROUP == 0]
    if len(linears) != sum(isinstance(m, torch.nn.Linear) for m in layer.modules()):
        raise QuantizationUnavailable(
            f"quantized method int4-weight-only quantizes groups of {INT4_GROUP} input features and this model's "
            f"linears are not all a whole number of them (hidden {layer.fc1.in_features}, "
            f"ffn {layer.fc1.out_features}): pick another method for this shape")
    for m in linears:
        m.weight = torch.nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
    quantize_(layer, Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d"))


def _bitsandbytes(method: str, layer: torch.nn.Module, device: torch.device) -> None:
    """Replace `layer`'s Linears (in host memory) by bitsandbytes' on `device`: each weight is
    quantized as it moves (one host-to-device copy), the new modules are made on `meta` (no random
    initialisation of weights about to be replaced: at OPT-2.7B that initialisation and a device
    round trip made a build take 36 s on the H200); then the LayerNorms follow."""
    import bitsandbytes as bnb

    lowbit = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            w = child.weight.detach().to("cpu")
            bias = None if child.bias is None else child.bias.detach().to("cpu")
            if method == "nf4":
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=bias is not None,
                                        compute_dtype=w.dtype, quant_type="nf4", device="meta")
                new.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
            else:
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias is not None,
                                          has_fp16_weights=False, threshold=6.0, device="meta")
                new.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            if bias is not None:
                new.bias = torch.nn.Parameter(bias, requires_grad=False)
            setattr(parent, name, new.to(device))  # bitsandbytes quantizes as the weight moves
    for module in layer.modules():
        if not isinstance(module, lowbit) and not list(module.children()):
            module.to(device)


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer's storage, through tensor subclasses
    (torchao's quantized tensors hold int8 data plus scales: their own numel says the logical shape)."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.nn.Parameter:
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, n)) for n in names)
        inner = t.data if isinstance(t, torch.nn.Parameter) else t
        if hasattr(inner, "__tensor_flatten__") and type(inner) is not torch.Tensor:
            return size(inner)
        return inner.numel() * inner.element_size()

    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += size(t)
    return total


def _cache_tensors(kv) -> list[torch.Tensor]:
    """A transformers StaticCache's key and value tensors (allocated at its first update)."""
    return [t for layer in kv.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]


class DecodeStep:
    """A captured or compiled decode step of one QuantizedModel, kept across its episodes (the
    static cache it runs on is reset per episode, so the capture or compilation is paid once)."""

    def __init__(self, mode: str, run, setup_s: float) -> None:
        self.mode, self.run, self.setup_s, self.replays = mode, run, setup_s, 0

    def describe(self) -> str:
        """What the archive records as the episode's `decode_graph`."""
        what = "captured" if self.mode == "graph" else "compiled (torch.compile) and captured"
        moved = f", made again after {self.rerecorded} moves to the host" if self.rerecorded else ""
        return f"{what} once in {self.setup_s * 1e3:.1f} ms, replayed {self.replays} times since{moved}"

    rerecorded = 0  # moves to the host survived (QuantizedModel.unshelve captures the graph again)


class QuantizedModel:
    """One quantized OPT on `device` (module docstring).

    Modes (core.registry.COMPETITOR_MODES), chosen per episode by `new_cache(mode=...)`:
    "eager", stock transformers on a DynamicCache; "graph", the same model on a StaticCache with
    the decode step captured as one CUDA graph (replayed with new token id and position);
    "compile", that step compiled by torch.compile (inductor's kernels, without inductor's own
    CUDA graph trees) and then captured as one CUDA graph the same way. packbench captures the
    compiled step itself, rather than through mode="reduce-overhead", so that the graph can be
    dropped when the model is shelved and captured again in milliseconds when it returns, while
    the compiled code stays (torch's graph trees keep their pool on the device and, once reset,
    make the step compile again: over 150 s at OPT-2.7B on the H200). The first decode call of
    the first episode of a mode captures or compiles (DecodeStep.setup_s, in that call's time).
    On the CPU nothing is captured or compiled: the decode runs eagerly on the same StaticCache
    and the archive says why (`decode_graph`), as packbench's own mode graph does.
    """

    mode = "eager"

    def __init__(self, model_dir: Path, *, method: str, dtype: torch.dtype, device: torch.device) -> None:
        if method not in QUANT_METHODS:
            raise ValueError(f"unknown quantized method {method!r}; use one of {', '.join(QUANT_METHODS)}")
        lib = _library(method)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        t0 = time.perf_counter()
        weights = build_weights(model_dir, dtype=dtype)  # CPU-first: every tensor in host memory
        try:
            for layer in weights.model.decoder.layers:
                if QUANT_METHODS[method] == "torchao":
                    layer.to(device)  # then quantized there
                    _torchao(method, layer)
                else:
                    _bitsandbytes(method, layer, device)
            weights.to(device)  # embeddings, final LayerNorm, the tied head
            if cuda:
                torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            raise  # the allowance, not a missing kernel: the attempt fails with the allocator's words
        except (RuntimeError, NotImplementedError, ImportError, AssertionError) as e:
            # e.g. torchao int4 off CUDA (tinygemm's kernel), or a kernel a library build lacks
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise QuantizationUnavailable(f"quantized method {method} cannot run on {device} here: {why} (a kernel "
                                          f"{QUANT_METHODS[method]} needs for it); install what it names, or pick "
                                          f"another method ({lowbit_fix()} brings the libraries, not every kernel)"
                                          ) from None
        quantize_s = time.perf_counter() - t0
        gc.collect()
        from packbench.engine.worker import host_rss_peak_bytes  # one home for the RSS reading

        self.device, self.dtype, self.method = device, dtype, method
        self.weights = weights
        self.config = weights.config
        self.vocab = self.config.vocab_size
        self.recorder = Recorder(len(weights.model.decoder.layers))
        self._model = stock_model(weights, vars(self.config))
        self._cache_kw = cache_keyword(self._model)
        self._static: dict[tuple[int, int], object] = {}  # (capacity, batch) -> the StaticCache modes graph
        # and compile reuse; (capacity, batch, mode) -> the step captured on it
        self._steps: dict[tuple[int, int, str], DecodeStep] = {}
        self._compiled = None  # torch.compile of `_call`, made once and kept while shelved
        self.stats = QuantizationStats(
            method=method, library=QUANT_METHODS[method], library_version=str(getattr(lib, "__version__", "")),
            quantize_s=quantize_s,
            device_bytes=(torch.cuda.memory_allocated(device) - before) if cuda else storage_bytes(weights),
            device_peak_bytes=(torch.cuda.max_memory_allocated(device) - before) if cuda else 0,
            host_rss_peak_bytes=host_rss_peak_bytes())

    @property
    def can_shelve(self) -> bool:
        """Whether `shelve` keeps this model: torchao's quantized tensors move between devices like
        any tensor; bitsandbytes' Int8Params quantize again when moved to CUDA, so its models are
        released and rebuilt instead. An nf4 model that has compiled its step is kept too (its
        Params4bit move quantized, their quant state with them): a rebuild would compile again
        inside the next episode's first decode call."""
        return self.stats.library == "torchao" or (self.method == "nf4" and self._compiled is not None)

    def shelve(self) -> None:
        """Move the model to the host while another condition holds the device (engine/worker.py),
        keeping what is expensive to redo: the quantization and, in mode compile, the compiled
        code (100-230 s at OPT-2.7B on the H200). The captured graphs are dropped, so their memory
        pools leave the device with the weights (`unshelve` captures them again), and the static KV
        caches keep their tensor objects (the compiled code is guarded on them) with their storage
        freed."""
        for step in self._steps.values():
            step.run = step.first = None  # the closures held the CUDA graph and its output
        self.weights.to("cpu")
        for kv in self._static.values():
            kv.graph = None
            for t in _cache_tensors(kv):
                t.untyped_storage().resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def unshelve(self) -> float:
        """Back on the device after `shelve`; returns the seconds it took. Each decode step is
        captured again here, not in the next episode's first decode call, through the compiled code
        `shelve` kept in mode compile. Its writes to the KV cache are zeroed by `new_cache` before the
        episode reads it. The seconds are kept as `unshelve_s`."""
        t0 = time.perf_counter()
        self.weights.to(self.device)  # outside inference mode: torchao's tensors are swapped in, not copied
        with torch.inference_mode():  # the steps write the static caches, made in the forward's inference mode
            for kv in self._static.values():
                for t in _cache_tensors(kv):
                    t.untyped_storage().resize_(t.numel() * t.element_size())
            for (capacity, batch, mode), step in list(self._steps.items()):
                kv = self._static[(capacity, batch)]
                kv.mode = mode
                ids = torch.zeros((batch, 1), dtype=torch.long, device=self.device)
                fresh = self._steps[(capacity, batch, mode)] = self._build_step(kv, ids, 1)
                fresh.replays, fresh.rerecorded = step.replays, step.rerecorded + 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.unshelve_s = time.perf_counter() - t0
        return self.unshelve_s

    def new_cache(self, capacity: int | None = None, *, mode: str | None = None, batch: int = 1):
        mode = mode or self.mode
        if mode == "eager":  # a DynamicCache takes any batch
            from transformers import DynamicCache

            return DynamicCache()
        if mode not in COMPETITOR_MODES:
            raise ValueError(f"unknown competitor mode {mode!r}; use one of {', '.join(COMPETITOR_MODES)}")
        if capacity is None:
            raise ValueError(f"mode {mode} needs the episode's capacity (prefix + continuation tokens)")
        from transformers import StaticCache

        kv = self._static.get((capacity, batch))
        if kv is None:  # its tensors are sized by the batch of its first call
            # One cache (and its captured steps) on the device at a time: a screen has one shape, and
            # a sweep over batch sizes would otherwise keep every earlier size's cache and graph pool.
            self._static.clear()
            self._steps.clear()
            kv = self._static[(capacity, batch)] = StaticCache(config=self._model.config, max_cache_len=capacity)
        else:
            with torch.inference_mode():  # its tensors were made in the forward's inference mode
                kv.reset()  # zeros: the capture and the compiled step keep pointing at these tensors
        kv.length, kv.mode, kv.capacity, kv.batch = 0, mode, capacity, batch
        if getattr(kv, "whole", None) is None:  # every slot of the cache may be attended (causally): `_call`
            kv.whole = torch.ones((batch, capacity), dtype=torch.long, device=self.device)
        kv.eager_reason = None if self.device.type == "cuda" else f"no CUDA graphs on {self.device.type}"
        kv.graph = self._steps.get((capacity, batch, mode))
        return kv

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """One call: (B, T) token ids in, last-position logits out (on the device): (vocab,) at
        batch 1, (B, vocab) for a batch."""
        if getattr(cache, "mode", None) in ("graph", "compile"):
            return self._static_forward(ids, cache)
        with warnings.catch_warnings():
            # bitsandbytes' llm-int8 warns on every call that it casts float32 inputs to float16
            warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
            out = self._model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1] if ids.shape[0] == 1 else out.logits[:, -1]

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """One call on a StaticCache at positions `pos`. The positions and the mask over the whole
        cache are given, not left to transformers' OPT forward: it would derive them from the
        cache's length, a read on the host (`.item()`) that no CUDA graph can capture and that
        breaks torch.compile's graph. Every sequence of a batch is at the same positions."""
        out = self._model(input_ids=ids, position_ids=pos[None].expand(ids.shape[0], -1), attention_mask=cache.whole,
                          cache_position=pos, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1] if ids.shape[0] == 1 else out.logits[:, -1]

    def _static_forward(self, ids: torch.Tensor, kv) -> torch.Tensor:
        """A call on the StaticCache: the prefill and (on the CPU) every decode eagerly; a CUDA
        decode through the captured or compiled step (built at the first one)."""
        start = kv.length
        kv.length += ids.shape[1]
        if start == 0 or kv.eager_reason is not None:
            pos = torch.arange(start, kv.length, device=self.device)
            return self._call(ids, pos, kv)
        key = (kv.capacity, kv.batch, kv.mode)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = kv.graph = self._build_step(kv, ids, start)
            return step.first
        step.replays += 1
        return step.run(ids, start)

    def _build_step(self, kv, ids: torch.Tensor, position: int) -> DecodeStep:
        """Capture the decode step on `kv` as one CUDA graph: of `_call` itself (mode graph) or of
        its compiled code (mode compile, compiled at its first call, the warm-up here). The warm-up
        call's logits are this decode call's answer (`first`)."""
        call = self._call
        if kv.mode == "compile":
            if self._compiled is None:  # no graph trees of inductor's own: the class docstring says why
                # fullgraph: a graph break would be a host step inside the capture
                self._compiled = torch.compile(own_code(self._call), fullgraph=True,
                                               options={"triton.cudagraphs": False})
            call = self._compiled
        static_ids = ids.clone()
        static_pos = torch.full((1,), position, dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # the warm-up call (and the compilation) is this decode call's answer
            first = call(static_ids, static_pos, kv).clone()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # The warm-up wrote position `position`; the capture rewrites the same slot with the same values.
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # ends the capture on the way out, an error included
                logits = call(static_ids, static_pos, kv)
        except RuntimeError as e:  # the capture's end reports "a previous error": name the first one
            first = e.__context__ or e
            raise RuntimeError(f"the {kv.mode} decode step could not be captured as a CUDA graph: "
                               f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}") from e

        def run(new_ids: torch.Tensor, at: int) -> torch.Tensor:
            static_ids.copy_(new_ids)
            static_pos.fill_(at)
            graph.replay()
            return logits

        torch.cuda.synchronize(self.device)
        step = DecodeStep(kv.mode, run, time.perf_counter() - t0)
        step.first = first
        return step
